"""Speculative decoding against independent references: plain greedy decoding (token for token), the exact
target distribution computed by full forwards in float64 (chi-square), and a cache that never saw the
rejected tokens."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from test_engine import random_lm as engine_random_lm

from tinyformer.components.quantized import QuantSpec
from tinyformer.data.tokenizer import build_tokenizer
from tinyformer.errors import GenerationError
from tinyformer.generation import engine as engine_module
from tinyformer.generation.engine import BatchEngine, EngineRow
from tinyformer.generation.generator import Generator
from tinyformer.generation.sampling import SamplingParams
from tinyformer.generation.speculative import NgramIndex, RowDrafts, SpeculativeConfig, accept_sampled
from tinyformer.generation.streaming import TextState
from tinyformer.models.decoder import DecoderLM
from tinyformer.quantization import quantize_run
from tinyformer.run_folder import load_model, save_model

pytestmark = pytest.mark.usefixtures("one_thread")

# prompts of different lengths that repeat themselves, so prompt lookup finds drafts
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [3, 4, 5], [20, 21, 22, 23, 24, 20, 21, 22, 1, 2, 20, 21]]
SHAPES = {
    "dense": {},
    "gqa": dict(n_head=4, n_kv_head=1),
    "sliding-window": dict(sliding_window=5),
    "moe": dict(ffn="moe", n_experts=4, experts_per_token=2),
}


def random_lm(vocab: int = 40, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides) -> DecoderLM:
    """test_engine's peaked random decoder, with room for prompts, drafts and their verification."""
    return engine_random_lm(vocab, dtype, seed, **{"max_seq_len": 96, **overrides})


def ids_generator(model: DecoderLM, **kwargs) -> Generator:
    gen = Generator(model, **kwargs)
    gen.eos_token_id = None  # every row runs max_new_tokens
    return gen


def plain_and_speculative(model, prompts, params, **spec_kwargs):
    plain = [r.token_ids for r in ids_generator(model).generate(prompts, params)]
    gen = ids_generator(model, **spec_kwargs)
    return plain, [r.token_ids for r in gen.generate(prompts, params)], gen.timings


# ------------------------------------------------------------------ prompt lookup


def test_prompt_lookup_takes_the_latest_earlier_occurrence_of_the_longest_suffix():
    idx = NgramIndex(3)
    idx.extend([1, 2, 3, 9, 1, 2, 3, 7, 8, 4, 2, 3])
    # suffix (4, 2, 3) never occurred before; (2, 3) did, latest at index 5, followed by 7, 8, 4
    assert idx.propose(3) == [7, 8, 4]
    idx.extend([1, 2, 3, 9, 1, 2, 3, 7, 8, 4, 2, 3, 7])
    assert idx.propose(2) == [8, 4]  # (2, 3, 7) at index 5
    idx.extend([1, 2, 3, 9, 1, 2, 3, 7, 8, 4, 2, 3, 7, 5])
    assert idx.propose(4) == []  # 5 never occurred before


def test_prompt_lookup_with_a_minimum_match_ignores_shorter_suffixes():
    idx = NgramIndex(3, min_n=2)
    idx.extend([1, 2, 3, 9, 4, 2])
    assert idx.propose(3) == []  # only the last token (2) occurred before
    idx.extend([1, 2, 3, 9, 4, 2, 3])
    assert idx.propose(3) == [9, 4, 2]  # (2, 3) at index 1
    assert NgramIndex(3).propose(3) == [] and NgramIndex(3, min_n=1).min_n == 1


def test_draft_length_grows_by_two_after_full_acceptance_and_shrinks_by_one_otherwise():
    state = RowDrafts(SpeculativeConfig("ngram", draft_tokens=6))
    ks = []
    for kept in (0, 0, 1, 4, 2, 3):  # of the k proposed
        k = state.budget(100)
        ks.append(k)
        state.record(k, min(kept, k))
    # k: 6 (none kept) -> 5 (none) -> 4 (1 of 4) -> 3 (all 3) -> 5 (2 of 5) -> 4 (3 of 4) -> 3
    assert ks == [6, 5, 4, 3, 5, 4] and state.k == 3
    assert (state.proposed, state.accepted) == (27, 0 + 0 + 1 + 3 + 2 + 3)


def test_a_rejected_single_draft_pauses_proposals_for_doubling_steps_until_all_are_kept():
    state = RowDrafts(SpeculativeConfig("ngram", draft_tokens=1))
    budgets = []
    for _ in range(16):
        k = state.budget(100)
        budgets.append(k)
        if k:
            state.record(1, 0)
    # rejected at steps 0, 2, 5, 10: pauses of 1, 2, 4 steps, then 8
    assert budgets == [1, 0, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    for _ in range(8):
        state.budget(100)
    assert state.budget(100) == 1
    state.record(1, 1)  # kept: the pauses start again at 1
    state.record(1, 0)
    assert [state.budget(100) for _ in range(2)] == [0, 1]
    fixed = RowDrafts(SpeculativeConfig("ngram", draft_tokens=4, adaptive=False))
    fixed.record(4, 0)
    assert fixed.budget(100) == 4


# ------------------------------------------------------------------ greedy: token for token


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_greedy_equals_plain_greedy_on_a_batch_of_different_lengths(shape, method):
    model = random_lm(**SHAPES[shape])
    params = SamplingParams(temperature=0, max_new_tokens=40)
    kwargs = {"speculative": SpeculativeConfig(method, draft_tokens=4)}
    if method == "draft":  # another random model with the same vocabulary: some drafts right, most wrong
        kwargs["draft_model"] = random_lm(seed=1, **SHAPES[shape])
    plain, spec, timings = plain_and_speculative(model, PROMPTS, params, **kwargs)
    assert spec == plain
    assert timings.draft_proposed > 0


def test_a_draft_model_equal_to_the_model_has_every_draft_accepted():
    model = random_lm()
    params = SamplingParams(temperature=0, max_new_tokens=30)
    plain, spec, timings = plain_and_speculative(model, PROMPTS, params,
                                                 speculative=SpeculativeConfig("draft", draft_tokens=5),
                                                 draft_model=random_lm())
    assert spec == plain
    assert timings.draft_accepted == timings.draft_proposed > 0


def test_sampled_logprobs_with_speculative_decoding_is_refused_not_answered_with_raw_ones():
    # a verification records the raw log-probabilities; sampled_logprobs asks for the processed ones
    gen = ids_generator(random_lm(), speculative=SpeculativeConfig("ngram", draft_tokens=4))
    with pytest.raises(GenerationError, match="sampled_logprobs is not supported with speculative decoding"):
        gen.generate(PROMPTS, SamplingParams(temperature=0.7, max_new_tokens=4), sampled_logprobs=True)


def test_speculative_greedy_with_penalties_equals_plain_greedy():
    # the target's argmax at each draft position must see the drafts before it in the penalty history
    model = random_lm()
    params = SamplingParams(temperature=0, max_new_tokens=40, repetition_penalty=1.3, frequency_penalty=0.5)
    plain, spec, timings = plain_and_speculative(model, PROMPTS, params,
                                                 speculative=SpeculativeConfig("ngram", draft_tokens=4))
    assert spec == plain and timings.draft_proposed > 0


def test_speculative_greedy_equals_plain_greedy_on_an_int8_model(tmp_path):
    src = tmp_path / "float"
    save_model(src, random_lm(dtype=torch.float32))
    build_tokenizer("char", "".join(chr(65 + i) for i in range(40))).save(src / "tokenizer.json")
    quantize_run(src, tmp_path / "int8", QuantSpec("int8", 0, "aten"))
    model = load_model(tmp_path / "int8").eval()
    params = SamplingParams(temperature=0, max_new_tokens=40)
    plain, spec, timings = plain_and_speculative(model, PROMPTS, params,
                                                 speculative=SpeculativeConfig("ngram", draft_tokens=4))
    assert spec == plain and timings.draft_proposed > 0


def kernel_products(model_kind: str, tmp_path) -> DecoderLM:
    """A float32 random decoder whose products are the CPU kernels' (f32_linear, or int8 act8), which compute
    each row of a product as that row alone; skips where the kernels cannot be built."""
    from tinyformer.components import quant_kernels
    from tinyformer.generation.weight_layout import prepare_for_decoding

    if quant_kernels._compiler() is None or not quant_kernels.available():
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")
    shape = dict(d_model=64, n_head=4, n_kv_head=2, d_ff=128, max_seq_len=96)
    if model_kind == "sliding-window":
        shape["sliding_window"] = 6
    model = random_lm(dtype=torch.float32, **shape)
    if model_kind == "int8 act8":
        if not (quant_kernels.has_vnni() or quant_kernels.has_avx2()):
            pytest.skip("this CPU has no integer dot products (AVX2 or VNNI) for the act8 kernel")
        save_model(tmp_path / "float", model)
        quantize_run(tmp_path / "float", tmp_path / "int8", QuantSpec("int8", 0, "cpp_act8"))
        return load_model(tmp_path / "int8").eval()
    prepare_for_decoding(model, min_bytes=0)  # every linear layer on f32_linear
    return model


@pytest.mark.parametrize("model_kind", ["float32", "sliding-window", "int8 act8"])
def test_a_verification_gives_every_position_the_logits_of_a_one_token_step_bit_for_bit(model_kind, tmp_path):
    """A verification over T = 5 tokens (``cache.at(..., per_query=True)``, as the engine's eager one) and five
    one-token steps from the same cache give equal logits and equal caches, bit for bit: each query attends as
    its own step would, and the kernels' products are row-independent. (SDPA over five queries at once, or
    over more keys than the step's, rounds differently; an int8 act8 model turned such 1e-7 differences into
    logits 0.6 apart on SmolLM2-135M, enough to change greedy output at a near tie.)"""
    model = kernel_products(model_kind, tmp_path)
    g = torch.Generator().manual_seed(5)
    prefix, new = torch.randint(0, 40, (1, 30), generator=g), torch.randint(0, 40, (1, 5), generator=g)
    with torch.inference_mode():
        cache = model.new_cache(1, 64, spare_slots=4)
        model(prefix, cache=cache)
        stepped, verified = copy.deepcopy(cache), copy.deepcopy(cache)
        steps = torch.cat([model(new[:, i : i + 1], cache=stepped.at(torch.tensor([30 + i]), per_query=True))[:, -1]
                           for i in range(5)])
        together = model(new, cache=verified.at(torch.tensor([30]), per_query=True))[0]
    assert torch.equal(together, steps)
    for (k1, v1), (k2, v2) in zip(stepped.layers, verified.layers):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_speculative_greedy_reports_the_plain_log_probabilities_bit_for_bit(tmp_path):
    """On the CPU kernels a verified token's log-probability is the one plain decoding reports for it: the same
    logits (each query attends alone) through the same formula (``sampling.log_probs``; torch.log_softmax
    differs from logits - logsumexp by up to 1e-5 over a large vocabulary). One prompt at a time: the float32
    kernel takes up to 8 rows (more go to MKL's GEMM, whose row sums depend on the row count)."""
    model = kernel_products("float32", tmp_path)
    params = SamplingParams(temperature=0, max_new_tokens=30)
    for prompt in PROMPTS:
        plain = ids_generator(model).generate([prompt], params)[0]
        gen = ids_generator(model, speculative=SpeculativeConfig("ngram", draft_tokens=4, min_ngram=1))
        spec = gen.generate([prompt], params)[0]
        assert gen.timings.draft_accepted > 0
        assert spec.token_ids == plain.token_ids and spec.logprobs == plain.logprobs


def test_speculative_rows_and_plain_rows_share_an_engine_and_each_equals_plain_greedy():
    """Continuous batching: rows join at different steps, some speculate and some do not."""
    model = random_lm(sliding_window=6)
    params = SamplingParams(temperature=0, max_new_tokens=25)
    ref = [r.token_ids for r in ids_generator(model).generate(PROMPTS, params)]
    engine = BatchEngine(model, max_batch=3, max_len=64, max_draft_tokens=4)
    # min_ngram=1: this random model's output repeats no two-token run, so the default would verify nothing
    spec = SpeculativeConfig("ngram", 4, min_ngram=1)
    rows = [EngineRow(p, params, TextState(lambda i: b"x", frozenset(), ()),
                      speculative=spec if i != 1 else None) for i, p in enumerate(PROMPTS)]
    with torch.inference_mode():
        engine.add(rows[0])
        for step in itertools.count():
            if step == 3:
                engine.add(rows[1])
            if step == 5:
                engine.add(rows[2])
            engine.step()
            for r in list(engine.rows):
                if r.finished:
                    engine.remove(r)
            if not engine.rows and step > 5:
                break
    assert [r.token_ids for r in rows] == ref
    assert rows[0].drafts.proposed > 0 and rows[1].drafts is None


@pytest.mark.slow
def test_the_packaged_verification_equals_plain_greedy_and_later_generators_load_it(monkeypatch, tmp_path):
    """With the packaged decode step (a CPU's compiled step) the verification over 2 .. K + 1 positions is a
    package too: greedy output stays token for token plain greedy's (rejections, rollbacks and every draft
    length included), and a second generator loads both packages without building. fp32: an int8
    ``cpp_act8`` model's verification logits may differ from a one-position step's (activation rounding)."""
    from tinyformer.generation.compile_cache import PackagedStep

    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path))
    model = random_lm(dtype=torch.float32, n_layer=1)
    draft = copy.deepcopy(model)  # a close draft: about half of its drafts are kept
    torch.manual_seed(5)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn_like(p))
    calls: list[int] = []  # the tokens per row of each packaged verification
    run = PackagedStep._run
    monkeypatch.setattr(PackagedStep, "_run", staticmethod(
        lambda fn, tokens, *a: (calls.append(tokens.shape[1]), run(fn, tokens, *a))[1]))
    params = SamplingParams(temperature=0, max_new_tokens=40)
    prompt = PROMPTS[1:2]
    want = [r.token_ids for r in ids_generator(model).generate(prompt, params, logprobs=False)]
    spec = {"speculative": SpeculativeConfig("draft", draft_tokens=4), "draft_model": draft}
    first = ids_generator(model, compile=True, **spec)
    assert [r.token_ids for r in first.generate(prompt, params, logprobs=False)] == want
    assert first.timings.draft_proposed > first.timings.draft_accepted > 0
    assert len(first._compiled.built) == 2  # the one-position step and the verification
    assert {n for n in calls if n > 1} == {2, 3, 4, 5}  # one package for every draft length
    second = ids_generator(model, compile=True, **spec)
    calls.clear()
    assert [r.token_ids for r in second.generate(prompt, params, logprobs=False)] == want
    assert second._compiled.built == [] and max(calls) == 5


@pytest.mark.slow
def test_the_packaged_verification_of_an_int8_act8_model_gives_each_position_the_packaged_steps_logits(tmp_path):
    """The packages of an int8 ``cpp_act8`` model: a verification over T = 5 tokens and five one-token steps
    from the same cache give equal logits, bit for bit. Both run ``row_attention`` (each query summed alone)
    and read the token table through the C++ ``act8_embedding`` (inductor fused the packed table's gather into
    the first norm and summed it over the tokens' lanes in the T-token graph only: 1e-6 apart, which act8's
    8-bit rounding turned into a different greedy continuation of SmolLM2-135M from the command line)."""
    from tinyformer.generation.compile_cache import PackageBuild, PackagedStep

    model = kernel_products("int8 act8", tmp_path)
    step = PackagedStep(model, tmp_path / "packages", PackageBuild())
    g = torch.Generator().manual_seed(5)
    prefix, new = torch.randint(0, 40, (1, 30), generator=g), torch.randint(0, 40, (1, 5), generator=g)
    with torch.no_grad():  # export cannot trace inference tensors
        cache = model.new_cache(1, 64, spare_slots=4)
        model(prefix, cache=cache)
        stepped, verified = copy.deepcopy(cache), copy.deepcopy(cache)
        one = step.get(False)
        steps = torch.cat([one(new[:, i : i + 1], torch.tensor([30 + i]), stepped, torch.empty(31 + i))
                           for i in range(5)])
        verify = step.verifier(5, 1, verified)
        assert verify is not None  # the verification exported and compiled
        together = verify(new, torch.tensor([30]), verified, torch.empty(35))[0]
    assert len(step.built) == 2
    assert torch.equal(together, steps)


def test_warm_up_also_prepares_each_buckets_verification_when_rows_may_speculate():
    """A server's warm-up compiles every bucket's step up front; with speculation, its verification too."""
    asked: list[tuple] = []

    class Step(engine_module.CompiledStep):
        def get(self, ids_only):
            return lambda tokens, *a: asked.append(("step", tokens.shape[0], ids_only))

        def verifier(self, positions, rows, cache):
            asked.append(("verify", rows, positions))

    model = random_lm(n_layer=1)
    BatchEngine(model, max_batch=4, max_len=32, compiled=Step(model), buckets=True, max_draft_tokens=3).warm_up()
    assert [a for a in asked if a[0] == "verify"] == [("verify", 1, 4), ("verify", 2, 4), ("verify", 4, 4)]
    asked.clear()
    BatchEngine(model, max_batch=4, max_len=32, compiled=Step(model), buckets=True).warm_up()
    assert asked and all(a[0] == "step" for a in asked)


# ------------------------------------------------------------------ the cache after rollback


def test_cache_after_rollback_equals_a_cache_that_never_saw_the_rejected_tokens():
    model = random_lm(n_layer=1)
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=0, max_new_tokens=20)
    engine = BatchEngine(model, max_batch=1, max_len=48, max_draft_tokens=4)
    row = EngineRow(prompt, params, TextState(lambda i: b"x", frozenset(), ()),
                    speculative=SpeculativeConfig("draft", 4), want_logprobs=False)
    engine.draft = engine_module.DraftModel(random_lm(n_layer=1, seed=3), 1, 48, 4)  # a poor draft: rejections
    with torch.inference_mode():
        engine.add(row)
        while not row.finished:
            engine.step()
        assert row.drafts.proposed > row.drafts.accepted > 0
        # a cache that only ever saw the kept tokens: one prefill of prompt + output (but the last token,
        # which was never fed)
        ref = model.new_cache(1, 48)
        model(torch.tensor([prompt + row.token_ids[:-1]]), cache=ref)
    n = row.pos
    assert n == len(prompt) + len(row.token_ids) - 1
    for (k, v), (rk, rv) in zip(engine.cache.layers, ref.layers):
        assert torch.equal(k[0, :, n:], rk[0, :, n:]) and torch.equal(v[0, :, n:], rv[0, :, n:])  # zeros
        torch.testing.assert_close(k[0, :, :n], rk[0, :, :n], rtol=0, atol=1e-12)
        torch.testing.assert_close(v[0, :, :n], rv[0, :, :n], rtol=0, atol=1e-12)


# ------------------------------------------------------------------ sampling: the target's distribution


V_SMALL = 6
SAMPLED_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


def target_distribution(model: DecoderLM, prompt: list[int], temperature: float) -> torch.Tensor:
    """p(y2, y3) of the 2nd and 3rd sampled tokens, by one full forward in float64 over every (y1, y2, y3):
    sum_y1 p(y1) p(y2 | y1) p(y3 | y1 y2) with p = softmax(logits / temperature)."""
    seqs = torch.tensor([prompt + list(ys) for ys in itertools.product(range(V_SMALL), repeat=3)])
    with torch.no_grad():
        p = torch.softmax(model(seqs)[:, len(prompt) - 1 :].double() / temperature, -1)  # (V^3, 4, V)
    y = seqs[:, len(prompt) :]
    prob = p[:, 0].gather(1, y[:, :1]) * p[:, 1].gather(1, y[:, 1:2]) * p[:, 2].gather(1, y[:, 2:3])  # (V^3, 1)
    return prob.view(V_SMALL, V_SMALL * V_SMALL).sum(0)  # marginalise y1


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of ``counts`` against ``probs``, cells with expectation < 5 pooled;
    survival function of chi2(k - 1) = Q((k - 1) / 2, x / 2), the regularised upper incomplete gamma."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    x = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def sampled_counts(model, method: str, n: int, draft=None) -> torch.Tensor:
    gen = ids_generator(model, speculative=SpeculativeConfig(method, draft_tokens=2), draft_model=draft)
    params = SamplingParams(temperature=0.9, max_new_tokens=3, seed=1234)
    results = gen.generate([SAMPLED_PROMPT] * n, params, logprobs=False)
    assert gen.timings.draft_proposed > 0
    cells = torch.tensor([r.token_ids[1] * V_SMALL + r.token_ids[2] for r in results])
    return torch.bincount(cells, minlength=V_SMALL * V_SMALL)


@pytest.fixture(scope="module")
def small_models():
    torch.manual_seed(0)
    model = random_lm(vocab=V_SMALL, d_model=16, n_head=2, n_kv_head=1, d_ff=32)
    draft = random_lm(vocab=V_SMALL, d_model=16, n_head=2, n_kv_head=1, d_ff=32, seed=5)
    with torch.no_grad():  # flatter distributions: every cell has mass, and drafts are often rejected
        model.lm_head.weight.mul_(0.4)
        draft.lm_head.weight.mul_(0.4)
    return model, draft, target_distribution(model, SAMPLED_PROMPT, 0.9)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_tokens_follow_the_target_distribution(small_models, method):
    model, draft, probs = small_models
    counts = sampled_counts(model, method, 3000 if method == "ngram" else 1500, draft if method == "draft" else None)
    assert chi_square_p_value(counts, probs) > 1e-3


def test_the_same_test_rejects_an_always_accept_rule(small_models, monkeypatch):
    model, _, probs = small_models

    def always_accept(x, drafts, q, generator):
        m = len(drafts)
        return m, accept_sampled(x[m:], [], None, generator)[1]

    monkeypatch.setattr(engine_module, "accept_sampled", always_accept)
    counts = sampled_counts(model, "ngram", 3000)
    assert chi_square_p_value(counts, probs) < 1e-6


def test_accept_sampled_keeps_a_point_mass_draft_with_probability_p():
    """One draft d with q = delta(d): P(keep) = p(d); the emitted token is distributed as p either way."""
    x = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64))
    gen = torch.Generator().manual_seed(0)
    kept, first = 0, torch.zeros(3)
    n = 5000
    for _ in range(n):
        m, y = accept_sampled(x, [1], None, gen)
        kept += m
        first[1 if m else y] += 1
    assert abs(kept / n - 0.3) < 4 * math.sqrt(0.3 * 0.7 / n)
    assert chi_square_p_value(first, torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)) > 1e-3


# ------------------------------------------------------------------ bad input


def test_a_draft_model_whose_tokenizer_differs_is_one_clear_error():
    tok = build_tokenizer("char", "abcdefghij")
    other = build_tokenizer("char", "abcdefghiz")
    model, draft = random_lm(vocab=tok.vocab_size), random_lm(vocab=tok.vocab_size, seed=2)
    with pytest.raises(GenerationError, match="draft model's tokenizer differs") as err:
        Generator(model, tok, speculative=SpeculativeConfig("draft"), draft_model=draft, draft_tokenizer=other)
    assert "\n" not in str(err.value)
    with pytest.raises(GenerationError, match="vocabulary has 12 tokens"):
        Generator(model, tok, speculative=SpeculativeConfig("draft"), draft_model=random_lm(vocab=12),
                  draft_tokenizer=tok)


@pytest.mark.parametrize("k", [0, -1, 65])
def test_draft_tokens_outside_the_range_are_refused(k):
    with pytest.raises(GenerationError, match="draft tokens must be an integer in"):
        SpeculativeConfig("ngram", draft_tokens=k).validate()


@pytest.mark.parametrize("n", [0, 4, True])
def test_a_min_ngram_outside_one_to_max_ngram_is_refused(n):
    with pytest.raises(GenerationError, match="min ngram must be an integer in"):
        SpeculativeConfig("ngram", max_ngram=3, min_ngram=n).validate()


def test_speculative_beam_search_is_refused():
    gen = ids_generator(random_lm(), speculative=SpeculativeConfig("ngram"))
    with pytest.raises(GenerationError, match="does not apply to beam search"):
        gen.beam_search([1, 2, 3], num_beams=2, max_new_tokens=4)
