"""Parameter counts of the parts of a stack, by formula, and ``ParamCount``, the breakdown they add up to.

Per decoder layer (d = d_model, H / H_kv = query / key-value heads, d_h = head_dim, f = d_ff):
  attention: d (H d_h + 2 H_kv d_h)  [W_q, W_k, W_v]  +  H d_h d  [W_o]  (+ biases, + 2 d_h with qk_norm)
  FFN:       SwiGLU / GeGLU 3 d f;  GELU/ReLU MLP 2 d f  (+ biases)
             MoE: d E [router] + E 3 d f [experts] + 3 d f_s [shared expert]; active per token:
             d E + k 3 d f + 3 d f_s (k = experts_per_token)
  norms:     2 d (RMSNorm), 4 d (LayerNorm with bias); twice that with sandwich norms

``sizing/__init__.py`` (decoders) and ``sizing/classic.py`` (encoder, encoder-decoder) assemble them per stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tinyformer.config import ModelConfig


def norm_params(cfg: ModelConfig, dim: int | None = None) -> int:
    """Parameters of one norm over ``dim`` (default d_model): the gain, plus the bias of a LayerNorm."""
    d = cfg.d_model if dim is None else dim
    return d * (2 if cfg.norm == "layernorm" and cfg.norm_bias else 1)


def attention_params(cfg: ModelConfig) -> int:
    d, q, kv = cfg.d_model, cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    n = d * (q + 2 * kv) + q * d
    if cfg.attn_bias:
        n += q + 2 * kv
    if cfg.attn_out_bias:
        n += d
    if cfg.qk_norm:  # one gain vector each for q and k, shared by the heads
        n += 2 * norm_params(cfg, cfg.head_dim)
    return n


def ffn_params(cfg: ModelConfig, active: bool = False) -> int:
    """FFN parameters of one layer; ``active``: only those one token uses (MoE: the router, k experts and the
    shared expert)."""
    d, f = cfg.d_model, cfg.d_ff
    if cfg.ffn == "moe":
        experts = cfg.experts_per_token if active else cfg.n_experts
        return d * cfg.n_experts + experts * 3 * d * f + 3 * d * cfg.shared_expert_d_ff
    if cfg.ffn in ("swiglu", "geglu_tanh"):
        return 3 * d * f + ((2 * f + d) if cfg.mlp_bias else 0)
    return 2 * d * f + ((f + d) if cfg.mlp_bias else 0)


@dataclass
class ParamCount:
    embedding: int  # token (+ token-type) table
    positions: int  # learned position table (0 for RoPE / sinusoidal / none)
    attention_per_layer: int
    ffn_per_layer: int
    norms_per_layer: int
    n_layer: int
    final_norm: int
    head: int  # 0 when tied to the embedding
    extra: dict[str, int] = field(default_factory=dict)  # arch-specific parts (pooler, cross-attn, ...)
    ffn_active_per_layer: int | None = None  # MoE: the FFN parameters one token uses (None: all of them)

    @property
    def per_layer(self) -> int:
        return self.attention_per_layer + self.ffn_per_layer + self.norms_per_layer

    @property
    def total(self) -> int:
        return (self.embedding + self.positions + self.per_layer * self.n_layer + self.final_norm + self.head
                + sum(self.extra.values()))

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding - self.positions

    @property
    def inactive(self) -> int:
        """Parameters a token does not use (MoE experts it is not routed to)."""
        if self.ffn_active_per_layer is None:
            return 0
        return (self.ffn_per_layer - self.ffn_active_per_layer) * self.n_layer

    @property
    def active(self) -> int:
        return self.total - self.inactive
