"""Model stacks built from the components: decoder LM, encoder (BERT), encoder-decoder (2017)."""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tinyformer.config import ModelConfig


def build_model(cfg: ModelConfig, *, check_memory: bool = True) -> nn.Module:
    """The model for ``cfg.arch``. Outside the meta device, a config too large for this machine's memory
    is refused before any allocation (``sizing.check_buildable``) unless ``check_memory`` is False (a
    loader that has checked with the stored element size)."""
    if check_memory and torch.empty(0).device.type != "meta":  # a meta build (sizing, loading) allocates nothing
        from tinyformer.sizing import check_buildable

        check_buildable(cfg)
    if cfg.arch == "decoder":
        from tinyformer.models.decoder import DecoderLM

        return DecoderLM(cfg)
    if cfg.arch == "encoder":
        from tinyformer.models.encoder import EncoderModel

        return EncoderModel(cfg)
    from tinyformer.models.seq2seq import Seq2SeqModel

    return Seq2SeqModel(cfg)


class _SkipInitialisers(TorchFunctionMode):
    """``torch.nn.init``'s in-place initialisers leave their tensor as it is: a model about to be filled from
    disk, or one that only shows its shapes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init" and getattr(func, "__name__", "").endswith("_"):
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def meta_model(cfg: ModelConfig) -> nn.Module:
    """The model for ``cfg`` on the meta device: shapes only, no memory and no initialisation (counters
    read the shapes)."""
    with torch.device("meta"), _SkipInitialisers():
        return build_model(cfg)


def empty_model(cfg: ModelConfig, device: str | torch.device = "cpu") -> nn.Module:
    """The model for ``cfg`` on ``device`` with its weights allocated and not initialised, for a loader that
    assigns the stored tensors. ``torch.empty`` touches no page, so this costs no memory that loading does
    not replace; unlike a meta build, the buffers (RoPE tables) are computed in plain PyTorch: meta tensors
    run Python decompositions whose first call imports torch's compiler (1-2 s of every start)."""
    with torch.device(device), _SkipInitialisers():
        return build_model(cfg, check_memory=False)
