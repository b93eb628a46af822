"""Which tokens the penalties see (sampling.penalty_history, the one place that decides it for the engine
and the server): the repetition penalty sees prompt + generated tokens, as transformers'
RepetitionPenaltyLogitsProcessor is given them; the frequency and presence penalties count the generated
tokens only (the OpenAI formula), whichever other penalties are on."""

from __future__ import annotations

import threading

import pytest
import torch
from test_engine import random_lm  # noqa: E402

from tinyformer.generation.generator import Generator
from tinyformer.generation.sampling import SamplingParams, build_processors, penalty_history
from tinyformer.serve.scheduler import GenerationRequest, Scheduler

transformers = pytest.importorskip("transformers")
V = 50


def expected_logits(logits: torch.Tensor, prompt: list[int], generated: list[int], rep: float, freq: float,
                    pres: float) -> torch.Tensor:
    """transformers' repetition penalty over prompt + generated, then the OpenAI penalties over generated."""
    x = logits.double()[None]
    if rep != 1.0:
        x = transformers.RepetitionPenaltyLogitsProcessor(rep)(torch.tensor([prompt + generated]), x)
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=x.shape[-1]).double()
    return (x - freq * counts - pres * (counts > 0).double())[0]


@pytest.mark.parametrize("rep,freq,pres", [(1.3, 0.0, 0.0), (1.0, 0.6, 0.4), (1.3, 0.6, 0.4), (0.8, -0.5, 0.0)])
def test_penalties_see_what_transformers_and_openai_say(rep, freq, pres):
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    prompt = [3, 7, 7, 9, 11]
    generated = [7, 12, 12, 12, 40, 3]  # 7 and 3 occur in both, 9 and 11 in the prompt only
    logits = torch.randn(V, generator=g, dtype=torch.float64) * 3
    hist = penalty_history(params, prompt, generated)
    x = logits[None]
    for proc in build_processors(params):
        x = proc(x, hist)
    torch.testing.assert_close(x[0], expected_logits(logits, prompt, generated, rep, freq, pres))


def test_no_penalty_builds_no_history_and_only_the_repetition_penalty_copies_the_prompt():
    assert penalty_history(SamplingParams(), [1, 2], [3]) is None
    assert penalty_history(SamplingParams(frequency_penalty=0.5), [1, 2], [3]).prompt is None
    hist = penalty_history(SamplingParams(repetition_penalty=1.2), torch.tensor([[-1, 1, 2]]), torch.tensor([[3]]))
    assert hist.repetition_ids().tolist() == [[-1, 1, 2, 3]]


def test_rows_of_different_settings_keep_their_ids_only_where_their_penalties_look():
    """One history for rows of different parameters: ragged rows padded with -1; a row's prompt is kept only
    when its repetition penalty looks at it, its generated ids only when some penalty does."""
    params = [SamplingParams(repetition_penalty=1.2), SamplingParams(frequency_penalty=0.5), SamplingParams()]
    hist = penalty_history(params, [[1, 2, 3], [4], [5, 6]], [[7], [8, 9], [10]])
    assert hist.prompt.tolist() == [[1, 2, 3], [-1, -1, -1], [-1, -1, -1]]
    assert hist.generated.tolist() == [[7, -1], [8, 9], [-1, -1]]
    assert penalty_history([SamplingParams(), SamplingParams(top_k=3)], [[1], [2]], [[3], [4]]) is None
    # each row's penalties then see exactly what that row alone would show them
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for b, (p, prompt, generated) in enumerate(zip(params, [[1, 2, 3], [4], [5, 6]], [[7], [8, 9], [10]])):
        x, alone = logits[b : b + 1], logits[b : b + 1]
        for proc in build_processors(p):
            x = proc(x, hist[b : b + 1])
            alone = proc(alone, penalty_history(p, prompt, generated))
        torch.testing.assert_close(x, alone, rtol=0, atol=0)


def reference(model, prompt: list[int], n: int, rep: float, freq: float, pres: float) -> list[int]:
    """Greedy with no cache: the whole sequence every step, the penalties as expected_logits applies them."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out]))[0, -1]
            out.append(int(expected_logits(logits, prompt, out, rep, freq, pres).argmax()))
    return out


def test_generator_and_server_apply_the_penalties_to_the_same_tokens():
    model = random_lm(vocab=V, seed=2)
    rep, freq, pres, n = 1.5, 0.7, 0.5, 24
    prompts = [[5, 6, 7, 5, 6, 7, 8], [9, 10]]
    want = [reference(model, p, n, rep, freq, pres) for p in prompts]
    params = SamplingParams(temperature=0, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
                            max_new_tokens=n)
    gen = Generator(model)
    gen.eos_token_id = None
    assert [r.token_ids for r in gen.generate(prompts, params)] == want  # one left-padded batch

    sched = Scheduler(model, lambda i: bytes([65 + i % 26]), max_batch=2)
    got: list[list[int]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def sink(i):
        def on_event(event):
            got[i].extend(t.token_id for t in event.tokens)
            if event.finish_reason is not None:
                done[i].set()
        return on_event

    sched.start()
    try:
        sched.submit([GenerationRequest(list(p), params, sink(i)) for i, p in enumerate(prompts)])
        assert all(d.wait(60) for d in done)
    finally:
        sched.stop()
    assert got == want
