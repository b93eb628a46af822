"""A Transformer block: self-attention and FFN sublayers, each wrapped in a residual and a norm.

Pre-Norm (GPT-2 onward, LLaMA):  h = x + Attn(Norm(x));   y = h + FFN(Norm(h))
Post-Norm (Vaswani et al. 2017, BERT):  h = Norm(x + Attn(x));   y = Norm(h + FFN(h))
Sandwich (Gemma 2/3):  h = x + Norm'(Attn(Norm(x)));   y = h + Norm'(FFN(Norm(h)))   (each Norm' its own)

Pre-Norm leaves an identity path from input to output through every layer: each sublayer's
Jacobian is I + dF/dx, so a gradient passes to the block's input unchanged plus the branch's part
(the gradient's size still varies with depth, as docs/experiments/norm_placement.md measures).
Post-Norm normalises the residual stream itself, so it has no such path and gets harder to train
as depth grows. Xiong et al. 2020 argue that deep Post-Norm therefore needs learning-rate warm-up;
in our measurement (same document) a 60-step warm-up did not rescue a 24-layer Post-Norm stack, a
6-layer one trained as well without it, and a 24-layer Pre-Norm stack at the higher learning rate
was the one that needed it.
"""

from __future__ import annotations

import torch
from torch import nn

from tinyformer.components.attention import SelfAttention
from tinyformer.components.ffn import MLP, GeGLU, SwiGLU
from tinyformer.components.kv_cache import WHOLE_SEQUENCE, Step
from tinyformer.components.moe import MoE
from tinyformer.components.norm import build_norm
from tinyformer.config import ModelConfig


def build_ffn(cfg: ModelConfig) -> nn.Module:
    """The feed-forward sublayer ``cfg.ffn`` names: routed experts (components/moe.py, SwiGLU experts), SwiGLU,
    GeGLU-tanh, or the two-matrix GELU/ReLU MLP (components/ffn.py)."""
    if cfg.ffn == "moe":
        return MoE(cfg)
    if cfg.ffn == "swiglu":
        return SwiGLU(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias)
    if cfg.ffn == "geglu_tanh":
        return GeGLU(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias)
    return MLP(cfg.d_model, cfg.d_ff, cfg.ffn, bias=cfg.mlp_bias)


class Block(nn.Module):
    """A Pre-Norm (or sandwich) block, x (B, T, d) -> (B, T, d); ``step`` is the call's positions, masks and
    cache (components/kv_cache.py). ``Block(cfg)`` with ``norm_placement="post"`` builds a ``PostNormBlock``:
    the placement is chosen once, at construction. ``layer`` is the block's index in its stack."""

    def __new__(cls, cfg: ModelConfig | None = None, *args: object, **kwargs: object) -> Block:
        post = cls is Block and cfg is not None and cfg.norm_placement == "post"
        return super().__new__(PostNormBlock if post else cls)

    def __init__(self, cfg: ModelConfig, causal: bool = True, layer: int = 0) -> None:
        super().__init__()
        self.attn_norm = build_norm(cfg)
        # sandwich: a norm on each sub-block's output too, before it joins the residual stream
        self.attn_post_norm = build_norm(cfg) if cfg.norm_placement == "sandwich" else nn.Identity()
        self.ffn_post_norm = build_norm(cfg) if cfg.norm_placement == "sandwich" else nn.Identity()
        self.attn = SelfAttention(cfg, causal, layer)
        self.ffn_norm = build_norm(cfg)
        self.ffn = build_ffn(cfg)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, step: Step = WHOLE_SEQUENCE) -> torch.Tensor:
        """h = x + Attn(Norm(x)),  y = h + FFN(Norm(h))   (sandwich: each branch's output normed too)."""
        x = x + self.drop(self.attn_post_norm(self.attn(self.attn_norm(x), step)))
        return x + self.drop(self.ffn_post_norm(self.ffn(self.ffn_norm(x))))


class PostNormBlock(Block):
    """Post-Norm: h = Norm(x + Attn(x)),  y = Norm(h + FFN(h))."""

    def forward(self, x: torch.Tensor, step: Step = WHOLE_SEQUENCE) -> torch.Tensor:
        x = self.attn_norm(x + self.drop(self.attn(x, step)))
        return self.ffn_norm(x + self.drop(self.ffn(x)))
