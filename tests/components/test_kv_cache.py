"""The KV cache object: rollback (``truncate``) leaves a cache indistinguishable from one that never saw the
removed tokens, for full-length layers (dense and GQA), sliding-window rings and rows of different lengths;
row calls of several tokens equal block calls."""

from __future__ import annotations

import pytest
import torch

from tinyformer.config import ModelConfig
from tinyformer.errors import GenerationError
from tinyformer.models.decoder import DecoderLM

BASE = dict(vocab_size=50, d_model=32, n_layer=2, n_head=4, max_seq_len=48)
CONFIGS = {
    "dense": ModelConfig(**BASE, n_kv_head=4),
    "gqa": ModelConfig(**BASE, n_kv_head=2),
    "ring": ModelConfig(**BASE, n_kv_head=2, sliding_window=5),
    "ring-mixed": ModelConfig(**BASE, n_kv_head=2, sliding_window=5, layer_types=["sliding", "full"]),
}


def model_of(name: str, dtype: torch.dtype = torch.float32) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(CONFIGS[name]).eval().to(dtype)


def decode(model: DecoderLM, cache, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Feed tokens (B, n) one step at a time: the logits of each step."""
    return [model(tokens[:, i : i + 1], cache=cache)[:, -1] for i in range(tokens.shape[1])]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("accepted", [0, 2])
@torch.no_grad()
def test_truncated_cache_equals_one_that_never_saw_the_rejected_tokens(name, accepted):
    model = model_of(name)
    spare = 2  # a ring of W + 2 slots rolls back up to 3 tokens
    prompt, draft, after = (torch.randint(0, 50, (2, n)) for n in (12, 3, 6))
    seen = model.new_cache(2, 40, spare_slots=spare)
    never = model.new_cache(2, 40, spare_slots=spare)
    for cache in (seen, never):
        model(prompt, cache=cache)
    decode(model, seen, draft)  # the draft: 3 tokens, of which ``accepted`` are kept
    seen.truncate(12 + accepted)
    decode(model, never, draft[:, :accepted])
    assert seen.length == never.length == 12 + accepted
    for layer, ((k1, v1), (k2, v2)) in enumerate(zip(seen.layers, never.layers)):
        if not seen.rolling[layer]:  # a full-length layer: bitwise the same buffers
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
    # the outputs from here on are bitwise those of the cache that never saw the draft, also through rings
    for a, b in zip(decode(model, seen, after), decode(model, never, after)):
        assert torch.equal(a, b)


@torch.no_grad()
def test_truncate_zeroes_what_it_forgets_and_the_check_can_fail():
    """The bitwise comparison above means something: without the zeroing the rolled-back keys stay."""
    model = model_of("dense")
    cache = model.new_cache(1, 20)
    model(torch.randint(0, 50, (1, 8)), cache=cache)
    before = cache.layers[0][0][:, :, 5:8].clone()
    assert before.abs().sum() > 0
    cache.truncate(5)
    assert cache.layers[0][0][:, :, 5:].abs().sum() == 0 and cache.length == 5


@torch.no_grad()
def test_a_ring_refuses_to_roll_back_beyond_its_spare_slots():
    model = model_of("ring")
    cache = model.new_cache(1, 40, spare_slots=1)  # W + 1 slots: at most 2 tokens back
    model(torch.randint(0, 50, (1, 20)), cache=cache)
    with pytest.raises(GenerationError, match="roll back 2 tokens at most, not 3"):
        cache.truncate(17)
    cache.truncate(18)  # within the bound
    assert cache.length == 18


@torch.no_grad()
def test_truncate_checks_its_lengths():
    model = model_of("dense")
    cache = model.new_cache(2, 20)
    model(torch.randint(0, 50, (2, 4)), cache=cache)
    with pytest.raises(GenerationError, match="cannot be truncated to 5"):
        cache.truncate(5)
    with pytest.raises(ValueError, match="truncate needs 2 lengths"):
        cache.truncate([1, 2, 3])


@pytest.mark.parametrize("name", ["gqa", "ring"])
@torch.no_grad()
def test_rows_truncated_to_different_lengths_decode_like_rows_that_never_saw_the_rest(name):
    """Per-row rollback: each row keeps its own number of draft tokens, then the rows decode together at
    their own positions (``cache.at``), as rows that were fed only what they kept (each on its own)."""
    model = model_of(name, torch.float64)
    prompt, draft, nxt = torch.randint(0, 50, (3, 10)), torch.randint(0, 50, (3, 3)), torch.randint(0, 50, (3, 1))
    kept = [0, 1, 3]
    cache = model.new_cache(3, 30, spare_slots=2)
    model(prompt, cache=cache)
    decode(model, cache, draft)
    lengths = [10 + n for n in kept]
    cache.truncate(lengths)
    assert cache.length is None  # rows at different lengths: block calls are refused, row calls go on
    with pytest.raises(GenerationError, match="different lengths"):
        model(nxt, cache=cache)
    for layer, (k, _) in enumerate(cache.layers):
        if not cache.rolling[layer]:  # forgotten positions are zero again, as never written
            assert all(k[b, :, n:].abs().sum() == 0 and k[b, :, n - 1].abs().sum() > 0 for b, n in enumerate(lengths))
    step = model(nxt, cache=cache.at(torch.tensor(lengths)))[:, -1]
    for b, n in enumerate(kept):
        alone = model.new_cache(1, 30, spare_slots=2)
        model(prompt[b : b + 1], cache=alone)
        decode(model, alone, draft[b : b + 1, :n])
        want = model(nxt[b : b + 1], cache=alone)[:, -1]
        torch.testing.assert_close(step[b : b + 1], want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["gqa", "ring-mixed"])
@torch.no_grad()
def test_a_row_call_of_several_tokens_equals_a_block_call(name):
    """cache.at(positions) with T > 1 (speculative verification of rows at their own lengths) computes what a
    block call at the same positions does; a ring needs W + T - 1 slots for it."""
    model = model_of(name, torch.float64)
    prompt, block = torch.randint(0, 50, (2, 9)), torch.randint(0, 50, (2, 3))
    rows, whole = model.new_cache(2, 30, spare_slots=2), model.new_cache(2, 30, spare_slots=2)
    for cache in (rows, whole):
        model(prompt, cache=cache)
    got = model(block, cache=rows.at(torch.tensor([9, 9])))
    want = model(block, cache=whole)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    if "ring" in name:
        small = model.new_cache(2, 30)  # W slots: one token per row and call at most
        model(prompt, cache=small)
        with pytest.raises(GenerationError, match="at most 1 tokens per row"):
            model(block, cache=small.at(torch.tensor([9, 9])))


@pytest.mark.parametrize("name", ["gqa", "ring"])
@torch.no_grad()
def test_rows_of_an_engine_cache_roll_back_from_their_own_lengths(name):
    """Rows prefilled into their slots at different lengths (as the engine does) step together, then roll back
    one token each from the lengths the caller keeps (``old``): the next step is bitwise that of a cache that
    never took the rolled-back step."""
    model = model_of(name)
    prompts = [torch.randint(0, 50, (1, n)) for n in (9, 4, 7)]
    caches = model.new_cache(3, 30, spare_slots=1), model.new_cache(3, 30, spare_slots=1)
    for cache in caches:
        for b, p in enumerate(prompts):
            model(p, cache=cache.row_view(b))
    lengths = torch.tensor([p.shape[1] for p in prompts])
    rolled, never = caches
    model(torch.randint(0, 50, (3, 1)), cache=rolled.at(lengths))
    rolled.truncate(lengths.tolist(), old=(lengths + 1).tolist())
    nxt = torch.randint(0, 50, (3, 1))
    assert torch.equal(model(nxt, cache=rolled.at(lengths)), model(nxt, cache=never.at(lengths)))
    for layer, ((k1, v1), (k2, v2)) in enumerate(zip(rolled.layers, never.layers)):
        if not rolled.rolling[layer]:
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
