"""User-facing error types.

A :class:`TinyformerError` is a mistake in what the user asked for (a bad config field, a missing
file, an impossible sampler value). The command line prints its message on one line to stderr and
exits non-zero, without a traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class TinyformerError(Exception):
    """User-facing error: the CLI prints its message on one line and exits non-zero."""


class ConfigError(TinyformerError, ValueError):
    """A config field has an invalid value; the message names the field."""


class DataError(TinyformerError):
    """A corpus, tokenizer or data file cannot be used; the message names the file."""


class CheckpointError(TinyformerError):
    """A run folder or checkpoint is missing, corrupt or does not match the config."""


class GenerationError(TinyformerError, ValueError):
    """A prompt or sampler value cannot be used for generation."""


class TemplateLimitError(GenerationError):
    """A chat template ran past its time limit or its size limit while rendering; the message names which."""


class NonFiniteOutputError(TinyformerError):
    """The model's outputs (logits, loss) hold NaN or inf: its weights are corrupt or overflow in this dtype."""


def non_finite_message(where: str) -> str:
    """The one explanation shared by generate, chat, eval and serve."""
    return (f"the model produced non-finite logits (NaN or inf) {where}: its weights are corrupt or overflow in "
            "this dtype; check the run folder (a training run: tinyformer train --resume RUN republishes its "
            "checkpoint) or try --dtype float32")
