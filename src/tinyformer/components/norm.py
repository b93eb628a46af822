"""Normalisation layers.

RMSNorm (Zhang & Sennrich, 2019; LLaMA):   y = x / sqrt(mean(x^2) + eps) * (o + g)
                                          (o = ModelConfig.norm_gain_offset: 0, or 1 for Gemma's (1 + g))
LayerNorm (Ba et al., 2016; GPT-2, BERT):  y = (x - mean(x)) / sqrt(var(x) + eps) * g + b

Both normalise over the last dimension; x: (..., d) -> y: (..., d). Statistics are computed in
float32 even for bf16/fp16 inputs (a sum of squares in half precision overflows or loses digits),
then cast back, as the LLaMA reference does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyformer.config import ModelConfig


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (offset + g), with a learned gain g of shape (d,) (initially 1 - offset).

    ``RMSNorm(d, eps, offset)`` with an offset builds an ``OffsetRMSNorm`` (Gemma's (1 + g)): the variant is
    chosen once, at construction."""

    def __new__(cls, dim: int | None = None, eps: float = 1e-5, offset: float = 0.0) -> RMSNorm:
        return super().__new__(OffsetRMSNorm if cls is RMSNorm and offset else cls)

    def __init__(self, dim: int, eps: float = 1e-5, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm is the fused kernel of exactly this formula
        if x.dtype in (torch.float32, torch.float64):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        return y * self.weight


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: y = x / rms(x) * (offset + g), the gain applied in float32, then cast back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (y * (self.offset + self.weight.float())).to(x.dtype)


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * g + b; ``bias=False`` drops b (as in some GPT variants)."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # biased variance (divide by d), as the formula and every reference implementation use
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def build_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """The norm the config asks for, over ``dim`` (default d_model)."""
    d = cfg.d_model if dim is None else dim
    if cfg.norm == "rmsnorm":
        return RMSNorm(d, cfg.norm_eps, cfg.norm_gain_offset)
    return LayerNorm(d, cfg.norm_eps, bias=cfg.norm_bias)
