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
so query i sees keys j with i - W < j <= i. The mask comes from the model (models/decoder.py); a layer whose
KV cache is a rolling buffer of W slots (components/kv_cache.py) writes position p into slot p mod W.

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

from tinyformer.components.norm import RMSNorm, build_norm
from tinyformer.components.rope import apply_rope
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


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
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


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    impl: str = "sdpa",
    dropout_p: float = 0.0,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """softmax(s q k^T + M) v (s = ``scale`` or 1/sqrt(d)) by the chosen implementation; see
    ``reference_attention``. Soft-capped scores always take the explicit formula."""
    if impl == "reference" or softcap is not None:
        return reference_attention(q, k, v, mask, is_causal, dropout_p, scale, softcap)
    if (q.shape[-2] == 1 and dropout_p == 0.0 and torch.compiler.is_compiling()
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4
                                  and mask.shape[1] == mask.shape[2] == 1))):
        # eager, SDPA's one fused call is cheaper; compiled, the written-out formula fuses into the
        # step's own kernels (a few percent faster per decoded token)
        return single_query_attention(q, k, v, mask, scale)
    gqa = k.shape[1] != q.shape[1]
    if is_causal and mask is None and q.shape[-2] != k.shape[-2]:
        # SDPA's is_causal aligns the mask to the top-left corner; a query block that continues a
        # cached prefix needs it aligned bottom-right, so build it explicitly.
        T, S = q.shape[-2], k.shape[-2]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        is_causal = False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal and mask is None, enable_gqa=gqa,
        scale=scale,
    )


class SelfAttention(nn.Module):
    """Self-attention with fused q/k/v projection and optional KV cache.

    ``qkv`` is one (H d_head + 2 H_kv d_head, d) matrix: rows for W_q, then W_k, then W_v; one
    matmul computes all three. ``out`` is W_o of shape (d, H d_head).
    """

    def __init__(self, cfg: ModelConfig, causal: bool = True) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.causal = causal
        self.impl = cfg.attn_impl
        self.dropout_p = cfg.attn_dropout
        self.scale, self.softcap = cfg.attn_scale, cfg.attn_logit_softcap
        self.q_size = cfg.n_head * cfg.head_dim
        self.kv_size = cfg.n_kv_head * cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, self.q_size + 2 * self.kv_size, bias=cfg.attn_bias)
        self.out = nn.Linear(self.q_size, cfg.d_model, bias=cfg.attn_out_bias)
        self.q_norm = build_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = build_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        # both norms come from one config: RMSNorms sharing eps and offset can run as one call (_norm_qk)
        self._one_qk_norm = isinstance(self.q_norm, RMSNorm) and isinstance(self.k_norm, RMSNorm) \
            and self.q_norm.eps == self.k_norm.eps and self.q_norm.offset == self.k_norm.offset

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
        cache: tuple[torch.Tensor, torch.Tensor] | None = None,
        start: int | torch.Tensor = 0,
        kv_len: int = 0,
        rolling: bool = False,
    ) -> torch.Tensor:
        """x (B, T, d); rope = (cos, sin) for these T positions; mask (B|1, 1, T, S) bool or None;
        cache = this layer's preallocated (k, v) buffers (B, H_kv, L, d_head), filled up to ``start``.
        ``start`` may be a (B,) tensor of per-row positions (then T must be 1, the first ``kv_len``
        cache positions are attended and ``mask`` says which of them each row may see).
        ``rolling``: the cache is a ring of W slots (position p in slot p mod W); then the keys are the W
        slots (after writing, when T = 1) or the W slots followed by the T new keys (before writing), and
        ``mask`` is over those keys."""
        B, T, _ = x.shape
        H, H_kv = self.n_head, self.n_kv_head
        # the qkv rows are H query heads, then H_kv key heads, then H_kv value heads
        qkv = self.qkv(x).view(B, T, H + 2 * H_kv, self.head_dim).transpose(1, 2)  # (B, H + 2 H_kv, T, d_head)
        qk, v = qkv[:, : H + H_kv], qkv[:, H + H_kv :]
        if self.q_norm is not None and self.k_norm is not None:
            qk = self._norm_qk(qk)
        if rope is not None:  # queries and keys are rotated alike: one call for both
            qk = apply_rope(qk, *rope)
        q, k = qk.split((H, H_kv), dim=1)  # (B, H, T, d_head), (B, H_kv, T, d_head)
        if cache is not None and rolling:
            k, v = self._write_ring(cache, k, v, start)
        elif cache is not None and isinstance(start, torch.Tensor):
            # per-row positions (continuous batching): row b writes its one new token at start[b]
            k_cache, v_cache = cache
            rows = torch.arange(B, device=x.device)
            k_cache[rows, :, start] = k[:, :, 0]
            v_cache[rows, :, start] = v[:, :, 0]
            k, v = k_cache[:, :, :kv_len], v_cache[:, :, :kv_len]
        elif cache is not None:
            k_cache, v_cache = cache
            k_cache[:, :, start : start + T] = k
            v_cache[:, :, start : start + T] = v
            k, v = k_cache[:, :, : start + T], v_cache[:, :, : start + T]
        # a single new token attends to everything cached: no mask needed at all
        is_causal = self.causal and mask is None and T > 1
        y = attend(q, k, v, mask, is_causal, self.impl, self.dropout_p if self.training else 0.0, self.scale,
                   self.softcap)
        y = y.transpose(1, 2).reshape(B, T, self.q_size)  # merge heads: (B, T, H d_head)
        return self.out(y)

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

    @staticmethod
    def _write_ring(cache: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                    start: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values into a ring of W slots (position p -> slot p mod W); return the keys and
        values to attend over. One new token overwrites position p - W, which it may not see anyway, so it
        is written first and the W slots are attended; a block of T > 1 tokens attends the W old slots plus
        its own keys (a query in the block may still see positions the block's later tokens overwrite)."""
        k_cache, v_cache = cache
        W = k_cache.shape[2]
        T = k.shape[2]
        if isinstance(start, torch.Tensor):  # one token per row, each at its own position
            rows = torch.arange(k.shape[0], device=k.device)
            slot = start % W
            k_cache[rows, :, slot] = k[:, :, 0]
            v_cache[rows, :, slot] = v[:, :, 0]
            return k_cache, v_cache
        if T == 1:
            k_cache[:, :, start % W] = k[:, :, 0]
            v_cache[:, :, start % W] = v[:, :, 0]
            return k_cache, v_cache
        keys, values = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
        n = min(T, W)  # only the last W positions of the block outlive it
        slots = torch.arange(start + T - n, start + T, device=k.device) % W
        k_cache.index_copy_(2, slots, k[:, :, T - n :])
        v_cache.index_copy_(2, slots, v[:, :, T - n :])
        return keys, values
