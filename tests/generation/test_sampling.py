"""Tests for tinyformer.generation.sampling: formulas, distributions, validation, HF parity."""

from __future__ import annotations

import dataclasses
import math
from statistics import NormalDist

import pytest
import torch

from tinyformer.errors import GenerationError
from tinyformer.generation.constraint import Grammar
from tinyformer.generation.sampling import (
    FrequencyPenalty,
    MinP,
    PresencePenalty,
    RepetitionPenalty,
    Sampler,
    SamplingParams,
    Temperature,
    TopK,
    TopP,
    build_processors,
    log_probs,
    make_generator,
    penalty_history,
    sample,
)

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# independent float64 references (plain Python, no code under test)
# ---------------------------------------------------------------------------------------------


def softmax64(xs: list[float]) -> list[float]:
    finite = [x for x in xs if x != NEG_INF]
    m = max(finite)
    e = [math.exp(x - m) if x != NEG_INF else 0.0 for x in xs]
    z = math.fsum(e)
    return [v / z for v in e]


def ref_distribution(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> list[float]:
    """Target distribution of a sampler step, by hand in float64: temperature, top-k, top-p, min-p."""
    x = [v / temperature for v in logits]
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    keep = set(order[:top_k] if top_k > 0 else order)
    if top_p < 1.0:
        probs = softmax64([x[i] if i in keep else NEG_INF for i in range(len(x))])
        cum, nucleus = 0.0, set()
        for i in order:
            if i not in keep:
                continue
            nucleus.add(i)
            cum += probs[i]
            if cum >= top_p:
                break
        keep = nucleus
    if min_p > 0.0:
        probs = softmax64([x[i] if i in keep else NEG_INF for i in range(len(x))])
        pmax = max(probs)
        keep = {i for i in keep if probs[i] >= min_p * pmax}
    return softmax64([x[i] if i in keep else NEG_INF for i in range(len(x))])


def chi2_quantile(df: int, q: float = 0.999) -> float:
    """Wilson–Hilferty approximation of the chi-square quantile."""
    z = NormalDist().inv_cdf(q)
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def test_chi2_quantile_approximation_is_accurate():
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 4, 7, 11, 30):
        exact = scipy_stats.chi2.ppf(0.999, df)
        # Wilson-Hilferty is a few percent off at df=1 and better above; good enough as a threshold.
        assert abs(chi2_quantile(df) - exact) / exact < 0.06, df


# ---------------------------------------------------------------------------------------------
# sampled frequencies
# ---------------------------------------------------------------------------------------------

N_DRAWS = 200_000


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [
        (1.0, 0, 1.0, 0.0),  # plain softmax
        (0.8, 5, 1.0, 0.0),  # top-k
        (1.3, 0, 0.7, 0.0),  # top-p
        (1.0, 8, 0.6, 0.0),  # fused top-k + top-p
        (1.0, 0, 1.0, 0.15),  # min-p
        (0.9, 10, 0.9, 0.05),  # everything
    ],
)
def test_sampled_frequencies_match_renormalised_distribution(temperature, top_k, top_p, min_p):
    g = torch.Generator().manual_seed(1234)
    vocab = 12
    logits = torch.randn(vocab, generator=g)
    expected = ref_distribution(logits.double().tolist(), temperature, top_k, top_p, min_p)
    kept = {i for i, q in enumerate(expected) if q > 0}
    assert 1 < len(kept) <= vocab

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=7)
    batch = logits.unsqueeze(0).expand(N_DRAWS, vocab)
    tokens, _ = sample(batch, params, None, make_generator(params))
    counts = torch.bincount(tokens, minlength=vocab).tolist()

    # Never outside the kept set.
    assert all(counts[i] == 0 for i in range(vocab) if i not in kept), counts
    # Pearson chi-square against the hand-computed renormalised distribution.
    stat = sum((counts[i] - N_DRAWS * expected[i]) ** 2 / (N_DRAWS * expected[i]) for i in kept)
    assert stat < chi2_quantile(len(kept) - 1), (stat, counts, expected)


def test_topk_topp_never_sample_outside_kept_set_random_rows():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4096, 40, generator=g) * 3
    for params in (SamplingParams(top_k=3), SamplingParams(top_p=0.5), SamplingParams(top_k=6, top_p=0.8)):
        tokens, _ = sample(logits, params, None, torch.Generator().manual_seed(0))
        for row, tok in zip(logits.double().tolist(), tokens.tolist()):
            ref = ref_distribution(row, 1.0, params.top_k, params.top_p, 0.0)
            assert ref[tok] > 0


# ---------------------------------------------------------------------------------------------
# individual processors vs their formulas
# ---------------------------------------------------------------------------------------------


def kept_mask(out: torch.Tensor) -> list[list[bool]]:
    return (out != NEG_INF).tolist()


def test_topp_keeps_smallest_prefix_reaching_p_bruteforce():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 50, generator=g, dtype=torch.float64) * torch.rand(300, 1, generator=g) * 4
    ps = torch.rand(300, generator=g, dtype=torch.float64).clamp(0.01, 0.999).tolist()
    checked = 0
    for row, p in zip(logits, ps):
        xs = row.tolist()
        probs = softmax64(xs)
        order = sorted(range(len(xs)), key=lambda i: (-xs[i], i))
        cum, want = 0.0, set()
        for i in order:
            want.add(i)
            cum += probs[i]
            if cum >= p:
                break
        if abs(cum - p) < 1e-12:  # rounding decides; not a semantic case
            continue
        got = {i for i, k in enumerate(kept_mask(TopP(p)(row.unsqueeze(0), None))[0]) if k}
        assert got == want
        checked += 1
    assert checked >= 295


def test_topp_boundary_is_inclusive():
    # Uniform probabilities 0.25 are exact in floating point: the prefix {0, 1} reaches p = 0.5 exactly.
    logits = torch.zeros(1, 4, dtype=torch.float64)
    assert kept_mask(TopP(0.5)(logits, None)) == [[True, True, False, False]]
    assert kept_mask(TopP(0.5 + 1e-9)(logits, None)) == [[True, True, True, False]]
    # Just below/above a cumulative sum of random float32 logits.
    row = torch.tensor([[2.0, 0.5, 1.0, -1.0, 0.0]])
    cum = torch.softmax(row.double(), -1).sort(descending=True).values.cumsum(-1)[0].tolist()
    for m in range(1, 4):
        assert sum(kept_mask(TopP(cum[m - 1] - 1e-6)(row, None))[0]) == m
        assert sum(kept_mask(TopP(cum[m - 1] + 1e-6)(row, None))[0]) == m + 1
    # A tiny p still keeps the top token.
    assert kept_mask(TopP(1e-9)(row, None)) == [[True, False, False, False, False]]


def test_topk_keeps_exactly_k_with_ties_and_disables():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    out = TopK(2)(logits, None)
    assert sum(kept_mask(out)[0]) == 2
    assert set(torch.topk(logits, 2).indices[0].tolist()) == {i for i, k in enumerate(kept_mask(out)[0]) if k}
    assert torch.equal(TopK(0)(logits, None), logits)
    assert torch.equal(TopK(5)(logits, None), logits)
    assert torch.equal(TopK(99)(logits, None), logits)
    out = TopK(3)(torch.tensor([[0.1, 0.5, -2.0, 0.4, 0.3]]), None)
    assert out.tolist() == [[NEG_INF, pytest.approx(0.5), NEG_INF, pytest.approx(0.4), pytest.approx(0.3)]]


def test_temperature_formula():
    logits = torch.tensor([[1.0, -2.0, 0.5]])
    assert torch.equal(Temperature(1.0)(logits, None), logits)
    assert torch.allclose(Temperature(0.5)(logits, None), torch.tensor([[2.0, -4.0, 1.0]]))
    assert torch.allclose(Temperature(4.0)(logits, None), torch.tensor([[0.25, -0.5, 0.125]]))


def test_temperature_limits_are_argmax_as_t_goes_to_zero_and_uniform_as_t_grows():
    """p_T = softmax(l / T): as T -> 0 the mass of the largest logit rises monotonically to 1 (argmax, where
    1 - p_max <= (V - 1) exp(-gap / T)); as T -> inf every p_v tends to 1/V (|p_v - 1/V| <= range(l) / T for
    T >= range(l), from |exp(x) - 1| <= 2|x| on |x| <= 1)."""
    logits = torch.tensor([[1.0, -2.0, 0.5, 0.7, 0.65]], dtype=torch.float64)
    n = logits.shape[-1]
    top = sorted(logits[0].tolist(), reverse=True)
    gap, spread = top[0] - top[1], top[0] - top[-1]
    p_max = []
    for t in (1.0, 0.3, 0.1, 0.03, 0.01):
        p = torch.softmax(Temperature(t)(logits, None), -1)[0]
        assert int(p.argmax()) == int(logits.argmax())
        assert 1 - float(p.max()) <= (n - 1) * math.exp(-gap / t) + 1e-15
        p_max.append(float(p.max()))
    assert p_max == sorted(p_max) and p_max[-1] > 1 - 1e-12
    dist = []
    for t in (3.0, 10.0, 1e2, 1e4, 1e6):
        p = torch.softmax(Temperature(t)(logits, None), -1)[0]
        dist.append(float((p - 1 / n).abs().max()))
        assert dist[-1] <= spread / t, t
    assert dist == sorted(dist, reverse=True) and dist[-1] < 1e-6


def test_minp_formula():
    rows = [[2.0, 1.0, 0.0, -1.0, 1.9, -3.0], [0.3, 0.2, 0.25, -0.4, 0.0, 0.31]]
    for min_p in (0.05, 0.3, 0.5, 0.9):
        out = MinP(min_p)(torch.tensor(rows), None).tolist()
        for row, got in zip(rows, out):
            probs = softmax64(row)
            pmax = max(probs)
            for x, p, y in zip(row, probs, got):
                assert y == (pytest.approx(x) if p >= min_p * pmax else NEG_INF)
    logits = torch.tensor(rows)
    assert torch.equal(MinP(0.0)(logits, None), logits)
    assert kept_mask(MinP(1.0)(logits, None)) == [[True] + [False] * 5, [False] * 5 + [True]]


def test_repetition_penalty_formula():
    rows = [[2.0, -1.0, 0.5, -0.3, 0.0, 3.0], [1.0, 1.0, -2.0, 4.0, -0.5, 0.25]]
    # -100 (padding) and 99 (beyond the vocabulary) are ignored.
    generated = torch.tensor([[0, 1, 1, 4, -100], [3, 2, 99, 3, 3]])
    for r in (1.3, 0.7):
        out = RepetitionPenalty(r)(torch.tensor(rows), generated).tolist()
        for row, hist, got in zip(rows, generated.tolist(), out):
            for v, x in enumerate(row):
                want = (x / r if x > 0 else x * r) if v in hist else x
                assert got[v] == pytest.approx(want)
    logits = torch.tensor(rows)
    assert torch.equal(RepetitionPenalty(1.5)(logits, None), logits)
    assert torch.equal(RepetitionPenalty(1.0)(logits, generated), logits)


def test_frequency_and_presence_penalty_formula():
    rows = [[2.0, -1.0, 0.5, -0.3, 0.0], [1.0, 1.0, -2.0, 4.0, -0.5]]
    generated = torch.tensor([[0, 1, 1, 1, 4, -1], [3, 3, 2, 3, 3, 7]])
    f, p = 0.4, 0.7
    freq = FrequencyPenalty(f)(torch.tensor(rows), generated).tolist()
    pres = PresencePenalty(p)(torch.tensor(rows), generated).tolist()
    both = PresencePenalty(p)(FrequencyPenalty(f)(torch.tensor(rows), generated), generated).tolist()
    for b, (row, hist) in enumerate(zip(rows, generated.tolist())):
        for v, x in enumerate(row):
            count = 0
            for t in hist:
                if t == v:
                    count += 1
            assert freq[b][v] == pytest.approx(x - count * f)
            assert pres[b][v] == pytest.approx(x - (count > 0) * p)
            assert both[b][v] == pytest.approx(x - count * f - (count > 0) * p)


def test_one_dimensional_history_is_shared_by_all_rows():
    logits = torch.zeros(3, 4)
    out = FrequencyPenalty(1.0)(logits, torch.tensor([2, 2, 0]))
    assert out.tolist() == [[-1.0, 0.0, -2.0, 0.0]] * 3


def test_processors_do_not_modify_input():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 30, generator=g)
    before = logits.clone()
    hist = torch.randint(0, 30, (4, 7), generator=g)
    for proc in (Temperature(0.7), TopK(5), TopP(0.8), MinP(0.2), RepetitionPenalty(1.4),
                 FrequencyPenalty(0.5), PresencePenalty(0.5)):
        proc(logits, hist)
        assert torch.equal(logits, before), proc


def test_fused_topk_topp_equals_sequential():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(64, 500, generator=g) * 2
    for k, p in ((2, 0.5), (5, 0.9), (40, 0.3), (499, 0.95), (500, 0.8)):
        fused = build_processors(SamplingParams(top_k=k, top_p=p))
        assert len(fused) == 1
        assert torch.equal(fused[0](logits, None), TopP(p)(TopK(k)(logits, None), None)), (k, p)


# ---------------------------------------------------------------------------------------------
# processor chain and sampler
# ---------------------------------------------------------------------------------------------


def test_build_processors_order_and_noops():
    assert build_processors(SamplingParams()) == []
    procs = build_processors(
        SamplingParams(
            temperature=0.7, top_k=0, top_p=0.9, min_p=0.1,
            repetition_penalty=1.2, frequency_penalty=0.1, presence_penalty=0.2,
        )
    )
    assert [type(p) for p in procs] == [
        RepetitionPenalty, FrequencyPenalty, PresencePenalty, Temperature, TopP, MinP,
    ]
    assert [type(p) for p in build_processors(SamplingParams(top_k=4))] == [TopK]
    # Greedy keeps only what can move the argmax.
    greedy = SamplingParams(temperature=0, top_p=0.5, repetition_penalty=2.0)
    assert [type(p) for p in build_processors(greedy)] == [RepetitionPenalty]


def test_default_and_topk_paths_do_not_sort(monkeypatch):
    def no_sort(*args, **kwargs):
        raise AssertionError("full-vocabulary sort on a path that does not need one")

    monkeypatch.setattr(torch, "sort", no_sort)
    logits = torch.randn(2, 1000)
    cases = (
        SamplingParams(),
        SamplingParams(top_k=20, top_p=0.9, temperature=0.5),
        SamplingParams(min_p=0.5),
    )
    for params in cases:
        tokens, _ = sample(logits, params, None, torch.Generator().manual_seed(0))
        assert tokens.shape == (2,)


def test_same_seed_same_samples():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(256, 100, generator=g)
    params = SamplingParams(temperature=1.2, top_p=0.95, seed=42)
    a, la = sample(logits, params, None, make_generator(params))
    b, lb = sample(logits, params, None, make_generator(params))
    assert torch.equal(a, b) and torch.equal(la, lb)
    c, _ = sample(logits, params, None, torch.Generator().manual_seed(43))
    assert not torch.equal(a, c)
    assert make_generator(SamplingParams()) is None


def test_temperature_zero_is_argmax_and_tiny_temperature_is_greedy():
    g = torch.Generator().manual_seed(8)
    # Distinct values 0.02 apart stay distinct in fp16/bf16 (no ties, so the argmax is unique).
    logits = torch.stack([torch.randperm(300, generator=g) for _ in range(512)]).float() / 50 - 3
    want = logits.argmax(-1)
    tokens, _ = sample(logits, SamplingParams(temperature=0.0), None, None)
    assert torch.equal(tokens, want)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = logits.to(dtype)
        gen = torch.Generator().manual_seed(1)
        tokens, logprobs = sample(x, SamplingParams(temperature=1e-6), None, gen)
        assert torch.equal(tokens, x.float().argmax(-1)), dtype
        assert torch.isfinite(logprobs).all()
    # top_k=1 and min_p=1 leave one token, which is the argmax.
    for params in (SamplingParams(top_k=1), SamplingParams(min_p=1.0), SamplingParams(top_p=1e-9)):
        tokens, _ = sample(logits, params, None, torch.Generator().manual_seed(1))
        assert torch.equal(tokens, want)


def test_greedy_applies_penalties():
    logits = torch.tensor([[3.0, 2.9, 1.0]])
    params = SamplingParams(temperature=0, repetition_penalty=1.2)
    tokens, _ = sample(logits, params, torch.tensor([[0]]))
    assert tokens.tolist() == [1]


def test_logprobs_are_raw_model_logprobs():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(128, 64, generator=g) * 2
    hist = torch.randint(0, 64, (128, 5), generator=g)
    params = SamplingParams(temperature=0.5, top_k=10, repetition_penalty=1.3, seed=0)
    tokens, logprobs = sample(logits, params, hist, make_generator(params))
    assert logprobs.dtype == torch.float32 and tokens.dtype == torch.long
    rows = logits.double().tolist()
    for row, tok, lp in zip(rows, tokens.tolist(), logprobs.tolist()):
        assert lp == pytest.approx(math.log(softmax64(row)[tok]), abs=1e-5)


def test_a_rows_logprobs_are_the_same_bits_in_a_block_of_rows_as_alone():
    """A speculative verification reports the log-probabilities of T positions from one (T, V) block, a plain
    step from (1, V), a batch from (R, V): each row's numbers must not depend on the rows beside it. torch's
    logsumexp splits a single 49k-token row's sum over two threads and a block's rows one per thread, which
    differed in the last bit in about 4% of such rows (an AVX-512 CPU); ``log_probs`` and ``sample`` reduce each
    row alone."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for seed in range(20):
            g = torch.Generator().manual_seed(seed)
            logits = torch.randn(6, 49152, generator=g) * 3 + torch.randn(6, 1, generator=g) * 10
            alone = torch.cat([log_probs(row) for row in logits.split(1)])
            assert torch.equal(log_probs(logits), alone), seed
            tokens, lp = sample(logits, SamplingParams(temperature=0))
            assert torch.equal(lp, alone.gather(1, tokens[:, None]).squeeze(1)), seed
    finally:
        torch.set_num_threads(threads)


def test_sample_rejects_bad_shape_and_a_sampler_count_that_is_not_the_row_count():
    with pytest.raises(ValueError):
        sample(torch.zeros(5), SamplingParams())
    with pytest.raises(ValueError):
        sample(torch.zeros(3, 5), [SamplingParams()] * 2)


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.01),
        ("top_p", float("nan")),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
        ("frequency_penalty", float("nan")),
        ("presence_penalty", float("-inf")),
        ("max_new_tokens", -1),
        ("max_new_tokens", 1.5),
        ("seed", -3),
        ("seed", 2**64),
        ("stop_token_ids", (1, -2)),
        ("stop_strings", ("ok", "")),
        ("stop_strings", "</s>"),
    ],
)
def test_invalid_values_raise_generation_error_naming_field(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(GenerationError, match=field):
        params.validate()
    with pytest.raises(GenerationError, match=field):
        build_processors(params)


def test_valid_edge_values_pass():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=1.0, max_new_tokens=0, seed=0).validate()
    SamplingParams(min_p=0.0, repetition_penalty=0.01, frequency_penalty=-2, presence_penalty=2).validate()
    SamplingParams(stop_token_ids=[0, 2], stop_strings=["\n\n"], seed=2**64 - 1).validate()


@pytest.mark.parametrize(
    "ctor,value,field",
    [
        (Temperature, 0.0, "temperature"),
        (Temperature, -1.0, "temperature"),
        (TopK, -1, "top_k"),
        (TopP, 0.0, "top_p"),
        (MinP, 2.0, "min_p"),
        (RepetitionPenalty, 0.0, "repetition_penalty"),
        (FrequencyPenalty, float("nan"), "frequency_penalty"),
        (PresencePenalty, float("inf"), "presence_penalty"),
    ],
)
def test_processor_constructors_validate(ctor, value, field):
    with pytest.raises(GenerationError, match=field):
        ctor(value)


# ---------------------------------------------------------------------------------------------
# parity with Hugging Face transformers
# ---------------------------------------------------------------------------------------------


def test_processors_match_transformers():
    lp = pytest.importorskip("transformers.generation.logits_process")
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(32, 1000, generator=g) * 3  # continuous: no ties
    input_ids = torch.randint(0, 1000, (32, 20), generator=g)

    def same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
        assert torch.equal(ours == NEG_INF, theirs == NEG_INF)
        finite = ours != NEG_INF
        torch.testing.assert_close(ours[finite], theirs[finite], rtol=1e-6, atol=1e-6)

    for t in (0.3, 1.0, 2.5):
        same(Temperature(t)(logits, None), lp.TemperatureLogitsWarper(t)(input_ids, logits.clone()))
    for k in (1, 7, 50, 999, 1000, 5000):
        same(TopK(k)(logits, None), lp.TopKLogitsWarper(k)(input_ids, logits.clone()))
    for p in (0.05, 0.3, 0.9, 0.99):
        same(TopP(p)(logits, None), lp.TopPLogitsWarper(p)(input_ids, logits.clone()))
    for p in (0.01, 0.1, 0.5, 1.0):
        same(MinP(p)(logits, None), lp.MinPLogitsWarper(p)(input_ids, logits.clone()))
    for r in (0.8, 1.3, 2.0):
        theirs = lp.RepetitionPenaltyLogitsProcessor(r)(input_ids, logits.clone())
        same(RepetitionPenalty(r)(logits, input_ids), theirs)


def test_topk_ties_differ_from_transformers_as_documented():
    lp = pytest.importorskip("transformers.generation.logits_process")
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    ours = TopK(2)(logits, None)
    theirs = lp.TopKLogitsWarper(2)(torch.zeros(1, 1, dtype=torch.long), logits.clone())
    assert int((ours != NEG_INF).sum()) == 2
    assert int((theirs != NEG_INF).sum()) == 3  # HF keeps every token tied with the k-th


# ---------------------------------------------------------------------------------------------
# the one sampler: rows of different settings in one call, grouping keys, the greedy case
# ---------------------------------------------------------------------------------------------


def ref_penalised(logits: list[float], prompt: list[int], generated: list[int], rep: float, freq: float,
                  pres: float) -> list[float]:
    """The penalties by hand in float64: CTRL / HF repetition over prompt + generated, OpenAI frequency and
    presence over generated."""
    seen = set(prompt) | set(generated)
    out = []
    for v, x in enumerate(logits):
        if rep != 1.0 and v in seen:
            x = x / rep if x > 0 else x * rep
        c = generated.count(v)
        out.append(x - freq * c - pres * (c > 0))
    return out


def test_rows_of_different_settings_in_one_call_draw_from_their_float64_references():
    """Two settings interleaved row by row, one with penalties over ragged histories: each row's sampled
    frequencies match its own float64 reference distribution (chi-square)."""
    g = torch.Generator().manual_seed(21)
    vocab, n = 10, 40_000
    logits = torch.randn(vocab, generator=g) * 1.5
    a = SamplingParams(temperature=0.7, top_k=6, min_p=0.05)
    b = SamplingParams(temperature=1.3, top_p=0.8, repetition_penalty=1.5, frequency_penalty=0.4,
                       presence_penalty=0.3)
    prompt, generated = [1, 2], [2, 5, 5]
    params = [a, b] * (n // 2)
    hist = penalty_history(params, [prompt] * n, [generated if p is b else [] for p in params])
    tokens, _ = sample(logits.expand(n, -1), [Sampler.of(p) for p in params], hist, torch.Generator().manual_seed(0))
    base = logits.double().tolist()
    refs = {id(a): ref_distribution(base, 0.7, 6, 1.0, 0.05),
            id(b): ref_distribution(ref_penalised(base, prompt, generated, 1.5, 0.4, 0.3), 1.3, 0, 0.8, 0.0)}
    for p in (a, b):
        rows = torch.tensor([i for i, q in enumerate(params) if q is p])
        counts = torch.bincount(tokens[rows], minlength=vocab).tolist()
        expected = refs[id(p)]
        kept = [i for i in range(vocab) if expected[i] > 0]
        assert all(counts[i] == 0 for i in range(vocab) if expected[i] == 0), counts
        m = len(rows)
        stat = sum((counts[i] - m * expected[i]) ** 2 / (m * expected[i]) for i in kept)
        assert stat < chi2_quantile(len(kept) - 1), (stat, counts, expected)


def test_a_row_draws_the_same_token_alone_or_among_rows_of_other_settings():
    """Per-row generators: a seeded row's token does not depend on which rows share its call, and penalties
    see each row's own (ragged, padded) history."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 50, generator=g) * 2
    params = [SamplingParams(temperature=0.9, seed=1), SamplingParams(temperature=0, repetition_penalty=1.4),
              SamplingParams(top_k=5, seed=2), SamplingParams(temperature=0.9, seed=3),
              SamplingParams(top_p=0.7, presence_penalty=0.5, seed=4), SamplingParams(temperature=0)]
    prompts = [[1], [2, 3, 4], [], [5, 6], [7], [8]]
    generated = [[9, 9], [10], [11, 12, 13], [], [14, 14, 15], [16]]
    together, lp = sample(logits, [Sampler.of(p) for p in params], penalty_history(params, prompts, generated),
                          [make_generator(p) for p in params])
    for i, p in enumerate(params):
        alone, lp_alone = sample(logits[i : i + 1], p, penalty_history(p, prompts[i], generated[i]), make_generator(p))
        assert together[i] == alone[0], i
        assert lp[i] == lp_alone[0]


def test_greedy_is_the_temperature_zero_case_whatever_rows_share_the_call():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(8, 64, generator=g) * 3
    samplers = [Sampler.of(SamplingParams(temperature=0)), Sampler.of(SamplingParams(temperature=0.8))] * 4
    tokens, _ = sample(logits, samplers)
    assert torch.equal(tokens[::2], logits[::2].argmax(-1))
    assert Sampler.of(SamplingParams(temperature=0)).key == Sampler.of(SamplingParams(top_k=1, temperature=0.5)).key
    alone, logprobs = sample(logits, SamplingParams(temperature=0), want_logprobs=False)
    assert torch.equal(alone, logits.argmax(-1)) and logprobs is None


# Another valid value for every field of SamplingParams that decides how a token is chosen. A field added to
# SamplingParams fails the test below until it is listed here or in NOT_SAMPLING.
OTHER_VALUE = {"temperature": 1.3, "top_k": 9, "top_p": 0.6, "min_p": 0.2, "repetition_penalty": 1.7,
               "frequency_penalty": -0.4, "presence_penalty": 0.9}
# (a constraint is per row, applied as a mask before the chain: rows of different grammars share a chain)
NOT_SAMPLING = {"max_new_tokens": 7, "seed": 11, "stop_token_ids": [3], "stop_strings": ["x"],
                "constraint": Grammar("regex", "a+")}


def test_rows_share_a_group_exactly_when_their_processors_give_the_same_logits():
    """The grouping key comes from the processors: params that differ in any one sampling field get different
    keys (and different processed logits), params that differ only in what is not sampling share a key."""
    base = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.01, repetition_penalty=1.2,
                          frequency_penalty=0.3, presence_penalty=0.2)
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert fields == set(OTHER_VALUE) | set(NOT_SAMPLING), fields ^ (set(OTHER_VALUE) | set(NOT_SAMPLING))
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 40, generator=g, dtype=torch.float64) * 2
    hist = torch.randint(0, 40, (1, 12), generator=g)

    def processed(params: SamplingParams) -> torch.Tensor:
        x = logits
        for proc in Sampler.of(params).processors:
            x = proc(x, hist)
        return x

    for name, value in OTHER_VALUE.items():
        other = dataclasses.replace(base, **{name: value})
        assert Sampler.of(other).key != Sampler.of(base).key, name
        assert not torch.equal(processed(other), processed(base)), name  # the key had to differ
    for name, value in NOT_SAMPLING.items():
        assert Sampler.of(dataclasses.replace(base, **{name: value})).key == Sampler.of(base).key, name


def test_a_processor_attribute_is_part_of_its_key_without_being_listed():
    """Processor keys are the class and every attribute: one added later is grouped on too."""
    proc = TopK(5)
    key = proc.key
    proc.min_tokens_to_keep = 2  # an attribute a future version might add
    assert proc.key != key
    assert TopK(5).key == key and TopK(6).key != key and MinP(0.5).key != TopP(0.5).key


def test_a_processor_without_a_key_is_shared_only_by_rows_that_hold_it():
    def double(logits, generated):
        return logits * 2

    assert Sampler([double]).key == Sampler([double]).key
    assert Sampler([double]).key != Sampler([lambda x, g: x * 2]).key


def test_a_uniform_that_rounds_up_to_the_total_still_draws_a_kept_token(monkeypatch):
    """U * c_V can round to c_V itself; the token is then the last one with any mass, never a filtered one
    at the end of the vocabulary."""
    logits = torch.tensor([[0.0, 3.0, 2.0, -5.0, -6.0]])
    params = SamplingParams(top_k=2)  # keeps ids 1 and 2; the ids after them are filtered
    # U = 1 stands for a U below 1 whose product with c_V rounds to c_V
    monkeypatch.setattr(torch, "rand", lambda *shape, **kwargs: torch.ones(*shape, dtype=kwargs.get("dtype")))
    tokens, _ = sample(logits, params)
    assert tokens.tolist() == [2]
