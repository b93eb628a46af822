"""The interface of a training objective: what a batch is and what loss the trainer minimises.

The trainer knows nothing of tokens or targets; it asks its objective for a batch, for the loss
of a batch and for the model's config. Every objective (``lm.py``, ``mlm.py``, ``seq2seq.py``, ``sft.py``,
``dpo.py``) subclasses :class:`Objective`; the registry by name is in ``__init__.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError

if TYPE_CHECKING:
    from tinyformer.data.dataset import TokenDataset
    from tinyformer.data.tokenizer import Tokenizer
    from tinyformer.training.train_config import TrainConfig

Batch = dict[str, torch.Tensor]
#: the target of a position that carries no loss (cross-entropy's ignore_index)
IGNORE = -100


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode (no dropout) inside the block, and back in the mode it was in after it."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def plain_module(model: nn.Module) -> nn.Module:
    """The module inside a compiled (``_orig_mod``) or data-parallel (``module``) wrapper."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


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
    #: why ``--task`` does not apply, the end of its error message (None: the objective takes a task)
    no_task_reason: ClassVar[str | None] = None

    def __init__(self, cfg: TrainConfig, tokenizer: Tokenizer, dataset: TokenDataset | None) -> None:
        if cfg.task is not None and self.no_task_reason is not None:
            raise ConfigError(f"--task {cfg.task!r} does not apply to objective {self.name!r} {self.no_task_reason}")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.dataset = dataset

    def _block(self) -> int:
        """The tokens of a training sequence (``block_size``, resolved before the objective is used)."""
        assert self.cfg.block_size is not None, "block_size is resolved before the objective is used"
        return self.cfg.block_size

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

    def attach(self, model: nn.Module) -> None:
        """Called once by the trainer with the model being trained, before the first batch: an objective whose
        batches come from the model itself (GRPO samples its completions) keeps it; nothing by default."""

    def train_metrics(self) -> dict[str, float]:
        """Figures added to each training record of metrics.jsonl (e.g. GRPO's rewards since the last record);
        none by default."""
        return {}

    def state(self) -> dict | None:
        """What this objective must carry across a checkpoint for ``--resume`` to continue exactly (JSON
        values), or None when it keeps nothing between batches (the default)."""
        return None

    def load_state(self, state: dict | None) -> None:
        """Restore what :meth:`state` returned (None: a checkpoint without objective state)."""

    def sample(self, model: nn.Module, device: torch.device) -> str | None:
        """A short text showing what the model has learnt, or None when the objective has none."""
        return None
