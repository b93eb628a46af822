"""Model stacks built from the components: decoder LM, encoder (BERT), encoder-decoder (2017)."""

from __future__ import annotations

from torch import nn

from tinyformer.config import ModelConfig


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model for ``cfg.arch``. Outside the meta device, a config too large for this machine's memory
    is refused before any allocation (``sizing.check_buildable``)."""
    import torch

    if torch.empty(0).device.type != "meta":  # a meta build (sizing, loading) allocates nothing
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
