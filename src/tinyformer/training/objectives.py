"""Training objectives: what a batch is and what loss the trainer minimises.

The trainer knows nothing of tokens or targets; it asks its objective for a batch, for the loss
of a batch and for the model. An objective is a class with this interface (see :class:`Objective`)
registered by name in :data:`OBJECTIVES`; ``tinyformer train --objective NAME`` picks one.

    clm   causal language modelling (GPT, LLaMA): predict token t+1 from tokens <= t,
          loss = -1/N sum_{b,t} log p(x_{b,t+1} | x_{b,<=t})
    sft   the same loss on the assistant tokens of conversations only (training/sft.py)
    dpo   direct preference optimisation on (prompt, chosen, rejected) pairs (training/dpo.py)
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError

if TYPE_CHECKING:
    from tinyformer.data.dataset import TokenDataset
    from tinyformer.data.tokenizer import Tokenizer
    from tinyformer.training.config import TrainConfig

Batch = dict[str, torch.Tensor]


class Objective:
    """Base class of a training objective.

    An objective with ``uses_corpus = True`` (language modelling on text) is handed the run's
    tokenizer and :class:`~tinyformer.data.dataset.TokenDataset`; one with ``uses_corpus = False``
    (a synthetic task) gets ``dataset=None`` and supplies its own tokenizer via :meth:`make_tokenizer`.

    Every batch is a dict of tensors; ``"tokens"`` (optional) is the number of target tokens it
    holds, for throughput figures (default: the element count of ``"input_ids"``).
    """

    name: ClassVar[str] = ""
    # language modelling on the built-in CPython corpus: the report card adds the built-in question task
    scores_builtin_task: ClassVar[bool] = False
    uses_corpus: ClassVar[bool] = True
    #: True when batches are sequences of at most ``block_size`` tokens (resolved from the model when unset)
    uses_block_size: ClassVar[bool] = False
    #: the loss is a mean negative log-likelihood, so exp(loss) is a perplexity (not so for DPO)
    loss_is_nll: ClassVar[bool] = True
    #: how report.md names the validation figure, and the metrics.jsonl field that holds it
    loss_label: ClassVar[str] = "validation loss"
    val_loss_key: ClassVar[str] = "val_loss"
    #: what :meth:`num_tokens` counts, for the console and report.md ("tokens trained on: N assistant tokens")
    token_kind: ClassVar[str] = "tokens"

    def __init__(self, cfg: TrainConfig, tokenizer: Tokenizer, dataset: TokenDataset | None) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.dataset = dataset

    @classmethod
    def make_tokenizer(cls, cfg: TrainConfig) -> Tokenizer:
        """The tokenizer of an objective that does not read a corpus (``uses_corpus = False``)."""
        raise NotImplementedError(f"objective {cls.name!r} reads a corpus; the run trains its tokenizer")

    @classmethod
    def adapt_tokenizer(cls, tokenizer: Tokenizer) -> Tokenizer:
        """The tokenizer a new run of this objective uses, given the one it starts from (e.g. one with
        chat-template tokens added); the same one by default."""
        return tokenizer

    def model_config(self, model_cfg: ModelConfig) -> ModelConfig:
        """The run's model config adapted to this objective (e.g. the architecture it needs)."""
        return model_cfg

    def adapt_pretrained(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``--init-from`` weights made to fit :meth:`model_config` (e.g. embeddings grown); unchanged by default."""
        return tensors

    def describe_data(self) -> str | None:
        """One line about the data of an objective that does not read a corpus, for the run's notes."""
        return None

    def eval_metrics(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Figures added to each evaluation record of metrics.jsonl besides the loss (none by default)."""
        return {}

    def report(self, model: nn.Module, device: torch.device) -> list[str]:
        """Markdown lines this objective adds to the run's report.md (besides the losses); none by default."""
        return []

    def build_model(self, model_cfg: ModelConfig) -> nn.Module:
        from tinyformer.models import build_model

        return build_model(model_cfg)

    def get_batch(self, split: str, generator: torch.Generator, rank: int = 0, world_size: int = 1) -> Batch:
        """One random micro-batch of ``split`` ("train" or "val") for this rank."""
        raise NotImplementedError

    def eval_batches(self, split: str, max_batches: int | None, rank: int = 0, world_size: int = 1
                     ) -> Iterator[Batch]:
        """Fixed (not random) batches of ``split`` for evaluation: the same ones at every evaluation."""
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The scalar mean loss of ``batch`` (what backward() is called on)."""
        raise NotImplementedError

    def num_tokens(self, batch: Batch) -> int:
        return int(batch["tokens"]) if "tokens" in batch else batch["input_ids"].numel()

    def eval_weight(self, batch: Batch) -> int:
        """The weight of ``batch``'s mean loss in the held-out mean (default: its tokens, so the mean is per
        token; a loss per pair weighs pairs)."""
        return self.num_tokens(batch)

    def tokens_per_step(self, sequences: int) -> str | None:
        """How many tokens a step of ``sequences`` sequences trains on, for the start-up line, when that is
        not ``sequences * block_size`` (padded or masked batches); None by default."""
        return None

    @classmethod
    def default_schedule(cls, cfg: TrainConfig) -> dict[str, int]:
        """Schedule fields (``warmup_steps``) this objective sets when the user gave none, from the run's own
        length; none by default (the config's defaults stay)."""
        return {}

    def has_split(self, split: str) -> bool:
        return self.dataset is not None and len(self.dataset.splits.get(split, range(0))) > 0

    def sample(self, model: nn.Module, device: torch.device) -> str | None:
        """A short text showing what the model has learnt, or None when the objective has none."""
        return None


class CausalLM(Objective):
    """Next-token prediction on random windows of the corpus.

    A batch is ``input_ids`` x (B, T) and ``targets`` y (B, T) with y[b, t] = x[b, t + 1], drawn as
    ``B`` windows of ``T + 1`` tokens at uniform random offsets (``TokenDataset.get_batch``).
    """

    name = "clm"
    scores_builtin_task = True

    def __init__(self, cfg: TrainConfig, tokenizer: Tokenizer, dataset: TokenDataset | None) -> None:
        super().__init__(cfg, tokenizer, dataset)
        if cfg.task is not None:
            raise ConfigError(f"--task {cfg.task!r} does not apply to objective 'clm' (language modelling on a "
                              "corpus); choose an objective that has tasks")

    def model_config(self, model_cfg: ModelConfig) -> ModelConfig:
        if model_cfg.arch != "decoder":
            raise ConfigError(f"objective 'clm' trains a decoder, but model.arch is {model_cfg.arch!r}")
        return model_cfg

    def _block(self) -> int:
        assert self.cfg.block_size is not None, "block_size is resolved before the objective is used"
        return self.cfg.block_size

    def get_batch(self, split: str, generator: torch.Generator, rank: int = 0, world_size: int = 1) -> Batch:
        x, y = self.dataset.get_batch(split, self.cfg.batch_size, self._block(), generator, rank, world_size)
        return {"input_ids": x, "targets": y}

    def eval_batches(self, split: str, max_batches: int | None, rank: int = 0, world_size: int = 1
                     ) -> Iterator[Batch]:
        for x, y in self.dataset.iter_eval_batches(split, self.cfg.batch_size, self._block(), rank, world_size,
                                                   max_batches):
            yield {"input_ids": x, "targets": y}

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return lm_loss(model, batch["input_ids"], batch["targets"])

    def sample(self, model: nn.Module, device: torch.device) -> str | None:
        if self.cfg.sample_tokens <= 0:
            return None
        from tinyformer.training.sample import sample_text

        return sample_text(model, self.tokenizer, self.cfg.sample_prompt, self.cfg.sample_tokens, device,
                           seed=self.cfg.seed)


def lm_loss(model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of a decoder's next-token predictions over the targets that are not -100."""
    from tinyformer.models.decoder import DecoderLM

    if isinstance(model, DecoderLM):  # the plain module: its fused head + cross-entropy never stores logits
        return model.loss(input_ids, targets)
    logits = model(input_ids)  # a wrapper (compiled, DDP) must be called through forward
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    inner = getattr(model, "_orig_mod", getattr(model, "module", model))
    if isinstance(inner, DecoderLM) and inner.training and inner.cfg.ffn == "moe":
        loss = loss + inner.router_loss()  # the MoE balancing / z-losses, as DecoderLM.loss adds them
    return loss


#: name -> objective class. Other modules add theirs with ``OBJECTIVES["name"] = TheirObjective``.
OBJECTIVES: dict[str, type[Objective]] = {"clm": CausalLM}

#: Modules that register objectives, imported on first lookup (they import this module, so it cannot
#: import them at its top: the registry is lazy, as the weight adapters' is in interop/adapter.py).
OBJECTIVE_MODULES = ("tinyformer.training.mlm", "tinyformer.training.tasks", "tinyformer.training.sft",
                     "tinyformer.training.dpo")


def _load_objective_modules() -> None:
    for module in OBJECTIVE_MODULES:
        importlib.import_module(module)  # an error inside one is a bug: let it surface


def get_objective(name: str) -> type[Objective]:
    """The objective class registered as ``name``; a ConfigError lists the known ones otherwise."""
    _load_objective_modules()
    if name not in OBJECTIVES:
        raise ConfigError(f"unknown objective {name!r}; known objectives: {', '.join(sorted(OBJECTIVES))}")
    return OBJECTIVES[name]
