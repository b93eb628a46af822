"""Rotary position embedding (RoPE, Su et al. 2021) with long-context scaling.

Each pair of dimensions (x_a, x_b) of a query or key at position m is rotated by the angle m * theta_i:

    x_a' = x_a cos(m theta_i) - x_b sin(m theta_i)
    x_b' = x_b cos(m theta_i) + x_a sin(m theta_i),      theta_i = base^(-2i/d),  i = 0 .. d/2 - 1

so that <RoPE(q, m), RoPE(k, n)> depends on m and n only through m - n.

Pairing convention: **half split** (the Hugging Face layout). Dimension i is paired with dimension
i + d/2, not with its neighbour 2i+1 as in Meta's reference (interleaved pairs). Both are the same
rotation up to a permutation of the q/k projection rows; the half split needs no strided gather
(two contiguous slices and a concatenation), which is faster, and it matches the layout of most
checkpoints on the Hugging Face hub. Checkpoints in the interleaved layout (Meta, GGUF) are
converted at the import boundary by permuting the rows of W_q and W_k (``interop``).

Scaling schemes (definitions identical to Hugging Face's ``rope_parameters``):
  linear  (position interpolation, Chen et al. 2023): theta_i / factor
  dynamic (dynamic NTK): base' = base * (factor * L / L0 - (factor - 1))^(d / (d - 2)) once L > L0
  yarn    (Peng et al. 2023): per-frequency blend of interpolation and extrapolation, with an
          attention factor 0.1 ln(factor) + 1 applied to cos and sin
  llama3  (Meta, Llama 3.1): low frequencies divided by factor, high ones kept, a smooth ramp between.
  longrope (Ding et al. 2024; Phi-3's "su"): theta_i / s_i with per-frequency divisors s = short_factor while
          the sequence (max position + 1) fits the original context L0, long_factor beyond it; cos and sin
          scaled by sqrt(1 + ln(f) / ln(L0)), f = factor or max_seq_len / L0 (unless attention_factor is given)
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tinyformer.config import ModelConfig


def default_inv_freq(dim: int, base: float) -> torch.Tensor:
    """theta_i = base^(-2i/dim) for i = 0 .. dim/2 - 1, shape (dim/2,), float32."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(cfg: ModelConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (d/2,) and the attention factor that scales cos and sin.

    ``seq_len`` matters only for dynamic NTK, whose base grows with the current length, and LongRoPE, whose
    factors switch beyond the original context.
    """
    dim, base = cfg.head_dim, float(cfg.rope_theta)
    rs = cfg.rope_scaling or {}
    kind = cfg.rope_type
    if kind == "default":
        return default_inv_freq(dim, base), 1.0
    if kind == "longrope":
        return _longrope_inv_freq(dim, base, rs, cfg.max_seq_len, seq_len)
    factor = float(rs["factor"])
    if kind == "linear":
        return default_inv_freq(dim, base) / factor, 1.0
    if kind == "dynamic":
        l0 = int(rs.get("original_max_position_embeddings") or cfg.max_seq_len)
        length = l0 if seq_len is None else max(seq_len, l0)
        base = base * ((factor * length / l0) - (factor - 1)) ** (dim / (dim - 2))
        return default_inv_freq(dim, base), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(dim, base, rs), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(dim, base, rs, cfg.max_seq_len)
    raise ValueError(f"unknown rope type {kind!r}")  # unreachable: the config validates it


def _longrope_inv_freq(dim: int, base: float, rs: dict, max_seq_len: int,
                       seq_len: int | None) -> tuple[torch.Tensor, float]:
    """LongRoPE: theta_i / s_i, s = long_factor once seq_len > L0, else short_factor; attention factor
    sqrt(1 + ln(f) / ln(L0)) for f > 1 (f = factor, or max_seq_len / L0)."""
    l0 = int(rs["original_max_position_embeddings"])
    factor = float(rs.get("factor") or max_seq_len / l0)
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(l0))
    divisors = torch.tensor(rs["long_factor"] if seq_len and seq_len > l0 else rs["short_factor"],
                            dtype=torch.float32)
    return default_inv_freq(dim, base) / divisors, float(attention_factor)


def _llama3_inv_freq(dim: int, base: float, rs: dict) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than L0/low_freq_factor are interpolated by `factor`, shorter
    than L0/high_freq_factor kept, and those between blended linearly in L0/wavelength."""
    inv_freq = default_inv_freq(dim, base)
    factor, low, high = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    l0 = float(rs["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > l0 / low, inv_freq / factor, inv_freq)
    smooth = (l0 / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= l0 / high) & (wavelen <= l0 / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, base: float, rs: dict, max_seq_len: int) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that rotate fewer than beta_slow times over L0 are interpolated (theta/factor),
    those rotating more than beta_fast times are kept, with a linear ramp between; cos and sin are
    scaled by the attention factor 0.1 * mscale * ln(factor) + 1."""
    factor = float(rs["factor"])
    l0 = int(rs.get("original_max_position_embeddings") or max_seq_len)

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = mscale_of(factor, mscale) / mscale_of(factor, mscale_all_dim)
        else:
            attention_factor = mscale_of(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1

    def correction_dim(n_rot: float) -> float:
        # the dimension index whose wavelength fits n_rot times into L0
        return (dim * math.log(l0 / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables for positions 0 .. max_seq_len - 1, shape (max_seq_len, head_dim).

    ``tables(positions)`` gives (cos, sin) for positions (B|1, T), each (B|1, 1, T, head_dim), ready to
    broadcast over the heads; ``forward(start, length)`` the rows of positions start .. start + length - 1,
    each (length, head_dim). The tables repeat
    each frequency twice, [theta_0 .. theta_{d/2-1}, theta_0 .. theta_{d/2-1}], which is the half-split layout.

    The RoPE variants whose tables depend on the sequence length (dynamic NTK, LongRoPE) are subclasses that
    ``RotaryEmbedding(cfg)`` picks from ``cfg.rope_type``: the choice is made once, at construction.
    """

    def __new__(cls, cfg: ModelConfig | None = None, *args: object, **kwargs: object) -> RotaryEmbedding:
        if cls is RotaryEmbedding and cfg is not None:
            cls = {"dynamic": DynamicNTKRotaryEmbedding, "longrope": LongRotaryEmbedding}.get(cfg.rope_type, cls)
        return super().__new__(cls)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        inv_freq, self.attention_factor = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        cos, sin = self._tables(inv_freq, cfg.max_seq_len, self.attention_factor)
        self.register_buffer("cos_cached", cos, persistent=False)
        self.register_buffer("sin_cached", sin, persistent=False)

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recompute the tables on ``device``: a model built on the meta device has buffers without values,
        and these are not in the checkpoint (``persistent=False``), so loading weights does not fill them."""
        inv_freq, self.attention_factor = rope_inv_freq(self.cfg)
        self.inv_freq = inv_freq.to(device)
        self.cos_cached, self.sin_cached = self._tables(self.inv_freq, self.cfg.max_seq_len, self.attention_factor)
        self.__dict__.pop("_long", None)  # LongRoPE's long tables: rebuilt on the new device on first use

    @staticmethod
    def _tables(inv_freq: torch.Tensor, length: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(length, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(t, inv_freq.float())  # (T, d/2): angle m * theta_i
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, d): half-split layout
        return emb.cos() * scale, emb.sin() * scale

    def for_length(self, seen: int | None, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) tables (L, d) for a sequence of ``seen`` positions (max position + 1; None: read it
        from ``positions``). Plain RoPE and the fixed scalings have one table for every length."""
        return self.cos_cached, self.sin_cached

    def tables(self, positions: torch.Tensor, seen: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for ``positions`` (B|1, T): each (B|1, 1, T, head_dim)."""
        cos, sin = self.for_length(seen, positions)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def forward(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions start .. start+length-1: a slice of the tables, no gather."""
        cos, sin = self.for_length(start + length, None)
        return cos[start : start + length], sin[start : start + length]


def _seen(seen: int | None, positions: torch.Tensor | None) -> int:
    """The sequence length: ``seen``, else max(positions) + 1 (a read-back from the device)."""
    return seen if seen is not None else int(positions.max()) + 1  # type: ignore[union-attr]


class DynamicNTKRotaryEmbedding(RotaryEmbedding):
    """Dynamic NTK: beyond the original context the base grows with the sequence seen so far (max position
    + 1), and the tables are recomputed for that length, as Hugging Face does."""

    def for_length(self, seen: int | None, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        seen = _seen(seen, positions)
        l0 = int((self.cfg.rope_scaling or {}).get("original_max_position_embeddings") or self.cfg.max_seq_len)
        if seen <= l0:
            return self.cos_cached, self.sin_cached
        inv_freq, _ = rope_inv_freq(self.cfg, seq_len=seen)
        return self._tables(inv_freq.to(self.cos_cached.device), seen, 1.0)


class LongRotaryEmbedding(RotaryEmbedding):
    """LongRoPE: the long factors, for every position of the call, once the sequence (max position + 1)
    outgrows the original context (as transformers switches)."""

    def for_length(self, seen: int | None, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        l0 = int((self.cfg.rope_scaling or {})["original_max_position_embeddings"])
        if _seen(seen, positions) <= l0:
            return self.cos_cached, self.sin_cached
        if not hasattr(self, "_long"):  # the tables with the long factors, built on first use
            inv_freq, scale = rope_inv_freq(self.cfg, seq_len=l0 + 1)
            self._long = self._tables(inv_freq.to(self.cos_cached.device), self.cfg.max_seq_len, scale)
        return self._long


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x_1, x_2) -> (-x_2, x_1) on the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin. x: (B, H, T, d); cos/sin broadcastable to it: (T, d) from ``forward`` or
    (B|1, 1, T, d) from ``RotaryEmbedding.tables``."""
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def rotate_qk(qk: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE on the stacked query and key heads qk (B, H + H_kv, T, d): both are rotated alike, in one call."""
    return apply_rope(qk, *tables)


def keep_qk(qk: torch.Tensor, tables: object) -> torch.Tensor:
    """No rotation: positions enter as added embeddings (learned, sinusoidal) instead."""
    return qk
