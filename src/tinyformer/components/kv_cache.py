"""The KV cache, and what one forward call tells attention: positions, masks, and the keys and values to attend.

During decoding, position t needs the keys and values of positions 0..t of every layer. They are computed
once and kept here, so each new token costs one row of projections instead of a whole forward pass over the
prefix. Buffers are allocated once for ``max_len`` positions (no reallocation or concatenation per step): per
layer k and v of shape (B, H_kv, max_len, d_head). Memory: 2 * n_layer * B * max_len * H_kv * d_head * bytes;
GQA shrinks it by n_head / n_kv_head.

One call of the model asks its cache (or :class:`NoCache`) to ``begin`` it: the answer is a :class:`Step`
that holds the positions of the T new tokens (B|1, T) and, per layer, the boolean mask M (True = may attend)
of softmax(q k^T / sqrt(d) + M) v. Each attention layer hands the step its new keys and values and gets back
what to attend: ``keys, values, mask = step.kv(layer, k, v)`` (without a cache: its own k and v).

    block call   ``cache.begin(ids)``: every row at ``cache.length``; the T tokens go to positions
                 length .. length + T - 1 (``attention_mask`` marks left padding: 1 = token, 0 = padding)
    row call     ``cache.at(positions).begin(ids)``: row b's T tokens at positions[b] .. positions[b] + T - 1,
                 each row at its own length (continuous batching); the caller keeps the lengths
    shared       ``SharedPrefix``: no cache; the distinct prefixes run once (its first call), then rows
                 that continue them attend their prefix's keys and values (GRPO's G completions of a prompt)

Rolling buffers (sliding-window layers): a layer whose queries see only the last W keys
(``ModelConfig.layer_window``) needs only R = W + ``spare_slots`` slots when ``max_len`` > R; position p is kept
in slot p mod R, overwriting position p - R, which no later query can see. Such a layer costs O(W) memory
whatever the length; ``rolling[l]`` marks it, and each slot is masked by the position it holds.
``rolling=False`` keeps full buffers for every layer (the window is then a mask only).

Rollback (speculative decoding): ``truncate(lengths)`` forgets the positions at and after ``lengths[b]`` of each
row b. A full-length layer zeroes them, so the cache is bitwise the one that never saw them. A ring cannot
un-overwrite: rolling back n tokens from length P needs the positions P - n - W + 1 .. P - n - 1 that the next
query sees, and the n rolled-back tokens overwrote positions P - n - R .. P - 1 - R, so n <= R - W + 1 =
``spare_slots`` + 1; beyond that ``truncate`` raises. A ring's rolled-back slots keep the removed keys (a cache
that never saw them holds positions that are R older there): no later query can see either, so every later
output is bitwise the same, but those slots' bytes differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tinyformer.components import quant_kernels
from tinyformer.config import ModelConfig
from tinyformer.errors import GenerationError

# softmax(q k^T + M) v: (q, k, v, mask, is_causal, dropout_p, scale, softcap) -> (B, H, T, d_head)
AttentionKernel = Callable[..., Tensor]


def build_attention_mask(attention_mask: Tensor, T: int, start: int, window: int | None = None) -> Tensor:
    """Causal boolean (B, 1, T, S) mask, True = may attend, for T queries at positions start .. start+T-1
    over S = start + T keys. ``attention_mask`` (B, S) marks real tokens with 1 and padding with 0.
    With a ``window`` W query i also needs i - W < j (sliding-window attention).

    A padding query would otherwise see no key at all; it is let see itself, which keeps every
    softmax row finite in every kernel (its output is never used).
    """
    S = start + T
    key_ok = attention_mask[:, None, None, :S].bool()  # (B, 1, 1, S)
    q_pos = torch.arange(start, S, device=attention_mask.device)[:, None]  # (T, 1)
    k_pos = torch.arange(S, device=attention_mask.device)[None, :]  # (1, S)
    allowed = key_ok & (k_pos <= q_pos)
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    return allowed | (k_pos == q_pos)


def ring_mask(attention_mask: Tensor | None, T: int, start: int, window: int, device: torch.device,
              R: int) -> Tensor:
    """(B|1, 1, T, K) mask over the keys a ring layer attends in a block call (``RingKV.write``).

    Slot s of the R-slot ring holds the latest position c = p - ((p - s) mod R)
    with c = s (mod R) up to p = start (one new token, written before attending: K = R) or p = start - 1 (a
    block of T > 1, attending the old slots and then its own T keys: K = R + T). A slot with c < 0 was never
    written. Query i sees key column c iff 0 <= c, i - W < c <= i and attention_mask[c] (columns count from
    the cache's start)."""
    last = start if T == 1 else start - 1
    cols = last - torch.remainder(last - torch.arange(R, device=device), R)
    if T > 1:
        cols = torch.cat([cols, torch.arange(start, start + T, device=device)])
    q_pos = torch.arange(start, start + T, device=device)[:, None]
    allowed = (cols >= 0) & (cols <= q_pos) & (cols > q_pos - window)  # (T, K)
    if attention_mask is None:
        return allowed[None, None]
    key_ok = attention_mask[:, cols.clamp_min(0)].bool()[:, None, None, :]  # (B, 1, 1, K)
    return (allowed & key_ok) | (cols == q_pos)


def token_positions(T: int, start: int, device: torch.device, attention_mask: Tensor | None,
                    position_ids: Tensor | None, limit: float) -> tuple[Tensor, int]:
    """The positions (B|1, T) of a block call's tokens, and the sequence length they imply (max + 1):
    ``position_ids`` as given, else counted over the tokens of ``attention_mask`` (cumsum(mask) - 1, padding
    at 0: with left padding every row counts 0, 1, 2, ... from its first token), else start .. start + T - 1.
    GenerationError when a position is at or beyond ``limit`` (the model's context, ``context_limit``)."""
    if position_ids is None and attention_mask is not None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, start : start + T]
    if position_ids is None:  # contiguous: the length needs no read-back from the device
        position_ids, seen = torch.arange(start, start + T, device=device)[None], start + T
    else:
        seen = int(position_ids.max()) + 1 if position_ids.numel() else start
    if seen > limit:
        raise GenerationError(f"position {seen - 1} is beyond the model's context (max_seq_len={limit})")
    return position_ids, seen


def context_limit(cfg: ModelConfig) -> float:
    """The positions a model may see: max_seq_len, or no bound (inf) for dynamic NTK RoPE (its base grows)."""
    return math.inf if cfg.rope_type == "dynamic" else cfg.max_seq_len


def layer_windows(cfg: ModelConfig, n_layer: int | None = None) -> list[int | None]:
    """Each layer's attention window (None: full causal); ``n_layer`` layers without windows when given
    (an encoder-decoder's decoder)."""
    return [cfg.layer_window(i) for i in range(cfg.n_layer)] if n_layer is None else [None] * n_layer


class _Same:
    """Indexable by any layer, the same value for each."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __getitem__(self, layer: int) -> object:
        return self.value


@dataclass
class Step:
    """One forward call, as attention sees it: the new tokens' ``positions`` (B|1, T), their rotary tables
    ``rope[layer]`` ((cos, sin), each (B|1, 1, T, d_head), set by the model; None without RoPE), and
    ``kv(layer, k, v) -> (keys, values, mask)``: what layer ``layer`` attends with its new keys and values
    (B, H_kv, T, d_head). Without a cache that is k and v themselves and ``masks[layer]``: (B|1, 1, T, T)
    bool, True = may attend, or None for plain causal (non-causal layers: no mask at all).

    ``seen`` is the sequence length the positions imply (max + 1), which the length-dependent RoPE variants
    read, or None where it would need a read-back from the device."""

    positions: Tensor | None
    masks: Sequence[Tensor | None] | _Same
    seen: int | None = None
    rope: Sequence[tuple[Tensor, Tensor] | None] | _Same | None = None  # None until the model sets it

    def kv(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        return k, v, self.masks[layer]

    def attend(self, layer: int, kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor,
               mask: Tensor | None, *args: object) -> Tensor:
        """``kernel(q, k, v, mask, *args)`` over the T queries together: (B, H, T, d_head)."""
        return kernel(q, k, v, mask, *args)

    @classmethod
    def whole(cls, mask: Tensor | None = None, rope: tuple[Tensor, Tensor] | None = None,
              positions: Tensor | None = None) -> Step:
        """A call over whole sequences without a cache whose every layer has one ``mask`` and ``rope``
        (an encoder, a block called on its own)."""
        return cls(positions, _Same(mask), rope=_Same(rope))


# a block or attention layer called on its own: its own keys, causal (or none) masking, no positions
WHOLE_SEQUENCE = Step.whole()


@dataclass
class BlockStep(Step):
    """A block call on a cache: the new keys and values go to positions start .. start + T - 1 of every row."""

    cache: KVCache | None = None
    start: int = 0

    def kv(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        keys, values = self.cache.store[layer].write(k, v, self.start)
        return keys, values, self.masks[layer]


@dataclass
class RowStep(Step):
    """A row call: row b's new keys and values go to its own positions ``positions[b]`` (B, T), each row at
    its own length (``rows`` (B, 1) indexes the rows alongside); attention runs over slots [0, kv_len) (a
    ring: its R slots), masked per row."""

    cache: KVCache | None = None
    kv_len: int = 0
    rows: Tensor | None = None
    per_query: bool = False

    def kv(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        keys, values = self.cache.store[layer].write_rows(k, v, self.rows, self.positions, self.kv_len)
        return keys, values, self.masks[layer]

    def attend(self, layer: int, kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor,
               mask: Tensor | None, *args: object) -> Tensor:
        """With ``per_query`` (``KVCache.at``) each query attends alone, so that its output is bit for bit a
        one-token call's at its position (a fused kernel's sums depend on how many queries and keys it is
        given, even masked ones). On a CPU, for a cache made with ``row_kernel``: the C++ kernel
        ``row_attention``, which sums each query over its allowed slots in slot order, for the one-token step
        and the T-token verification alike (also inside a compiled graph, T symbolic). Elsewhere (or with
        soft-capped scores, or dropout): query t in a ``kernel`` call of its own over the slots a one-token
        call attends, [0, kv_len - T + 1 + t) (a ring: its R slots); a compiled graph calls ``kernel`` once."""
        T = q.shape[2]
        if not self.per_query:
            return kernel(q, k, v, mask, *args)
        assert mask is not None  # a row call always masks
        _, dropout_p, scale, softcap = args
        if (self.cache.row_kernel and q.device.type == "cpu" and q.dtype == k.dtype == torch.float32
                and not dropout_p and softcap is None and quant_kernels.available()):
            return quant_kernels.row_attention(q, k, v, mask, scale)
        if T == 1 or torch.compiler.is_compiling():
            return kernel(q, k, v, mask, *args)
        ring = isinstance(self.cache.store[layer], RingKV)
        outs = []
        for t in range(T):
            s = k.shape[2] if ring else k.shape[2] - T + 1 + t
            outs.append(kernel(q[:, :, t : t + 1], k[:, :, :s], v[:, :, :s], mask[:, :, t : t + 1, :s], *args))
        return torch.cat(outs, dim=2)  # (B, H, T, d_head)


class DenseKV:
    """One layer's keys and values for every position: k, v (B, H_kv, max_len, d_head), position p at index p."""

    def __init__(self, k: Tensor, v: Tensor, window: int | None) -> None:
        self.k, self.v, self.window = k, v, window
        self.kind: tuple = ("dense", window)

    def write(self, k: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """k, v (B, H_kv, T, d_head) to positions start .. start + T - 1; the keys and values of 0 .. start + T - 1."""
        T = k.shape[2]
        self.k[:, :, start : start + T] = k
        self.v[:, :, start : start + T] = v
        return self.k[:, :, : start + T], self.v[:, :, : start + T]

    def write_rows(self, k: Tensor, v: Tensor, rows: Tensor, positions: Tensor,
                   kv_len: int) -> tuple[Tensor, Tensor]:
        """Row b's k, v (B, H_kv, T, d_head) to positions[b] (B, T) (``rows`` (B, 1): 0 .. B-1); the keys and
        values of slots [0, kv_len)."""
        self.k[rows, :, positions] = k.transpose(1, 2)  # indexed (B, T, H_kv, d_head)
        self.v[rows, :, positions] = v.transpose(1, 2)
        return self.k[:, :, :kv_len], self.v[:, :, :kv_len]

    def block_mask(self, T: int, start: int, attention_mask: Tensor | None, device: torch.device) -> Tensor | None:
        """The (B|1, 1, T, start + T) mask of a block call: query i (at position start + i) sees key j iff
        j <= start + i, start + i - W < j (window W) and key j is a token. None where that is plain causal
        attention from position 0, or one query that sees every key: the kernel's own causal mode then."""
        window = self.window
        if attention_mask is not None:
            return build_attention_mask(attention_mask, T, start, window=window)
        if (start == 0 or T == 1) and (window is None or start + T <= window):
            return None
        q_pos = torch.arange(start, start + T, device=device)[:, None]  # (T, 1)
        k_pos = torch.arange(start + T, device=device)[None, :]  # (1, S)
        return ((k_pos <= q_pos) & (k_pos > q_pos - (window or start + T)))[None, None]

    def rows_mask(self, positions: Tensor, kv_len: int) -> Tensor:
        """(B, 1, T, kv_len): query t of row b (at positions[b, t]) sees slot j <= its position (and within W)."""
        q = positions[:, :, None]  # (B, T, 1)
        keys = torch.arange(kv_len, device=positions.device)
        allowed = keys <= q
        if self.window is not None:
            allowed = allowed & (keys > q - self.window)
        return allowed[:, None]

    def forget(self, row: int, length: int, old: int) -> None:
        """Zero positions [length, old) of ``row``: as if never written."""
        self.k[row, :, length:old] = 0
        self.v[row, :, length:old] = 0

    def rows(self, start: int, stop: int) -> DenseKV:
        return type(self)(self.k[start:stop], self.v[start:stop], self.window)

    def index_rows(self, index: Tensor) -> DenseKV:
        return type(self)(self.k.index_select(0, index), self.v.index_select(0, index), self.window)


class RingKV(DenseKV):
    """A sliding-window layer's ring of R >= W slots: position p in slot p mod R (see the module docstring)."""

    def __init__(self, k: Tensor, v: Tensor, window: int | None) -> None:
        super().__init__(k, v, window)
        self.slots = k.shape[2]
        self.kind = ("ring", window, self.slots)

    def write(self, k: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Write new keys/values into the ring; return the keys and values to attend over. One new token
        overwrites position p - R, which it may not see anyway, so it is written first and the R slots are
        attended; a block of T > 1 tokens attends the R old slots plus its own keys (a query in the block may
        still see positions the block's later tokens overwrite)."""
        R, T = self.slots, k.shape[2]
        if T == 1:
            self.k[:, :, start % R] = k[:, :, 0]
            self.v[:, :, start % R] = v[:, :, 0]
            return self.k, self.v
        keys, values = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        n = min(T, R)  # only the last R positions of the block outlive it
        slots = torch.arange(start + T - n, start + T, device=k.device) % R
        self.k.index_copy_(2, slots, k[:, :, T - n :])
        self.v.index_copy_(2, slots, v[:, :, T - n :])
        return keys, values

    def write_rows(self, k: Tensor, v: Tensor, rows: Tensor, positions: Tensor,
                   kv_len: int) -> tuple[Tensor, Tensor]:
        """Row b's T tokens to slots positions[b] mod R, written first: with R >= W + T - 1 they overwrite
        only positions that none of the T queries sees. The R slots are attended."""
        slots = positions % self.slots  # (B, T)
        self.k[rows, :, slots] = k.transpose(1, 2)  # indexed (B, T, H_kv, d_head)
        self.v[rows, :, slots] = v.transpose(1, 2)
        return self.k, self.v

    def block_mask(self, T: int, start: int, attention_mask: Tensor | None, device: torch.device) -> Tensor:
        assert self.window is not None
        return ring_mask(attention_mask, T, start, self.window, device, self.slots)

    def rows_mask(self, positions: Tensor, kv_len: int) -> Tensor:
        """(B, 1, T, R): after the write, slot s of row b holds position c = last - ((last - s) mod R), last =
        positions[b, -1]; query t (at q = positions[b, t]) sees it iff 0 <= c, q - W < c <= q."""
        assert self.window is not None
        T = positions.shape[1]
        if T > self.slots - self.window + 1:
            raise GenerationError(f"a ring of {self.slots} slots for a window of {self.window} takes at most "
                                  f"{self.slots - self.window + 1} tokens per row and call, got {T} (more "
                                  "spare_slots in new_cache)")
        last = positions[:, -1:]  # (B, 1)
        held = (last - torch.remainder(last - torch.arange(self.slots, device=last.device), self.slots))[:, None]
        q = positions[:, :, None]  # (B, T, 1)
        return ((held >= 0) & (held <= q) & (held > q - self.window))[:, None]  # (B, 1, T, R)

    def forget(self, row: int, length: int, old: int) -> None:
        """The slots a rollback frees hold positions no later query sees; a ring cannot restore the older
        positions they overwrote, so only a rollback of at most R - W + 1 tokens is possible."""
        assert self.window is not None
        if old - length > self.slots - self.window + 1:
            raise GenerationError(f"a ring of {self.slots} slots for a window of {self.window} can roll back "
                                  f"{self.slots - self.window + 1} tokens at most, not {old - length} "
                                  "(more spare_slots in new_cache)")


class _Uncached:
    """A layer without storage: its mask only (``NoCache``)."""

    def __init__(self, window: int | None) -> None:
        self.window, self.kind = window, ("dense", window)

    block_mask = DenseKV.block_mask


def _masks_by_kind(store: Sequence[DenseKV | _Uncached], make) -> list[Tensor | None]:
    """One mask per kind of layer (dense / ring, window), shared by the layers of that kind."""
    made = {kind: make(layer) for kind, layer in {s.kind: s for s in store}.items()}
    return [made[s.kind] for s in store]


class NoCache:
    """Attention without a cache (training, scoring, a plain forward): each call attends its own keys."""

    def __init__(self, cfg: ModelConfig, n_layer: int | None = None) -> None:
        self.store = [_Uncached(w) for w in layer_windows(cfg, n_layer)]
        self.limit = context_limit(cfg)

    def begin(self, input_ids: Tensor, attention_mask: Tensor | None = None,
              position_ids: Tensor | None = None) -> Step:
        T, device = input_ids.shape[1], input_ids.device
        positions, seen = token_positions(T, 0, device, attention_mask, position_ids, self.limit)
        return Step(positions, _masks_by_kind(self.store, lambda s: s.block_mask(T, 0, attention_mask, device)),
                    seen)


class SharedPrefix:
    """Rows that continue shared prefixes, each prefix run once: the G completions of one GRPO prompt.

    Two calls of the model on it, without a cache. First the prefix call: the U distinct prefixes, right-padded
    to (U, L), prefix u real on its first n_u = ``lengths[u]`` positions (causal attention never lets a real
    token see the padding after it). Each layer's keys and values K_l, V_l (U, H_kv, L, d_head) are kept.
    Then the rows' call: the R rows' own tokens (R, T), row r continuing prefix g = ``group[r]`` at positions
    n_g .. n_g + T - 1. Layer l attends [K_l[g] ; its own keys] (R, H_kv, L + T, d_head) (values alike) with
    the (R, 1, T, L + T) mask

        query t of row r sees prefix key j  iff  j < n_g         (and n_g + t - W < j with a window W)
                         and its own key s  iff  s <= t          (and t - W < s)

    which is what row r written out in full, prefix then own tokens, attends in one causal call from position 0:
    the same outputs, and (autograd sums over the rows that index a prefix) the same gradients, at U L + R T
    tokens instead of R (L + T). ``seen`` is the length of the longest full row (max_r n_g + its tokens),
    which the length-dependent RoPE variants read in both calls, as they would in the full call. The two calls'
    ``attention_mask`` and ``position_ids`` are not used: the positions follow from ``lengths``."""

    def __init__(self, cfg: ModelConfig, lengths: Tensor, group: Tensor, seen: int,
                 n_layer: int | None = None) -> None:
        self.store = [_Uncached(w) for w in layer_windows(cfg, n_layer)]
        self.lengths, self.group, self.seen = lengths, group, seen
        if seen > context_limit(cfg):
            raise GenerationError(f"position {seen - 1} is beyond the model's context (max_seq_len={cfg.max_seq_len})")
        #: each layer's prefix keys and values (U, H_kv, L, d_head), set by the prefix call
        self.kv: list[tuple[Tensor, Tensor] | None] = [None] * len(self.store)

    def begin(self, input_ids: Tensor, attention_mask: Tensor | None = None,
              position_ids: Tensor | None = None) -> Step:
        """The prefix call (the first): the U prefixes at positions 0 .. L - 1, causal (with each layer's
        window). The rows' call: row r's T tokens at positions n_g .. n_g + T - 1 after its group's prefix."""
        device = input_ids.device
        if self.kv[0] is None:
            L = input_ids.shape[1]
            masks = _masks_by_kind(self.store, lambda s: s.block_mask(L, 0, None, device))
            return _SharedStep(torch.arange(L, device=device)[None], masks, self.seen, shared=self)
        R, T = input_ids.shape
        L = self.kv[0][0].shape[2]
        start = self.lengths.index_select(0, self.group)[:, None]  # (R, 1)
        positions = start + torch.arange(T, device=device)  # (R, T)
        prefix = torch.arange(L, device=device)
        key_pos = torch.cat([prefix.expand(R, L), positions], dim=1)[:, None]  # (R, 1, L + T)
        key_ok = torch.cat([prefix < start, torch.ones(R, T, dtype=torch.bool, device=device)], dim=1)[:, None]
        q_pos = positions[:, :, None]  # (R, T, 1)

        def mask(layer: _Uncached) -> Tensor:
            allowed = key_ok & (key_pos <= q_pos)  # (R, T, L + T)
            if layer.window is not None:
                allowed = allowed & (key_pos > q_pos - layer.window)
            return allowed[:, None]

        return _SharedStep(positions, _masks_by_kind(self.store, mask), self.seen, shared=self, rows=True)


@dataclass
class _SharedStep(Step):
    """A call on a ``SharedPrefix``: the prefix call attends its own keys and values and keeps them; the rows'
    call (``rows``) attends each row's prefix keys and values (copied to the row: (R, H_kv, L, d_head)), then
    its own."""

    shared: SharedPrefix | None = None
    rows: bool = False

    def kv(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        if not self.rows:
            self.shared.kv[layer] = (k, v)
            return k, v, self.masks[layer]
        pk, pv = self.shared.kv[layer]
        group = self.shared.group
        keys = torch.cat([pk.index_select(0, group), k], dim=2)
        values = torch.cat([pv.index_select(0, group), v], dim=2)
        return keys, values, self.masks[layer]


class KVCache:
    """Preallocated keys and values of ``batch_size`` rows x ``max_len`` positions, every layer (see the module
    docstring). ``length`` is where the next block call writes (None after ``truncate`` left rows at different
    lengths: then feed them with ``at``); ``layers`` lists each layer's (k, v) buffers."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
                 n_layer: int | None = None, rolling: bool = True, spare_slots: int = 0,
                 row_kernel: bool = False) -> None:
        self.max_len = max_len or cfg.max_seq_len
        # per-query attention through quant_kernels.row_attention (RowStep.attend): for a model whose products
        # are tinyformer's CPU kernels (quant_kernels.uses_kernels), which are built already; a model without
        # them does not wait on their first build for its attention
        self.row_kernel = row_kernel
        self.batch_size = batch_size
        self.limit = context_limit(cfg)
        self.store: list[DenseKV] = []
        for w in layer_windows(cfg, n_layer):
            ring = rolling and w is not None and w + spare_slots < self.max_len
            shape = (batch_size, cfg.n_kv_head, w + spare_slots if ring else self.max_len, cfg.head_dim)
            kv = torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype)
            self.store.append(RingKV(*kv, w) if ring else DenseKV(*kv, w))
        self.length: int | None = 0  # positions filled so far, the same for every row (padding is masked)

    @property
    def rolling(self) -> list[bool]:
        """Which layers are rings (position p in slot p mod R rather than at index p)."""
        return [isinstance(s, RingKV) for s in self.store]

    @property
    def layers(self) -> list[tuple[Tensor, Tensor]]:
        """Each layer's (k, v) buffers, (B, H_kv, max_len or R, d_head)."""
        return [(s.k, s.v) for s in self.store]

    def begin(self, input_ids: Tensor, attention_mask: Tensor | None = None,
              position_ids: Tensor | None = None) -> Step:
        """A block call of T = input_ids.shape[1] tokens at positions length .. length + T - 1 (or
        ``position_ids``); the cache then holds length + T positions."""
        T, device, start = input_ids.shape[1], input_ids.device, self.length
        if start is None or start + T > self.max_len:
            raise GenerationError(self._no_room(T))
        positions, seen = token_positions(T, start, device, attention_mask, position_ids, self.limit)
        masks = _masks_by_kind(self.store, lambda s: s.block_mask(T, start, attention_mask, device))
        self.length = start + T
        return BlockStep(positions, masks, seen, cache=self, start=start)

    def at(self, positions: Tensor, kv_len: int | None = None, *, per_query: bool = False) -> RowCalls:
        """The next call feeds row b at ``positions[b]`` .. (B,), attending over slots [0, ``kv_len``): by default
        the furthest position + 1 + T - 1 (a read-back to the host); a given ``kv_len`` (``max_len``, or a size
        that is symbolic under ``torch.compile``) needs none, and the caller guarantees that the positions fit.
        ``per_query`` (eager calls of T > 1 tokens with the default ``kv_len``: speculative verification) attends
        each query as a one-token call at its position would (``RowStep.attend``)."""
        return RowCalls(self, positions, kv_len, per_query)

    def _no_room(self, T: int) -> str:
        if self.length is None:
            return "the rows of this KV cache are at different lengths (after truncate): feed them with cache.at()"
        return f"the KV cache holds {self.max_len} positions; {self.length} are used and {T} more were given"

    def truncate(self, lengths: int | Sequence[int], *, old: int | Sequence[int] | None = None) -> None:
        """Roll rows back: row b keeps positions [0, lengths[b]) (an int: every row), as if it had never seen the
        later ones (speculative decoding rejects draft tokens this way). ``old``: the rows' lengths now, by
        default ``length``. Raises GenerationError beyond what a ring can roll back (see the module docstring)."""
        B = self.batch_size
        old = self.length if old is None else old
        new = [lengths] * B if isinstance(lengths, int) else [int(n) for n in lengths]
        now = [old] * B if old is None or isinstance(old, int) else [int(n) for n in old]
        if len(new) != B or len(now) != B or None in now:
            raise ValueError(f"truncate needs {B} lengths and known current lengths, got {lengths!r} from {old!r}")
        for row, (n, o) in enumerate(zip(new, now)):
            if not 0 <= n <= o:
                raise GenerationError(f"row {row} holds {o} positions; it cannot be truncated to {n}")
            for s in self.store:
                s.forget(row, n, o)
        self.length = new[0] if len(set(new)) == 1 else None

    def nbytes(self) -> int:
        return sum(s.k.numel() * s.k.element_size() * 2 for s in self.store)

    @property
    def indexed_by_position(self) -> bool:
        """Whether every layer holds position p at index p (no ring), so rows can be copied in and out by position."""
        return not any(self.rolling)

    def row_view(self, start: int, stop: int | None = None) -> KVCache:
        """A cache over rows [start, stop) that shares storage with this one (writes go through),
        starting empty. Continuous batching prefills one request into its slot this way."""
        stop = start + 1 if stop is None else stop
        view = KVCache.__new__(KVCache)
        view.max_len, view.batch_size, view.length, view.limit = self.max_len, stop - start, 0, self.limit
        view.row_kernel = self.row_kernel
        view.store = [s.rows(start, stop) for s in self.store]
        return view

    def reorder(self, index: Tensor) -> None:
        """Keep rows ``index`` (beam search reorders hypotheses), in place."""
        self.store = [s.index_rows(index) for s in self.store]
        self.batch_size = int(index.numel())


class RowCalls:
    """A cache whose next call feeds each row at its own position (``KVCache.at``)."""

    def __init__(self, cache: KVCache, positions: Tensor, kv_len: int | None, per_query: bool = False) -> None:
        self.cache, self.positions, self.kv_len, self.per_query = cache, positions, kv_len, per_query

    def begin(self, input_ids: Tensor, attention_mask: Tensor | None = None,
              position_ids: Tensor | None = None) -> Step:
        """Row b's T tokens at positions[b] .. positions[b] + T - 1 (``attention_mask`` and ``position_ids``
        are not used: each row's positions are its own)."""
        T, start, kv_len = input_ids.shape[1], self.positions, self.kv_len
        if kv_len is None:
            kv_len = int(start.max()) + T
            if kv_len > self.cache.max_len:
                raise GenerationError(f"the KV cache holds {self.cache.max_len} positions; position {kv_len - 1} "
                                      "was asked")
            if kv_len > self.cache.limit:
                raise GenerationError(f"position {kv_len - 1} is beyond the model's context "
                                      f"(max_seq_len={self.cache.limit})")
        positions = start[:, None] + torch.arange(T, device=start.device)  # (B, T)
        masks = _masks_by_kind(self.cache.store, lambda s: s.rows_mask(positions, kv_len))
        rows = torch.arange(start.shape[0], device=start.device)[:, None]  # (B, 1)
        return RowStep(positions, masks, cache=self.cache, kv_len=kv_len, rows=rows, per_query=self.per_query)
