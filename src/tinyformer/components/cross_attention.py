"""Cross-attention (encoder-decoder attention, Vaswani et al. 2017, section 3.2.3).

    CrossAttn(x, m) = softmax((x W_q)(m W_k)^T / sqrt(d_head) + M_src) (m W_v) W_o

The queries come from the decoder stream x (B, T, d); the keys and values from the encoder output,
the "memory" m (B, S, d). M_src is 0 on real source tokens and -inf on source padding, so every
target position sees every non-padding source position (no causal mask: the whole source is known).

K and V depend on the source only, so during decoding they are projected once per source
(``project_memory``) and reused at every step; only q is computed per new target token.

Shapes: q (B, H, T, d_head); k, v (B, H_kv, S, d_head); out (B, T, d). ``kv`` is one fused
(2 H_kv d_head, d) matrix: rows for W_k, then W_v.
"""

from __future__ import annotations

import torch
from torch import nn

from tinyformer.components.attention import attend
from tinyformer.config import ModelConfig


def source_padding_mask(src_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(B, S) with 1 = token, 0 = padding  ->  bool (B, 1, 1, S), True = may attend (broadcast over
    heads and queries). A row that is all padding is let see everything, which keeps its softmax
    finite in every kernel; its output is never used."""
    if src_mask is None:
        return None
    keep = src_mask.bool()
    keep = keep | ~keep.any(dim=-1, keepdim=True)
    return keep[:, None, None, :]


class CrossAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.impl = cfg.attn_impl
        self.dropout_p = cfg.attn_dropout
        self.q_size = cfg.n_head * cfg.head_dim
        self.kv_size = cfg.n_kv_head * cfg.head_dim
        self.q = nn.Linear(cfg.d_model, self.q_size, bias=cfg.attn_bias)
        self.kv = nn.Linear(cfg.d_model, 2 * self.kv_size, bias=cfg.attn_bias)
        self.out = nn.Linear(self.q_size, cfg.d_model, bias=cfg.attn_out_bias)

    def project_memory(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder output (B, S, d) -> (k, v), each (B, H_kv, S, d_head). Computed once per source."""
        B, S, _ = memory.shape
        k, v = self.kv(memory).split(self.kv_size, dim=-1)
        k = k.view(B, S, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, S, self.n_kv_head, self.head_dim).transpose(1, 2)
        return k, v

    def forward(self, x: torch.Tensor, memory_kv: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, d); memory_kv from ``project_memory``; mask (B, 1, 1, S) bool from
        ``source_padding_mask`` or None. Returns (B, T, d)."""
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, d_head)
        k, v = memory_kv
        y = attend(q, k, v, mask, False, self.impl, self.dropout_p if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(B, T, self.q_size))
