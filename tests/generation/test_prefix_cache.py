"""The prefix cache against a full prefill without any cache: a hit loaded into a KV cache row, followed by a
prefill of the rest, must give the logits of the whole prompt computed from scratch. Eviction, pinning and
the chain hash are checked through what later lookups and running rows see."""

from __future__ import annotations

import pytest
import torch

from tinyformer.components.kv_cache import KVCache
from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError
from tinyformer.generation.prefix_cache import PrefixCache
from tinyformer.models.decoder import DecoderLM

BS = 4  # block size of these tests: small, so that prompts span several blocks


def random_lm(**overrides) -> DecoderLM:
    """A small fp32 decoder with weights large enough for varied, peaked logits."""
    torch.manual_seed(0)
    fields = dict(vocab_size=50, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=64)
    model = DecoderLM(ModelConfig(**{**fields, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def prefill(model: DecoderLM, cache: KVCache, row: int, prompt: list[int], start: int = 0) -> torch.Tensor:
    """Prefills prompt[start:] into ``row`` from position ``start`` (positions < start already hold K/V, as the
    server prefills one request into its slot); the last position's logits (vocab,)."""
    view = cache.row_view(row)
    view.length = start
    return model(torch.tensor([prompt[start:]]), cache=view, last_only=True)[0, -1]


@torch.no_grad()
def full_logits(model: DecoderLM, prompt: list[int]) -> torch.Tensor:
    """The reference: one forward over the whole prompt, no cache."""
    return model(torch.tensor([prompt]))[0, -1]


def assert_same_logits(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


def pool(model: DecoderLM, blocks: int = 64) -> PrefixCache:
    probe = PrefixCache(model.cfg, block_size=BS, budget_bytes=0)
    return PrefixCache(model.cfg, block_size=BS, budget_bytes=blocks * probe.block_bytes)


def same_block_after_two_prefixes() -> tuple[list[int], list[int]]:
    """Two prompts whose second blocks hold the same tokens after different first blocks."""
    shared_block = tokens(BS, seed=7)
    return tokens(BS, seed=8) + shared_block + [1], tokens(BS, seed=9) + shared_block + [1]


def assert_exact_hit(model: DecoderLM, prefix: PrefixCache, prompt: list[int], length: int) -> None:
    """The prompt hits ``length`` tokens, and loading them into a fresh row gives a full prefill's logits."""
    hit = prefix.lookup(prompt)
    assert hit.length == length
    cache = model.new_cache(1)
    prefix.load(hit, cache, 0)
    assert_same_logits(prefill(model, cache, 0, prompt, hit.length), full_logits(model, prompt))
    prefix.release(hit)


# ------------------------------------------------------------------ a hit equals a miss


@pytest.mark.parametrize("heads", [dict(n_head=4, n_kv_head=2), dict(n_head=4, n_kv_head=4),
                                   dict(n_head=4, n_kv_head=1, pos="learned")], ids=["gqa", "mha", "mqa-learned"])
@pytest.mark.parametrize("shared", [10, 8, 3], ids=["mid-block", "block-boundary", "under-a-block"])
def test_hit_then_prefill_of_the_rest_gives_the_logits_of_a_full_prefill(heads, shared, one_thread):
    model = random_lm(**heads)
    prefix = PrefixCache(model.cfg, block_size=BS, budget_bytes=1 << 20)
    a = tokens(23, seed=1)
    b = a[:shared] + [(t + 1) % 50 for t in a[shared:]]  # differs from a at every position from `shared` on
    cache = model.new_cache(2)
    prefill(model, cache, 0, a)
    assert prefix.store(a, cache, 0, len(a)) == len(a) // BS

    hit = prefix.lookup(b)
    assert hit.length == shared // BS * BS and len(hit.blocks) == shared // BS
    prefix.load(hit, cache, 1)
    assert_same_logits(prefill(model, cache, 1, b, hit.length), full_logits(model, b))
    if hit.length:  # the check can fail: without the loaded K/V the same prefill gives other logits
        fresh = model.new_cache(1)
        assert not torch.allclose(prefill(model, fresh, 0, b, hit.length), full_logits(model, b), rtol=1e-3)
    prefix.release(hit)


def test_an_exact_full_match_leaves_at_least_one_token_to_prefill(one_thread):
    model = random_lm()
    prefix = pool(model)
    for n in (12, 13):  # 12: whole blocks, the last is not reused; 13: all three blocks reused
        a = tokens(n, seed=n)
        cache = model.new_cache(1)
        prefill(model, cache, 0, a)
        prefix.store(a, cache, 0, n)
        assert_exact_hit(model, prefix, a, (n - 1) // BS * BS)


def test_prompts_shorter_than_a_block_neither_store_nor_hit(one_thread):
    model = random_lm()
    prefix = pool(model)
    a = tokens(BS - 1, seed=3)
    cache = model.new_cache(1)
    prefill(model, cache, 0, a)
    assert prefix.store(a, cache, 0, len(a)) == 0
    hit = prefix.lookup(a + [1])
    assert hit.length == 0 and hit.blocks == ()
    assert (prefix.stats.hits, prefix.stats.misses, len(prefix)) == (0, 1, 0)


def test_a_growing_conversation_reuses_its_earlier_turns(one_thread):
    """Turn 2's prompt is turn 1's prompt + reply + new text: the stored blocks of turn 1 (prompt and generated
    tokens alike) are reused, and turn 2's logits equal a full prefill."""
    model = random_lm()
    prefix = pool(model)
    cache = model.new_cache(1)
    turn1 = tokens(11, seed=4)
    prefill(model, cache, 0, turn1)
    reply = tokens(6, seed=5)
    view = cache.row_view(0)
    view.length = len(turn1)
    with torch.no_grad():
        model(torch.tensor([reply]), cache=view)  # the decode steps of the reply, in one go
    prefix.store(turn1 + reply, cache, 0, len(turn1) + len(reply))
    turn2 = turn1 + reply + tokens(7, seed=6)
    assert_exact_hit(model, prefix, turn2, 16)
    assert prefix.stats.tokens_reused == 16


def test_same_block_tokens_after_a_different_prefix_do_not_hit(one_thread):
    model = random_lm()
    prefix = pool(model)
    a, c = same_block_after_two_prefixes()
    cache = model.new_cache(1)
    prefill(model, cache, 0, a)
    prefix.store(a, cache, 0, len(a))
    prefill(model, cache, 0, c)
    prefix.store(c, cache, 0, BS)  # only c's first block
    assert_exact_hit(model, prefix, c, BS)  # c's second block has a's tokens, but after another first block
    assert prefix.store(c, cache, 0, len(c)) == 1  # a block of its own, with c's K/V
    assert_exact_hit(model, prefix, c, 2 * BS)


def test_a_hash_collision_is_a_miss_not_another_prefix_kv(one_thread, monkeypatch):
    """With a key that ignores the parent, the same block after two prefixes collides: the block's stored
    parent and tokens must turn that into a miss."""
    from tinyformer.generation import prefix_cache

    monkeypatch.setattr(prefix_cache, "_chain_key", lambda parent, toks: hash(toks))
    model = random_lm()
    prefix = pool(model)
    a, c = same_block_after_two_prefixes()
    cache = model.new_cache(1)
    for p in (a, c):
        prefill(model, cache, 0, p)
        prefix.store(p, cache, 0, len(p))
    assert_exact_hit(model, prefix, c, BS)


# ------------------------------------------------------------------ budget, pins, eviction


def test_block_bytes_is_the_kv_cache_memory_of_block_size_positions():
    cfg = ModelConfig(vocab_size=50, d_model=48, n_layer=3, n_head=6, n_kv_head=2, d_ff=64, max_seq_len=64)
    for dtype in (torch.float32, torch.bfloat16):
        prefix = PrefixCache(cfg, block_size=8, budget_bytes=1000, dtype=dtype)
        assert prefix.block_bytes == KVCache(cfg, 1, max_len=8, dtype=dtype).nbytes()
        assert prefix.block_bytes == 2 * 3 * 2 * 8 * 8 * dtype.itemsize


def test_a_pinned_block_survives_stores_that_evict_around_it_and_its_running_row_is_unaffected(one_thread):
    model = random_lm()
    prefix = pool(model, blocks=3)
    engine = model.new_cache(2)  # row 0: the running request; row 1: where other requests are prefilled
    a = tokens(9, seed=10)
    prefill(model, engine, 1, a)
    prefix.store(a, engine, 1, len(a))
    kept = [b.kv.clone() for b in prefix.lookup(a).blocks]  # a probe hit, released at once
    prefix.release(prefix.lookup(a))

    running = a[:8] + tokens(5, seed=11)
    hit = prefix.lookup(running)
    assert hit.length == 8
    prefix.load(hit, engine, 0)
    prefill(model, engine, 0, running[:10], hit.length)  # the running request is mid-prefill

    for seed in range(12, 16):  # other requests come and go; only one block is free for them
        other = tokens(9, seed=seed)
        prefill(model, engine, 1, other)
        assert prefix.store(other, engine, 1, len(other)) == 1  # its second block finds everything pinned
        assert prefix.stats.bytes_used <= prefix.budget_bytes and len(prefix) <= 3
        prefix.release(prefix.lookup(other))
    assert prefix.stats.evictions == 3

    for block, data in zip(hit.blocks, kept):
        assert torch.equal(block.kv, data)
    probe = prefix.lookup(running)
    assert probe.length == 8 and probe.blocks == hit.blocks
    prefix.release(probe)
    assert_same_logits(prefill(model, engine, 0, running, 10), full_logits(model, running))


def test_a_released_request_frees_its_blocks_for_eviction_within_the_budget(one_thread):
    model = random_lm()
    prefix = pool(model, blocks=3)
    cache = model.new_cache(1)
    a = tokens(13, seed=20)
    prefill(model, cache, 0, a)
    prefix.store(a, cache, 0, len(a))
    hit = prefix.lookup(a)  # pins all three blocks: the pool is full of pinned blocks
    b = tokens(9, seed=21)
    prefill(model, cache, 0, b)
    assert prefix.store(b, cache, 0, len(b)) == 0
    prefix.release(hit)  # cancelled
    assert prefix.store(b, cache, 0, len(b)) == 2
    assert prefix.stats.bytes_used == 3 * prefix.block_bytes <= prefix.budget_bytes
    assert prefix.stats.evictions == 2
    assert prefix.lookup(a).length == BS  # leaf first: a's last two blocks went, its first block stays


def test_eviction_takes_the_least_recently_used_block(one_thread):
    model = random_lm()
    prefix = pool(model, blocks=3)
    cache = model.new_cache(1)
    x, y, z, w = (tokens(BS + 1, seed=s) for s in (30, 31, 32, 33))
    for p in (x, y, z):
        prefill(model, cache, 0, p)
        prefix.store(p, cache, 0, len(p))
    prefix.release(prefix.lookup(x))  # x is now the most recently used; y the least
    prefill(model, cache, 0, y)
    prefix.store(y, cache, 0, len(y))  # storing blocks already there marks them used too: z is the least now
    prefill(model, cache, 0, w)
    prefix.store(w, cache, 0, len(w))
    assert [prefix.lookup(p).length for p in (x, y, z, w)] == [BS, BS, 0, BS]


def test_double_release_is_a_no_op_and_keeps_other_hits_pinned(one_thread):
    model = random_lm()
    prefix = pool(model, blocks=1)
    cache = model.new_cache(1)
    a, b = tokens(BS + 1, seed=40), tokens(BS + 1, seed=41)
    prefill(model, cache, 0, a)
    prefix.store(a, cache, 0, len(a))
    first, second = prefix.lookup(a), prefix.lookup(a)
    prefix.release(first)
    prefix.release(first)  # must not take away the second hit's pin
    prefill(model, cache, 0, b)
    assert prefix.store(b, cache, 0, len(b)) == 0
    prefix.release(second)
    assert prefix.store(b, cache, 0, len(b)) == 1
    assert prefix.lookup(a).length == 0


def test_a_budget_below_one_block_stores_nothing(one_thread):
    model = random_lm()
    prefix = PrefixCache(model.cfg, block_size=BS, budget_bytes=pool(model).block_bytes - 1)
    cache = model.new_cache(1)
    a = tokens(9, seed=50)
    prefill(model, cache, 0, a)
    assert prefix.store(a, cache, 0, len(a)) == 0 and prefix.stats.bytes_used == 0


def test_a_released_hit_cannot_be_loaded_and_bad_sizes_are_refused(one_thread):
    model = random_lm()
    prefix = pool(model)
    cache = model.new_cache(1)
    a = tokens(9, seed=55)
    prefill(model, cache, 0, a)
    prefix.store(a, cache, 0, len(a))
    hit = prefix.lookup(a)
    prefix.release(hit)
    with pytest.raises(ValueError, match="released"):
        prefix.load(hit, cache, 0)
    with pytest.raises(ConfigError, match="block_size"):
        PrefixCache(model.cfg, block_size=0, budget_bytes=1 << 20)
    with pytest.raises(ConfigError, match="budget_bytes"):
        PrefixCache(model.cfg, budget_bytes=-1)


def test_stats_and_clear(one_thread):
    model = random_lm()
    prefix = pool(model)
    cache = model.new_cache(1)
    a = tokens(10, seed=60)
    prefill(model, cache, 0, a)
    prefix.store(a, cache, 0, len(a))
    prefix.release(prefix.lookup(a))
    prefix.release(prefix.lookup(tokens(10, seed=61)))
    s = prefix.stats
    assert (s.hits, s.misses, s.tokens_reused, s.blocks_stored, s.evictions) == (1, 1, 8, 2, 0)
    assert s.bytes_used == 2 * prefix.block_bytes
    prefix.clear()
    assert len(prefix) == 0 and prefix.lookup(a).length == 0 and prefix.stats.bytes_used == 0


# ------------------------------------------------------------------ when it applies


def test_rolling_sliding_window_caches_are_not_served_but_mask_only_windows_are(one_thread):
    model = random_lm(sliding_window=6)
    prefix = pool(model)
    assert not prefix.enabled_for(model.new_cache(1))  # rings of 6 slots: slot p mod 6, not p
    cache = model.new_cache(2, rolling=False)
    assert prefix.enabled_for(cache)
    a = tokens(14, seed=70)
    b = a[:12] + tokens(5, seed=71)
    prefill(model, cache, 0, a)
    prefix.store(a, cache, 0, len(a))
    hit = prefix.lookup(b)
    prefix.load(hit, cache, 1)
    assert hit.length == 12
    assert_same_logits(prefill(model, cache, 1, b, hit.length), full_logits(model, b))
    with pytest.raises(ValueError, match="rolling"):
        prefix.store(a, model.new_cache(1), 0, len(a))
