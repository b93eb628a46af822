"""Masked language modelling (Devlin et al. 2019, BERT) and the ``mlm`` training objective.

Masking: each ordinary token (not a special token such as [CLS] or padding) is selected with
probability 15%. A selected token is replaced by [MASK] with probability 80%, by a uniformly random
ordinary token with probability 10%, and kept unchanged with probability 10%; the model must
predict the original token at every selected position (labels are -100, ignored, elsewhere):

    loss = -1/|M| sum_{t in M} log p(x_t | x~),   M = selected positions, x~ = the corrupted input

The random and unchanged cases keep the model from learning that only [MASK] positions matter,
since [MASK] never appears when the model is used.

The objective reads windows of the corpus like ``clm``, puts a [CLS] token (the tokenizer's
[CLS], else its BOS) in front of each, and masks them. A tokenizer without a mask token (those
``tinyformer train`` trains) gets one extra embedding row, id = tokenizer.vocab_size, for [MASK];
``extra["mlm"]`` of the model config records the ids.

    tinyformer train --objective mlm --preset bert-tiny --tokenizer char --data input.txt
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError
from tinyformer.training.objectives.base import IGNORE, Batch, Objective

if TYPE_CHECKING:
    from tinyformer.data.dataset import TokenDataset
    from tinyformer.data.tokenizer import Tokenizer
    from tinyformer.training.train_config import TrainConfig

MASK_NAMES = ("[MASK]", "<mask>", "<|mask|>")
CLS_NAMES = ("[CLS]", "<s>", "<|cls|>")
MASK_PROB = 0.15  # the share of ordinary tokens selected for prediction


def mask_tokens(
    input_ids: torch.Tensor,
    *,
    mask_id: int,
    random_ids: torch.Tensor,
    special_ids: Iterable[int] = (),
    generator: torch.Generator | None = None,
    mask_prob: float = MASK_PROB,
    replace_prob: float = 0.8,
    random_prob: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(corrupted inputs, labels) for a batch of token ids (B, T); see the module docstring.

    ``random_ids`` (R,) are the ids a "random" replacement is drawn from (uniformly). Special ids are
    never selected. At least one position is selected when there is any candidate, so the loss is defined.
    """
    candidates = ~torch.isin(input_ids, torch.tensor(list(special_ids), dtype=input_ids.dtype))
    selected = (torch.rand(input_ids.shape, generator=generator) < mask_prob) & candidates
    if not bool(selected.any()) and bool(candidates.any()):
        flat = candidates.flatten().nonzero().squeeze(1)
        pick = flat[torch.randint(0, len(flat), (1,), generator=generator)]
        selected.view(-1)[pick] = True
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, IGNORE))
    action = torch.rand(input_ids.shape, generator=generator)
    to_mask = selected & (action < replace_prob)
    to_random = selected & (action >= replace_prob) & (action < replace_prob + random_prob)
    inputs = input_ids.clone()
    inputs[to_mask] = mask_id
    draws = random_ids[torch.randint(0, len(random_ids), input_ids.shape, generator=generator)]
    inputs[to_random] = draws[to_random]
    return inputs, labels


def _find(tokenizer: Tokenizer, names: Iterable[str]) -> int | None:
    for name in names:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


class MaskedLM(Objective):
    """BERT's masked-LM objective on windows of the corpus (see the module docstring)."""

    name = "mlm"
    loss_label = "validation masked-token loss"
    token_kind = "masked tokens"
    no_task_reason = "(it reads a corpus)"

    def __init__(self, cfg: TrainConfig, tokenizer: Tokenizer, dataset: TokenDataset | None) -> None:
        super().__init__(cfg, tokenizer, dataset)
        found = _find(tokenizer, MASK_NAMES)
        self.mask_id = found if found is not None else tokenizer.vocab_size  # a new row when the vocab has none
        cls_id = _find(tokenizer, CLS_NAMES)
        self.cls_id = cls_id if cls_id is not None else tokenizer.bos_id
        specials = set(tokenizer.backend.get_added_tokens_decoder()) | {self.mask_id, self.cls_id}
        self.special_ids = sorted(i for i in specials if i is not None)
        ordinary = sorted(set(range(tokenizer.vocab_size)) - set(self.special_ids))
        if not ordinary:
            raise ConfigError("the tokenizer has no ordinary tokens to mask")
        self.random_ids = torch.tensor(ordinary, dtype=torch.long)

    def model_config(self, model_cfg: ModelConfig) -> ModelConfig:
        if model_cfg.arch != "encoder":
            raise ConfigError(f"objective 'mlm' trains an encoder, but model.arch is {model_cfg.arch!r}; "
                              "use --preset bert-tiny (or set model.arch=encoder)")
        extra = {**model_cfg.extra, "mlm": {"mask_token_id": self.mask_id, "cls_token_id": self.cls_id}}
        return model_cfg.replace(vocab_size=max(model_cfg.vocab_size, self.mask_id + 1), mlm_head=True, extra=extra)

    def _prepare(self, windows: torch.Tensor, generator: torch.Generator) -> Batch:
        """Windows (B, T) -> [CLS] + the first T-1 tokens, masked."""
        x = windows[:, : self._block() - (1 if self.cls_id is not None else 0)].long()
        if self.cls_id is not None:
            x = torch.cat([torch.full((x.shape[0], 1), self.cls_id, dtype=torch.long), x], dim=1)
        inputs, labels = mask_tokens(x.cpu(), mask_id=self.mask_id, random_ids=self.random_ids,
                                     special_ids=self.special_ids, generator=generator)
        return {"input_ids": inputs, "targets": labels, "tokens": int((labels != IGNORE).sum())}

    def tokens_per_step(self, sequences: int) -> str | None:
        block = self._block()
        return (f"{sequences} sequences x {block} = {sequences * block:,} tokens, of which ~{MASK_PROB:.0%} "
                f"(~{MASK_PROB * sequences * block:,.0f}) are masked: those carry the loss and are what the token "
                "counts count")

    def get_batch(self, split: str, generator: torch.Generator, rank: int = 0, world_size: int = 1) -> Batch:
        x, _ = self.dataset.get_batch(split, self.cfg.batch_size, self._block(), generator, rank, world_size)
        return self._prepare(x, generator)

    def eval_batches(self, split: str, max_batches: int | None, rank: int = 0, world_size: int = 1
                     ) -> Iterator[Batch]:
        batches = self.dataset.iter_eval_batches(split, self.cfg.batch_size, self._block(), rank, world_size,
                                                 max_batches)
        for i, (x, _) in enumerate(batches):
            # the same masks at every evaluation, so that evaluations compare
            yield self._prepare(x, torch.Generator().manual_seed(1_000_003 * (i + 1) + rank))

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return model.loss(batch["input_ids"], batch["targets"])
