"""A prefix cache: requests that share a token prefix reuse its keys and values instead of recomputing them.

Why it is exact: with causal attention, the key and value of position p in layer l depend only on tokens
0..p (every layer's hidden state at p sees positions <= p only). So two prompts that agree on tokens
0..n-1 have identical K/V at positions 0..n-1 in every layer, and copying them from an earlier request
gives bit-for-bit the cache a prefill would have written (up to the float rounding of a different matmul
shape). The engine then prefills only tokens n.. from position n.

Blocks: the cache is kept in blocks of ``block_size`` consecutive positions. A block holds, for every
layer, K and V of its positions: one tensor (2, n_layer, H_kv, block_size, d_head), the same per-layer
layout as a :class:`~tinyformer.components.kv_cache.KVCache` row (H_kv, max_len, d_head) cut along
positions. Its memory is

    block_bytes = 2 * n_layer * H_kv * block_size * d_head * bytes_per_element

and the cache holds at most floor(budget_bytes / block_bytes) blocks. Only whole blocks are cached, so a
hit covers a multiple of ``block_size`` tokens.

Chain hash: block i of a prompt is addressed by key_i = hash((key_{i-1}, tokens of block i)), key_{-1} = None
(as vLLM does), so a block is found only when the whole prefix before it matches too: the same 16 tokens
after a different prefix have different K/V and a different key. The block keeps its parent key and its
tokens, and a lookup checks them, so a hash collision is a miss, never wrong K/V.

Lifecycle of a request: ``hit = lookup(prompt)`` (the longest cached prefix of whole blocks, at most
len(prompt) - 1 tokens so that one token is still prefilled and gives the first logits; the hit's blocks
are pinned) -> ``load(hit, cache, row)`` (copies K/V into positions [0, hit.length) of the row) -> prefill
prompt[hit.length:] from position hit.length -> ``store(prompt, cache, row, n)`` (caches the row's whole
blocks, of the prompt or of prompt + generated tokens) -> ``release(hit)`` when the request finishes or is
cancelled (unpins).

Reference counts and eviction: each block counts the hits that pin it; a pinned block is never evicted.
When a store needs room, the least recently used unpinned block without cached children is evicted
(leaf first: no cached block is ever left whose parent was evicted). Lookups and stores mark their whole
chain as used, children before parents, so a parent is always more recent than its descendants. A block
that cannot fit because every block is pinned is not stored (nor are the blocks after it).

Releasing a hit twice is a no-op: the hit remembers that it was released (a request may be cancelled
and finish at the same time). Sliding-window caches whose layers are rings (``cache.rolling``) hold
positions by slot p mod W, not by index: :meth:`PrefixCache.enabled_for` is False for them. Not
thread-safe: the one engine loop that owns it calls it between forward passes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tinyformer.components.kv_cache import KVCache
from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError


@dataclass(eq=False)
class _Block:
    key: int
    parent: int | None  # the key of the block before it; None for a prompt's first block
    tokens: tuple[int, ...]
    kv: torch.Tensor  # (2, n_layer, H_kv, block_size, d_head)
    refs: int = 0  # hits that pin it
    children: int = 0  # cached blocks whose parent it is


@dataclass(eq=False)
class PrefixHit:
    """The result of a lookup: ``blocks`` (pinned, in prompt order) cover tokens [0, length)."""

    length: int
    blocks: tuple[_Block, ...] = ()
    released: bool = field(default=False, repr=False)


@dataclass
class PrefixStats:
    hits: int = 0  # lookups that reused at least one block
    misses: int = 0
    tokens_reused: int = 0
    blocks_stored: int = 0
    evictions: int = 0
    bytes_used: int = 0


def _chain_key(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class PrefixCache:
    """A pool of K/V blocks addressed by chain hash, reference-counted, evicted LRU under ``budget_bytes``."""

    def __init__(self, cfg: ModelConfig, *, block_size: int = 16, budget_bytes: int,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        if block_size < 1:
            raise ConfigError(f"prefix cache block_size must be >= 1, got {block_size}")
        if budget_bytes < 0:
            raise ConfigError(f"prefix cache budget_bytes must be >= 0, got {budget_bytes}")
        self.n_layer, self.n_kv_head, self.head_dim = cfg.n_layer, cfg.n_kv_head, cfg.head_dim
        self.block_size, self.budget_bytes = block_size, budget_bytes
        self.device, self.dtype = torch.device(device or "cpu"), dtype
        elem = torch.empty((), dtype=dtype).element_size()
        self.block_bytes = 2 * self.n_layer * self.n_kv_head * block_size * self.head_dim * elem
        self.max_blocks = budget_bytes // self.block_bytes
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def enabled_for(self, cache: KVCache) -> bool:
        """Whether this cache's rows hold position p at index p in every layer (no rolling ring) with
        this pool's shapes, so blocks can be copied in and out."""
        if not cache.indexed_by_position or len(cache.layers) != self.n_layer:
            return False
        k = cache.layers[0][0]
        return k.shape[1] == self.n_kv_head and k.shape[3] == self.head_dim

    # ------------------------------------------------------------------ lookup / release

    def lookup(self, tokens: Sequence[int]) -> PrefixHit:
        """The longest cached prefix of whole blocks covering at most len(tokens) - 1 tokens; its blocks
        are pinned (release the hit when done) and marked most recently used."""
        found: list[_Block] = []
        parent: int | None = None
        for i in range(max(len(tokens) - 1, 0) // self.block_size):
            chunk = tuple(int(t) for t in tokens[i * self.block_size : (i + 1) * self.block_size])
            block = self._find(parent, chunk)
            if block is None:
                break
            found.append(block)
            parent = block.key
        for block in found:
            block.refs += 1
        self._touch(found)
        hit = PrefixHit(len(found) * self.block_size, tuple(found))
        if found:
            self.stats.hits += 1
            self.stats.tokens_reused += hit.length
        else:
            self.stats.misses += 1
        return hit

    def release(self, hit: PrefixHit) -> None:
        """Unpins the hit's blocks; a second release of the same hit does nothing."""
        if hit.released:
            return
        hit.released = True
        for block in hit.blocks:
            block.refs -= 1

    # ------------------------------------------------------------------ copying K/V

    def load(self, hit: PrefixHit, cache: KVCache, row: int) -> None:
        """Copies the hit's K/V into positions [0, hit.length) of ``row`` of ``cache``, every layer."""
        if not hit.blocks:
            return
        self._check(cache, hit.length)
        if hit.released:
            raise ValueError("this prefix-cache hit was released: its blocks may have been evicted")
        kv = torch.cat([b.kv for b in hit.blocks], dim=3)  # (2, n_layer, H_kv, length, d_head)
        k0 = cache.layers[0][0]
        kv = kv.to(device=k0.device, dtype=k0.dtype)
        for layer, (k, v) in enumerate(cache.layers):
            k[row, :, : hit.length] = kv[0, layer]
            v[row, :, : hit.length] = kv[1, layer]

    def store(self, tokens: Sequence[int], cache: KVCache, row: int, length: int) -> int:
        """Caches the whole blocks of tokens[:length], whose K/V are positions [0, length) of ``row`` (the
        caller guarantees that the row holds them). Blocks already cached are only marked used; new ones
        evict LRU unpinned blocks to fit the budget. Returns how many blocks were newly stored."""
        if length > len(tokens):
            raise ValueError(f"store of {length} positions but only {len(tokens)} tokens were given")
        self._check(cache, length)
        chain: list[_Block] = []
        new = 0
        parent: int | None = None
        try:
            for i in range(length // self.block_size):
                lo, hi = i * self.block_size, (i + 1) * self.block_size
                chunk = tuple(int(t) for t in tokens[lo:hi])
                block = self._find(parent, chunk)
                if block is None:
                    if _chain_key(parent, chunk) in self._blocks or not self._make_room():
                        break  # a hash collision with another chain, or everything is pinned
                    kv = torch.stack([torch.stack([k[row, :, lo:hi], v[row, :, lo:hi]]) for k, v in cache.layers], 1)
                    block = _Block(_chain_key(parent, chunk), parent, chunk,
                                   kv.to(device=self.device, dtype=self.dtype, copy=True))
                    self._blocks[block.key] = block
                    if parent is not None:
                        self._blocks[parent].children += 1
                    new += 1
                    self.stats.blocks_stored += 1
                block.refs += 1  # the chain being stored must not be evicted to make room for its own tail
                chain.append(block)
                parent = block.key
        finally:
            for block in chain:
                block.refs -= 1
        self._touch(chain)
        self.stats.bytes_used = len(self._blocks) * self.block_bytes
        return new

    def clear(self) -> None:
        """Drops every block and resets the statistics. Outstanding hits keep their own blocks' data (they
        can still be loaded and released), but nothing is cached any more."""
        self._blocks.clear()
        self.stats = PrefixStats()

    # ------------------------------------------------------------------ internals

    def _find(self, parent: int | None, chunk: tuple[int, ...]) -> _Block | None:
        block = self._blocks.get(_chain_key(parent, chunk))
        if block is None or block.parent != parent or block.tokens != chunk:
            return None  # absent, or a hash collision
        return block

    def _touch(self, chain: list[_Block]) -> None:
        # children first, so that every parent ends up more recent than its descendants
        for block in reversed(chain):
            self._blocks.move_to_end(block.key)

    def _make_room(self) -> bool:
        """Evicts LRU unpinned leaf blocks until one more block fits; False if it cannot."""
        while len(self._blocks) >= self.max_blocks:
            victim = next((b for b in self._blocks.values() if b.refs == 0 and b.children == 0), None)
            if victim is None:
                return False
            del self._blocks[victim.key]
            if victim.parent is not None:
                self._blocks[victim.parent].children -= 1
            self.stats.evictions += 1
        return True

    def _check(self, cache: KVCache, length: int) -> None:
        if not self.enabled_for(cache):
            raise ValueError("the prefix cache needs a KV cache without rolling layers and with this model's shapes")
        if length > cache.max_len:
            raise ValueError(f"{length} positions do not fit a KV cache of {cache.max_len}")
