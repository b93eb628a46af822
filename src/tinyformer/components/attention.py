"""Multi-head attention with grouped key/value heads (MHA, GQA, MQA).

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_head) + M) V

Q has ``n_head`` heads; K and V have ``n_kv_head`` heads, each shared by a group of
n_head / n_kv_head query heads (Ainslie et al. 2023): MHA when n_kv_head = n_head, GQA when it
divides it, MQA when it is 1. M is 0 where a query may look and -inf where it may not (the causal
mask j > i, and padding). The 1/sqrt(d_head) keeps the score variance near 1 when q and k have
unit-variance entries, so the softmax does not saturate as d_head grows.

Options: ``attn_scale`` replaces 1/sqrt(d_head) by s (Gemma: query_pre_attn_scalar^-1/2);
``attn_logit_softcap`` c bounds the scores, s q.k -> c tanh(s q.k / c), before the mask (Gemma 2); the
fused kernels have no soft-capping, so a capped model always takes the explicit formula.

Two computations of the same formula, selected by ``ModelConfig.attn_impl``:
  * ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (fused flash / memory-efficient
    kernels; never materialises the T x T matrix when it can avoid it);
  * ``reference``: the explicit formula below, with the max-subtracted ("safe") softmax, for
    teaching and for testing the fused path.

Under ``torch.compile`` a single query per row (the compiled decode step) is computed by
``single_query_attention``, the formula written out, which the compiler fuses into its own kernels.

Shapes: x (B, T, d) -> q (B, H, T, d_head), k/v (B, H_kv, S, d_head) -> out (B, T, d),
where S = T plus whatever the KV cache already holds.

Sliding window (``ModelConfig.sliding_window``, Beltagy et al. 2020; Mistral): M also masks keys j <= i - W,
so query i sees keys j with i - W < j <= i. The mask, the keys and the values come from the call's ``Step``
(components/kv_cache.py), which also keeps the ring buffer of a sliding-window layer's cache (position p in
slot p mod R).

QK-norm (``ModelConfig.qk_norm``, Qwen3, Gemma 3): q and k are normalised per head over d_head (RMSNorm
with learned gains of shape (d_head,)) before RoPE, which bounds the logits q.k / sqrt(d_head):
q_h <- RMSNorm_q(q_h), k_h <- RMSNorm_k(k_h). The H query and H_kv key heads are normalised in one call,
x / rms(x) times a (H + H_kv, 1, d_head) gain that repeats g_q over the query heads and g_k over the key heads:
one normalisation instead of two and a concatenation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tinyformer.components.kv_cache import WHOLE_SEQUENCE, Step
from tinyformer.components.norm import RMSNorm, build_norm
from tinyformer.components.rope import keep_qk, rotate_qk
from tinyformer.config import ModelConfig


def safe_softmax(scores: torch.Tensor) -> torch.Tensor:
    """softmax(s)_j = exp(s_j - max_k s_k) / sum_k exp(s_k - max_k s_k), over the last dim.

    Subtracting the row maximum keeps exp() from overflowing (exp(89) is inf in float32 and
    exp(12) already is in float16). A row with every entry masked (-inf) yields zeros instead of NaN.
    Computed in float32 at least, then cast back.
    """
    s = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
    row_max = s.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(s - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    return (e / torch.where(denom > 0, denom, torch.ones_like(denom))).to(scores.dtype)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                        is_causal: bool = False, dropout_p: float = 0.0, scale: float | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    """The explicit formula. q (B, H, T, d); k, v (B, H_kv, S, d); mask broadcastable to (B, H, T, S),
    True = may attend. With ``is_causal`` query i (the last T of S positions) sees keys j <= S - T + i.
    ``softcap`` c: scores -> c tanh(scores / c) before masking."""
    n_head, n_kv = q.shape[1], k.shape[1]
    if n_kv != n_head:  # each K/V head serves n_head / n_kv consecutive query heads
        k = k.repeat_interleave(n_head // n_kv, dim=1)
        v = v.repeat_interleave(n_head // n_kv, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    T, S = scores.shape[-2], scores.shape[-1]
    if is_causal:
        causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        scores = scores.masked_fill(~causal, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = safe_softmax(scores)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return probs @ v


def single_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """softmax(q K^T / sqrt(d) + M) V for one query per row: q (B, H, 1, d); k, v (B, H_kv, S, d);
    mask broadcastable to (B, 1, 1, S), True = may attend -> (B, H, 1, d).

    The g = H / H_kv query heads that share a K/V head meet its keys and values together, so grouped K/V
    heads are read once, never repeated. One query sees every key it is not masked from (with one query,
    the bottom-right causal mask masks nothing). Written as broadcast products summed over d, then over S,
    rather than as two matrix products: this is the compiled decode step's attention, and inductor's C++
    backend vectorises those two reductions (the matrix-product form compiled to a kernel that made a
    16-row step of the stories15m shape 9.95 ms instead of 8.65 ms).
    """
    B, H, _, d = q.shape
    n_kv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = q.reshape(B, n_kv, H // n_kv, 1, d)
    scores = (qg * k.unsqueeze(2)).sum(-1) * scale  # (B, H_kv, g, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1)  # (B, H_kv, g, S)
    return (p.unsqueeze(-1) * v.unsqueeze(2)).sum(-2).reshape(B, H, 1, d)  # sum_j p_j v_j


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
                   dropout_p: float = 0.0, scale: float | None = None, softcap: None = None) -> torch.Tensor:
    """softmax(s q k^T + M) v by ``torch.nn.functional.scaled_dot_product_attention`` (``is_causal``: the
    top-left causal mask, for queries and keys that both start at position 0). Under ``torch.compile`` one
    query per row takes ``single_query_attention``: eager, SDPA's one fused call is cheaper; compiled, the
    written-out formula fuses into the step's own kernels (a few percent faster per decoded token)."""
    if (q.shape[-2] == 1 and dropout_p == 0.0 and torch.compiler.is_compiling()
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4
                                  and mask.shape[1] == mask.shape[2] == 1))):
        return single_query_attention(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                          enable_gqa=k.shape[1] != q.shape[1], scale=scale)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
           impl: str = "sdpa", dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + M) v by the chosen implementation; see ``reference_attention``. With
    ``is_causal`` and fewer queries than keys the causal mask is aligned bottom-right (the queries continue a
    prefix)."""
    if impl == "reference":
        return reference_attention(q, k, v, mask, is_causal, dropout_p)
    if is_causal and mask is None and q.shape[-2] != k.shape[-2]:
        # SDPA's is_causal aligns the mask to the top-left corner; a query block that continues a
        # cached prefix needs it aligned bottom-right, so build it explicitly.
        T, S = q.shape[-2], k.shape[-2]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        is_causal = False
    return sdpa_attention(q, k, v, mask, is_causal and mask is None, dropout_p)


class SelfAttention(nn.Module):
    """Self-attention with fused q/k/v projection; the call's ``Step`` (components/kv_cache.py) gives the
    rotary tables, and the keys, values and mask to attend (from the KV cache, or the call's own).

    ``qkv`` is one (H d_head + 2 H_kv d_head, d) matrix: rows for W_q, then W_k, then W_v; one
    matmul computes all three. ``out`` is W_o of shape (d, H d_head). ``layer`` is the index the step
    knows this layer by. The variant is chosen at construction: RoPE or none (``rotate``), the fused
    kernel or the explicit formula (``kernel``; soft-capped scores need the formula), and with QK-norm
    the subclass ``QKNormSelfAttention``, which ``SelfAttention(cfg)`` builds when ``cfg.qk_norm``.
    """

    def __new__(cls, cfg: ModelConfig | None = None, *args: object, **kwargs: object) -> SelfAttention:
        qk_norm = cls is SelfAttention and cfg is not None and cfg.qk_norm
        return super().__new__(QKNormSelfAttention if qk_norm else cls)

    def __init__(self, cfg: ModelConfig, causal: bool = True, layer: int = 0) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.causal, self.layer = causal, layer
        self.dropout_p = cfg.attn_dropout
        self.scale, self.softcap = cfg.attn_scale, cfg.attn_logit_softcap
        self.q_size = cfg.n_head * cfg.head_dim
        self.kv_size = cfg.n_kv_head * cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, self.q_size + 2 * self.kv_size, bias=cfg.attn_bias)
        self.out = nn.Linear(self.q_size, cfg.d_model, bias=cfg.attn_out_bias)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        self.rotate = rotate_qk if cfg.pos == "rope" else keep_qk
        self.kernel = reference_attention if cfg.attn_impl == "reference" or self.softcap is not None \
            else sdpa_attention

    def forward(self, x: torch.Tensor, step: Step = WHOLE_SEQUENCE) -> torch.Tensor:
        """x (B, T, d) -> (B, T, d): q, k (rotated) and v of the T new tokens; k and v go to ``step.kv``,
        which returns the keys (B, H_kv, S, d_head), values and mask (B|1, 1, T, S) to attend."""
        B, T, _ = x.shape
        H, H_kv = self.n_head, self.n_kv_head
        # the qkv rows are H query heads, then H_kv key heads, then H_kv value heads
        qkv = self.qkv(x).view(B, T, H + 2 * H_kv, self.head_dim).transpose(1, 2)  # (B, H + 2 H_kv, T, d_head)
        qk, v = qkv[:, : H + H_kv], qkv[:, H + H_kv :]
        qk = self.rotate(self._norm_qk(qk), step.rope[self.layer])  # queries and keys alike, in one call
        q, k = qk.split((H, H_kv), dim=1)  # (B, H, T, d_head), (B, H_kv, T, d_head)
        k, v, mask = step.kv(self.layer, k, v)
        # no mask: causal from position 0 (a block without a prefix), or one new token that sees every key
        y = step.attend(self.layer, self.kernel, q, k, v, mask, self.causal and mask is None and T > 1,
                        self.dropout_p * self.training, self.scale, self.softcap)
        return self.out(y.transpose(1, 2).reshape(B, T, self.q_size))  # merge heads: (B, T, H d_head)

    def _norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """No QK-norm: qk unchanged."""
        return qk


class QKNormSelfAttention(SelfAttention):
    """Self-attention with QK-norm: q_h <- RMSNorm_q(q_h), k_h <- RMSNorm_k(k_h) before RoPE (see the module
    docstring)."""

    def __init__(self, cfg: ModelConfig, causal: bool = True, layer: int = 0) -> None:
        super().__init__(cfg, causal, layer)
        self.q_norm = build_norm(cfg, cfg.head_dim)
        self.k_norm = build_norm(cfg, cfg.head_dim)
        # both norms come from one config: RMSNorms sharing eps and offset can run as one call (_norm_qk)
        self._one_qk_norm = isinstance(self.q_norm, RMSNorm) and isinstance(self.k_norm, RMSNorm) \
            and self.q_norm.eps == self.k_norm.eps and self.q_norm.offset == self.k_norm.offset

    def _norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """Per-head norms of qk (B, H + H_kv, T, d_head): RMSNorm_q over the first H heads, RMSNorm_k over the
        rest, as one x / rms(x) and one multiply by the stacked gains (float32/64 RMSNorms sharing eps and offset;
        other norms and dtypes take the two norms)."""
        q_norm, k_norm = self.q_norm, self.k_norm
        H, H_kv, d = self.n_head, self.n_kv_head, self.head_dim
        if not (self._one_qk_norm and qk.dtype in (torch.float32, torch.float64)):
            q, k = qk.split((H, H_kv), dim=1)
            return torch.cat([q_norm(q), k_norm(k)], dim=1)  # type: ignore[misc]
        gain = torch.cat([q_norm.weight.expand(H, d), k_norm.weight.expand(H_kv, d)]).unsqueeze(1)
        if q_norm.offset:
            gain = gain + q_norm.offset
        return F.rms_norm(qk, (d,), None, q_norm.eps) * gain
