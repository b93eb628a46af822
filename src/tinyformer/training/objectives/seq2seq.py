"""The ``seq2seq`` objective: an encoder-decoder trained on a synthetic task (:mod:`tinyformer.data.synthetic_tasks`).

Token layout (a char tokenizer over the task alphabet): <|bos|> = 0, <|eos|> = 1, <|pad|> = 2, then
the characters. A batch is

    src_ids  (B, S)  source characters, right-padded with pad;  src_mask (B, S)  1 = real, 0 = pad
    tgt_in   (B, T)  [bos, y_1 .. y_n], right-padded
    tgt_out  (B, T)  [y_1 .. y_n, eos], -100 on padding (left out of the loss)

and the loss is the teacher-forced cross-entropy of tgt_out given src_ids and tgt_in. Held-out exact match
(greedy or beam decoding, :func:`exact_match`) is what the run reports.

``tinyformer train --objective seq2seq --task add --preset transformer-tiny`` trains one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from tinyformer.config import ModelConfig
from tinyformer.data.synthetic_tasks import Example, TaskData, get_task, task_tokenizer
from tinyformer.errors import ConfigError
from tinyformer.training.objectives.base import IGNORE, Batch, Objective, eval_mode

if TYPE_CHECKING:
    from tinyformer.data.dataset import TokenDataset
    from tinyformer.data.tokenizer import Tokenizer
    from tinyformer.training.train_config import TrainConfig


def make_batch(examples: Sequence[Example], tokenizer: Tokenizer) -> Batch:
    """Pad a list of (source, target) strings into the tensors described in the module docstring."""
    bos, eos, pad = tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id
    src = [tokenizer.encode(s) for s, _ in examples]
    tgt = [tokenizer.encode(t) for _, t in examples]
    B, S, T = len(examples), max(map(len, src)), max(map(len, tgt)) + 1
    src_ids = torch.full((B, S), pad, dtype=torch.long)
    src_mask = torch.zeros(B, S, dtype=torch.long)
    tgt_in = torch.full((B, T), pad, dtype=torch.long)
    tgt_out = torch.full((B, T), IGNORE, dtype=torch.long)
    for i, (s, t) in enumerate(zip(src, tgt)):
        src_ids[i, : len(s)] = torch.tensor(s)
        src_mask[i, : len(s)] = 1
        tgt_in[i, : len(t) + 1] = torch.tensor([bos, *t])
        tgt_out[i, : len(t) + 1] = torch.tensor([*t, eos])
    return {"src_ids": src_ids, "src_mask": src_mask, "tgt_in": tgt_in, "tgt_out": tgt_out,
            "tokens": int((tgt_out != IGNORE).sum())}


@torch.no_grad()
def decode_examples(model: nn.Module, tokenizer: Tokenizer, examples: Sequence[Example], batch_size: int = 250,
                    num_beams: int = 1, device: torch.device | str = "cpu") -> list[str]:
    """The model's output string for the source of each example: greedy, or beam search with ``num_beams``
    (the best hypothesis, with beam search's default length penalty and early stopping)."""
    from tinyformer.generation.seq2seq import beam_search, greedy_decode

    outputs: list[str] = []
    with eval_mode(model):
        for i in range(0, len(examples), batch_size):
            batch = make_batch(examples[i : i + batch_size], tokenizer)
            src, mask = batch["src_ids"].to(device), batch["src_mask"].to(device)
            # room to overshoot the longest target, which then counts as wrong
            max_new = min(batch["tgt_out"].shape[1] + 2, model.cfg.max_seq_len)
            kwargs = dict(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, max_new_tokens=max_new)
            if num_beams > 1:
                ids = [h[0].output_ids for h in beam_search(model, src, mask, num_beams=num_beams, **kwargs)]
            else:
                ids = greedy_decode(model, src, mask, **kwargs)
            outputs += [tokenizer.decode(row) for row in ids]
    return outputs


def exact_match(model: nn.Module, tokenizer: Tokenizer, examples: Sequence[Example], batch_size: int = 250,
                num_beams: int = 1, device: torch.device | str = "cpu") -> float:
    """Fraction of ``examples`` whose greedy (or beam) output equals the target exactly."""
    outputs = decode_examples(model, tokenizer, examples, batch_size, num_beams, device)
    return sum(out == tgt for out, (_, tgt) in zip(outputs, examples)) / max(1, len(examples))


class Seq2SeqObjective(Objective):
    """Teacher-forced cross-entropy of the target given the source, on a synthetic task (``--task``).

    loss = -1/N sum_{b,t} log p(y_{b,t} | y_{b,<t}, x_b), over the N real target tokens (EOS included).
    """

    name = "seq2seq"
    uses_corpus: ClassVar[bool] = False
    n_heldout = 1000

    def __init__(self, cfg: TrainConfig, tokenizer: Tokenizer, dataset: TokenDataset | None) -> None:
        super().__init__(cfg, tokenizer, dataset)
        self.task = get_task(cfg.task)
        self.data = TaskData(self.task, self.n_heldout, seed=0)
        # a fixed sample of training examples, for the trainer's "train" evaluation
        self._train_eval = self.data.train_examples(self.n_heldout, torch.Generator().manual_seed(20_000))

    @classmethod
    def make_tokenizer(cls, cfg: TrainConfig) -> Tokenizer:
        get_task(cfg.task)
        return task_tokenizer()

    def model_config(self, model_cfg: ModelConfig) -> ModelConfig:
        if model_cfg.arch != "encoder_decoder":
            raise ConfigError(f"objective 'seq2seq' trains an encoder-decoder, but model.arch is {model_cfg.arch!r}; "
                              "use --preset transformer-tiny (or set model.arch=encoder_decoder)")
        need = max(self.task.max_source_len, self.task.max_target_len + 1) + 2
        if model_cfg.max_seq_len < need:
            raise ConfigError(f"task {self.task.name!r} needs model.max_seq_len >= {need}, got {model_cfg.max_seq_len}")
        return model_cfg.replace(vocab_size=self.tokenizer.vocab_size, pad_token_id=self.tokenizer.pad_id)

    def has_split(self, split: str) -> bool:
        return split in ("train", "val")

    def get_batch(self, split: str, generator: torch.Generator, rank: int = 0, world_size: int = 1) -> Batch:
        if split == "train":
            return make_batch(self.data.train_examples(self.cfg.batch_size, generator), self.tokenizer)
        index = torch.randint(0, len(self.data.heldout), (self.cfg.batch_size,), generator=generator).tolist()
        return make_batch([self.data.heldout[i] for i in index], self.tokenizer)

    def eval_batches(self, split: str, max_batches: int | None, rank: int = 0, world_size: int = 1
                     ) -> Iterator[Batch]:
        examples = self.data.heldout if split == "val" else self._train_eval
        B = self.cfg.batch_size
        for n, start in enumerate(range(rank * B, len(examples), B * world_size)):
            if max_batches is not None and n >= max_batches:
                return
            yield make_batch(examples[start : start + B], self.tokenizer)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return model.loss(batch["src_ids"], batch["tgt_in"], batch["tgt_out"], src_mask=batch["src_mask"])

    def sample(self, model: nn.Module, device: torch.device) -> str | None:
        """Held-out exact match (greedy) on 200 examples, and three decoded examples."""
        examples = self.data.heldout[:200]
        outputs = decode_examples(model, self.tokenizer, examples, device=device)
        score = sum(out == tgt for out, (_, tgt) in zip(outputs, examples)) / len(examples)
        lines = [f"{self.task.name}: held-out exact match {score:.1%} (greedy, {len(examples)} examples)"]
        for (src, tgt), got in zip(examples[:3], outputs[:3]):
            lines.append(f"  {src} -> {got}" + ("" if got == tgt else f"   (expected {tgt})"))
        return "\n".join(lines)
