"""Continuous-batching scheduler (no HTTP): batched decoding against a one-sequence, cache-free reference."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tinyformer.config import ModelConfig
from tinyformer.generation.sampling import SamplingParams
from tinyformer.models.decoder import DecoderLM
from tinyformer.serve.scheduler import GenerationRequest, QueueFull, Scheduler, StepEvent

VOCAB = 48


def token_bytes(i: int) -> bytes:
    """A toy byte mapping: every id is one printable character (distinct, so text identifies tokens)."""
    return chr(ord("0") + i).encode()


@pytest.fixture(scope="module")
def model() -> DecoderLM:
    torch.manual_seed(0)
    # a large init_std makes a random model's greedy output varied instead of one repeated token
    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=64, init_std=0.3)
    return DecoderLM(cfg).eval()


def reference_greedy(model: DecoderLM, prompt: list[int], n: int, freq: float = 0.0, pres: float = 0.0) -> list[int]:
    """Full forward pass over the whole sequence each step (no cache, batch of one), argmax of
    logits - freq * count - pres * [count > 0] over the generated tokens (OpenAI's penalty formula)."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]))[0, -1].double()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=VOCAB).double()
            logits = logits - freq * counts - pres * (counts > 0).double()
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


class Collector:
    """Sink that records a request's events and signals when it finished."""

    def __init__(self) -> None:
        self.events: list[StepEvent] = []
        self.done = threading.Event()

    def __call__(self, event: StepEvent) -> None:
        self.events.append(event)
        if event.finish_reason is not None:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [t.token_id for e in self.events for t in e.tokens]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def last(self) -> StepEvent:
        return self.events[-1]


def make(prompt: list[int], max_tokens: int, **params) -> tuple[GenerationRequest, Collector]:
    sink = Collector()
    top = params.pop("top", 0)
    p = SamplingParams(max_new_tokens=max_tokens, **{"temperature": 0.0, **params})
    return GenerationRequest(list(prompt), p, sink, top_logprobs=top), sink


def run_all(sched: Scheduler, sinks: list[Collector], timeout: float = 30) -> None:
    for s in sinks:
        assert s.done.wait(timeout), "a request did not finish"


@pytest.mark.parametrize(("kw", "message"), [({"max_batch": 0, "max_queue": -1}, "max_batch must be >= 1, got 0"),
                                             ({"max_queue": -1}, "max_queue must be >= 0, got -1")])
def test_a_scheduler_refuses_no_slots_or_a_negative_queue_before_it_prepares_anything(model, kw, message):
    with pytest.raises(ValueError, match=message):
        Scheduler(model, token_bytes, compile=True, **kw)


def test_continuous_batching_equals_each_sequence_decoded_alone(model):
    """Requests of different prompt lengths and budgets, more than there are slots, so some wait
    and join a batch already in flight in a reused slot: each gets exactly its solo greedy tokens."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 11, 2, 8, 17, 3)]
    budgets = [12, 4, 20, 9, 15, 7]
    sched = Scheduler(model, token_bytes, max_batch=3, max_queue=8)
    pairs = [make(p, m) for p, m in zip(prompts, budgets)]
    sched.start()
    try:
        sched.submit([r for r, _ in pairs[:4]])
        time.sleep(0.01)  # the rest arrives while the first ones decode
        sched.submit([r for r, _ in pairs[4:]])
        run_all(sched, [s for _, s in pairs])
    finally:
        sched.stop()
    for (_, sink), prompt, budget in zip(pairs, prompts, budgets):
        assert sink.tokens == reference_greedy(model, prompt, budget)
        assert sink.last.finish_reason == "length"
        assert (sink.last.prompt_tokens, sink.last.completion_tokens) == (len(prompt), budget)
        assert sink.text == "".join(token_bytes(t).decode() for t in sink.tokens)
    assert sched.stats()["active"] == 0 and sched.peak_active == 3
    assert sched.engine.moves > 0  # some requests were moved down into a freed slot mid-generation


def test_frequency_and_presence_penalties_follow_the_openai_formula(model):
    prompt = [5, 9, 14, 3]
    sched = Scheduler(model, token_bytes, max_batch=2)
    a, sa = make(prompt, 16, frequency_penalty=0.7, presence_penalty=0.4)
    b, sb = make(prompt, 16)  # shares the batch without penalties
    sched.start()
    try:
        sched.submit([a, b])
        run_all(sched, [sa, sb])
    finally:
        sched.stop()
    assert sa.tokens == reference_greedy(model, prompt, 16, freq=0.7, pres=0.4)
    assert sb.tokens == reference_greedy(model, prompt, 16)


def test_seeded_sampling_gives_the_same_tokens_alone_and_batched(model):
    prompt = [7, 8, 9]
    params = dict(temperature=1.0, top_p=0.9, seed=1234)

    def sample(with_others: bool) -> list[int]:
        sched = Scheduler(model, token_bytes, max_batch=4)
        req, sink = make(prompt, 24, **params)
        others = [make([4 + i, 20], 30, temperature=0.8)[0] for i in range(3)] if with_others else []
        sched.start()
        try:
            sched.submit([*others, req])
            run_all(sched, [sink])
        finally:
            sched.stop()
        return sink.tokens

    alone = sample(False)
    assert alone == sample(True)
    assert len(set(alone)) > 3  # actually sampled, not a constant


def test_stop_token_and_stop_string_end_the_sequence(model):
    prompt = [10, 20, 30]
    ref = reference_greedy(model, prompt, 20)
    ref_text = "".join(token_bytes(t).decode() for t in ref)
    stop_tok = ref[5]
    first = ref.index(stop_tok)
    stop_str = ref_text[6:9]  # three tokens: crosses token boundaries, held back until it is certain
    cut = ref_text.find(stop_str)
    sched = Scheduler(model, token_bytes, max_batch=2)
    a, sa = make(prompt, 20, stop_token_ids=[stop_tok])
    b, sb = make(prompt, 20, stop_strings=[stop_str])
    sched.start()
    try:
        sched.submit([a, b])
        run_all(sched, [sa, sb])
    finally:
        sched.stop()
    assert sa.tokens == ref[: first + 1] and sa.last.finish_reason == "stop"
    assert sa.text == ref_text[:first]  # the stop token itself is not text
    assert sb.text == ref_text[:cut] and sb.last.finish_reason == "stop"


def test_a_full_context_ends_with_length(model):
    sched = Scheduler(model, token_bytes, max_batch=1, max_len=16)
    req, sink = make(list(range(3, 13)), 100)
    sched.start()
    try:
        sched.submit([req])
        run_all(sched, [sink])
    finally:
        sched.stop()
    # positions 10..15 are fed (6 steps) after the prefill token: 7 tokens, then no position is left
    assert sink.last.finish_reason == "length" and len(sink.tokens) == 7
    assert sink.tokens == reference_greedy(model, list(range(3, 13)), 7)


def test_top_logprobs_are_the_log_softmax_of_the_reference_logits(model):
    prompt = [11, 12, 13, 14]
    sched = Scheduler(model, token_bytes, max_batch=2)
    req, sink = make(prompt, 5, top=4)
    sched.start()
    try:
        sched.submit([req])
        run_all(sched, [sink])
    finally:
        sched.stop()
    ids = list(prompt)
    with torch.no_grad():
        for info in [t for e in sink.events for t in e.tokens]:
            lsm = torch.log_softmax(model(torch.tensor([ids]))[0, -1].double(), -1)
            values, top = lsm.topk(4)
            assert [i for i, _ in info.top] == top.tolist()
            assert [lp for _, lp in info.top] == pytest.approx(values.tolist(), abs=1e-4)
            assert info.logprob == pytest.approx(float(lsm[info.token_id]), abs=1e-4)
            ids.append(info.token_id)


def test_queue_limit_rejects_what_neither_a_slot_nor_the_queue_can_take(model):
    sched = Scheduler(model, token_bytes, max_batch=1, max_queue=1)  # not started: nothing is admitted
    sched.submit([make([3], 4)[0]])
    sched.submit([make([3], 4)[0]])
    with pytest.raises(QueueFull):
        sched.submit([make([3], 4)[0]])
    assert sched.stats()["waiting"] == 2


def test_cancel_frees_the_slot_for_the_waiting_request(model):
    sched = Scheduler(model, token_bytes, max_batch=1, max_queue=4)
    long_req, long_sink = make([3, 4], 60)
    short_req, short_sink = make([5, 6], 3)
    sched.start()
    try:
        sched.submit([long_req, short_req])
        deadline = time.monotonic() + 10
        while not long_sink.events and time.monotonic() < deadline:
            time.sleep(0.001)
        sched.cancel([long_req.id])
        assert short_sink.done.wait(10)
        time.sleep(0.05)
        assert sched.stats()["active"] == 0 and sched.stats()["waiting"] == 0
    finally:
        sched.stop()
    assert sched.cancelled == 1
    assert not long_sink.done.is_set()  # a cancelled request gets no final event: nobody is listening
    assert short_sink.tokens == reference_greedy(model, [5, 6], 3)


def test_deadline_ends_a_request_with_timeout(model):
    sched = Scheduler(model, token_bytes, max_batch=1)
    req, sink = make([3, 4], 10)
    req.deadline = time.monotonic() - 1
    sched.start()
    try:
        sched.submit([req])
        run_all(sched, [sink])
    finally:
        sched.stop()
    assert sink.last.finish_reason == "timeout" and sink.last.error


def test_a_failing_receiver_does_not_stop_the_others(model):
    def broken(event: StepEvent) -> None:
        raise RuntimeError("event loop closed")

    sched = Scheduler(model, token_bytes, max_batch=2)
    bad = GenerationRequest([3, 4], SamplingParams(temperature=0, max_new_tokens=10), broken)
    good, sink = make([3, 4], 10)
    sched.start()
    try:
        sched.submit([bad, good])
        run_all(sched, [sink])
    finally:
        sched.stop()
    assert sink.tokens == reference_greedy(model, [3, 4], 10)
    assert sched.stats()["active"] == 0


def test_only_rows_with_a_non_finite_logit_end_with_a_model_error(model):
    """NaN, +inf and -inf anywhere in a row's logits end that row ("model_error"); the finite rows of the
    same step are sampled as usual (the check reads each row's max and min, which NaN propagates to)."""
    from tinyformer.generation.engine import BatchEngine, EngineRow
    from tinyformer.generation.streaming import TextState

    engine = BatchEngine(model, max_batch=4)
    rows = [EngineRow([1], SamplingParams(temperature=0.0), TextState(token_bytes, (), ())) for _ in range(4)]
    logits = torch.randn(4, VOCAB)
    logits[0, 3] = float("nan")
    logits[1, VOCAB - 1] = float("inf")
    logits[3, 0] = float("-inf")
    outs = engine._sample(logits, rows)
    assert [o.finish_reason for o in outs] == ["model_error", "model_error", None, "model_error"]
    assert outs[2].token is not None and outs[2].token.token_id == int(logits[2].argmax())
    assert all(o.token is None and o.error for o in (outs[0], outs[1], outs[3]))


def test_requests_without_logprobs_get_the_same_greedy_tokens_and_no_logprobs(model):
    """A request that does not ask for log-probabilities (``logprobs=False``: the API request had none)
    gets the greedy tokens of the full recomputation, and its tokens carry no logprob."""
    sched = Scheduler(model, token_bytes, max_batch=4)
    sched.start()
    try:
        sinks = []
        for prompt, lp in (([3, 4], False), ([5, 6, 7], True)):
            req, sink = make(prompt, 6)
            req.logprobs = lp
            sched.submit([req])
            sinks.append(sink)
        run_all(sched, sinks)
    finally:
        sched.stop()
    assert sinks[0].tokens == reference_greedy(model, [3, 4], 6)
    assert sinks[1].tokens == reference_greedy(model, [5, 6, 7], 6)
    assert all(t.logprob is None for e in sinks[0].events for t in e.tokens)
    assert all(t.logprob is not None for e in sinks[1].events for t in e.tokens)
