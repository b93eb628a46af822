"""The OpenAI-compatible server, driven by the official ``openai`` client over real HTTP.

A tiny random model and a char tokenizer are saved into a run folder, loaded back as `tinyformer
serve` would, and served on a free loopback port in a background thread. Expected texts come from a
cache-free greedy loop over the model (an independent implementation of decoding).
"""

from __future__ import annotations

import asyncio
import json
import string
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serve_helpers import BackgroundServer, SlowModel  # noqa: E402

from tinyformer.config import ModelConfig  # noqa: E402
from tinyformer.data.tokenizer import build_tokenizer  # noqa: E402
from tinyformer.models.decoder import DecoderLM  # noqa: E402
from tinyformer.run_folder import load_model, load_tokenizer, save_model  # noqa: E402
from tinyformer.serve.app import create_app  # noqa: E402

NAME = "tiny-test"
KEY = "sekrit"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}<assistant>{% endif %}"



@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("serve_run")
    tok = build_tokenizer("char", string.printable)
    tok.chat_template = TEMPLATE
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=128,
                      init_std=0.3)
    save_model(run, DecoderLM(cfg))
    tok.save(run)
    return run


@pytest.fixture(scope="module")
def model(run_dir):
    return load_model(run_dir)


@pytest.fixture(scope="module")
def tok(run_dir):
    return load_tokenizer(run_dir)


@pytest.fixture(scope="module")
def server(model, tok):
    """The main server: 16 slots, a short pause per step so concurrent requests overlap."""
    app = create_app(SlowModel(model, 0.002), tok, model_name=NAME, max_batch=16, max_queue=16)
    with BackgroundServer(app) as srv:
        srv.state = app.state.server
        yield srv


@pytest.fixture(scope="module")
def narrow(model, tok):
    """One slot, one queue place, an API key and a 3 s request timeout; 30 ms per step."""
    app = create_app(SlowModel(model, 0.03), tok, model_name=NAME, max_batch=1, max_queue=1, api_key=KEY,
                     request_timeout=3.0)
    with BackgroundServer(app) as srv:
        srv.state = app.state.server
        yield srv


def client(srv, key: str = "unused", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=30, **kw)


def greedy_text(model, tok, prompt: str, n: int) -> str:
    """Cache-free greedy decoding: the whole sequence through the model at every step."""
    ids = tok.encode(prompt)
    out = []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
            ids.append(out[-1])
    return tok.decode(out)


NO_EOS = {"ignore_eos": True}


def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [NAME]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["max_batch"] == 16


def test_completion_equals_reference_greedy_with_usage(server, model, tok):
    prompt = "Once upon a time"
    r = client(server).completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                          extra_body=NO_EOS)
    assert r.choices[0].text == greedy_text(model, tok, prompt, 24)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (16, 24, 40)


def test_chat_renders_the_tokenizer_template(server, model, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = client(server).chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                               extra_body=NO_EOS)
    rendered = "<system>Be brief.\n<user>Hi!\n<assistant>"  # TEMPLATE written out by hand
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == greedy_text(model, tok, rendered, 12)
    assert r.usage.prompt_tokens == len(rendered)


def test_streaming_equals_non_streaming(server):
    c = client(server)
    full = c.completions.create(model=NAME, prompt="The cat", max_tokens=20, temperature=0, extra_body=NO_EOS)
    chunks = list(c.completions.create(model=NAME, prompt="The cat", max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body=NO_EOS))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20

    messages = [{"role": "user", "content": "Tell me"}]
    chat = c.chat.completions.create(model=NAME, messages=messages, max_tokens=15, temperature=0, extra_body=NO_EOS)
    stream = list(c.chat.completions.create(model=NAME, messages=messages, max_tokens=15, temperature=0, stream=True,
                                            extra_body=NO_EOS))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == chat.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == "length"


def test_raw_stream_is_sse_ending_with_done(server):
    body = {"model": NAME, "prompt": "ab", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_logprobs_match_the_model(server, model, tok):
    prompt = "Hello"
    r = client(server).completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=3,
                                          extra_body=NO_EOS)
    lp = r.choices[0].logprobs
    ids = tok.encode(prompt)
    with torch.no_grad():
        for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            lsm = torch.log_softmax(model(torch.tensor([ids]))[0, -1].double(), -1)
            values, best = lsm.topk(3)
            assert list(top) == [tok.decode([i]) for i in best.tolist()]
            assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-4)
            assert token == tok.decode([int(best[0])]) and token_lp == pytest.approx(float(values[0]), abs=1e-4)
            ids.append(int(best[0]))
    chat = client(server).chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                                  max_tokens=3, logprobs=True, top_logprobs=2, temperature=0)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_stop_strings_seed_and_n(server, model, tok):
    c = client(server)
    ref = greedy_text(model, tok, "Stop here", 30)
    stop = ref[10:13]
    r = c.completions.create(model=NAME, prompt="Stop here", max_tokens=30, temperature=0, stop=[stop],
                             extra_body=NO_EOS)
    assert r.choices[0].text == ref[: ref.find(stop)] and r.choices[0].finish_reason == "stop"

    kw = dict(model=NAME, prompt="Seeded", max_tokens=16, temperature=1.0, seed=7, n=2, extra_body=NO_EOS)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]  # reproducible with a seed
    assert [ch.index for ch in a.choices] == [0, 1] and a.choices[0].text != a.choices[1].text
    assert a.usage.completion_tokens == 32


def test_eight_concurrent_streams_equal_their_solo_results(server):
    prompts = [f"Request {i}: {w}" for i, w in enumerate("abcdefgh")]

    async def stream(ac: openai.AsyncOpenAI, prompt: str) -> str:
        s = await ac.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                        extra_body=NO_EOS)
        return "".join([ch.choices[0].text async for ch in s if ch.choices])

    async def solo() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0) as ac:
            return [await stream(ac, p) for p in prompts]

    async def together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0) as ac:
            return list(await asyncio.gather(*(stream(ac, p) for p in prompts)))

    sched = server.state.scheduler
    sched.peak_active = 0
    alone = asyncio.run(solo())
    assert sched.peak_active == 1
    assert asyncio.run(together()) == alone
    assert all(alone) and len(set(alone)) > 1
    assert sched.peak_active > 1  # they really shared decode steps


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, tok):
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model=NAME, prompt="x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model=NAME, prompt="x", temperature="hot")
    with pytest.raises(openai.BadRequestError, match="maximum context length is 128") as e:
        c.completions.create(model=NAME, prompt="y" * 120, max_tokens=20)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="prompt"):
        c.completions.create(model=NAME, prompt=[[1, 2], "mixed"])
    with pytest.raises(openai.BadRequestError, match="role"):
        c.chat.completions.create(model=NAME, messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.NotFoundError, match="no-such-model") as e:
        c.completions.create(model="no-such-model", prompt="x")
    assert e.value.code == "model_not_found"

    for raw, what in ((b"{not json", "JSON"), (b"[1, 2]", "object"), (b'{"model": "tiny-test"}', "prompt")):
        r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == 400 and what in err["message"]
        assert set(err) == {"message", "type", "param", "code"}
    r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "\u00e9t\u00e9"})
    assert r.status_code == 400 and "not in the char tokenizer" in r.json()["error"]["message"]

    ok = c.completions.create(model=NAME, prompt="still alive", max_tokens=2)
    assert ok.usage.completion_tokens >= 1
    assert httpx.get(server.url + "/health").json()["active"] == 0


def test_api_key_is_required_when_configured(narrow):
    with pytest.raises(openai.AuthenticationError):
        client(narrow, key="wrong").models.list()
    r = httpx.post(narrow.url + "/v1/completions", json={"model": NAME, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert client(narrow, key=KEY).models.list().data[0].id == NAME
    assert httpx.get(narrow.url + "/health").status_code == 200  # health needs no key


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def test_full_queue_answers_429_with_retry_after(narrow):
    sched = narrow.state.scheduler
    c = client(narrow, key=KEY)
    first = c.completions.create(model=NAME, prompt="slot", max_tokens=60, stream=True, extra_body=NO_EOS)
    next(iter(first))  # holds the only slot now
    queued: list = []
    t = threading.Thread(target=lambda: queued.append(
        c.completions.create(model=NAME, prompt="queued", max_tokens=2, extra_body=NO_EOS)))
    t.start()
    try:
        assert wait_until(lambda: sched.stats()["waiting"] == 1)
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=NAME, prompt="one too many", max_tokens=2)
        assert e.value.response.headers["retry-after"] == "1"
    finally:
        first.close()
        t.join(20)
    assert queued and queued[0].usage.completion_tokens == 2  # the queued one ran once the slot was free


def test_disconnect_mid_stream_frees_the_slot(narrow):
    sched = narrow.state.scheduler
    assert wait_until(lambda: sched.stats()["active"] == 0)
    finished, cancelled = sched.finished, sched.cancelled
    body = {"model": NAME, "prompt": "long", "max_tokens": 60, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", narrow.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert sched.stats()["active"] == 1
    assert wait_until(lambda: sched.stats()["active"] == 0)
    # freed by the disconnect (counted as cancelled), not by running to its end (60 steps of >= 30 ms)
    assert sched.cancelled == cancelled + 1 and sched.finished == finished


def test_request_timeout_answers_504(narrow):
    with pytest.raises(openai.InternalServerError) as e:  # the client's class for any 5xx
        # 120 steps of >= 30 ms cannot finish within the 3 s timeout
        client(narrow, key=KEY).completions.create(model=NAME, prompt="slow", max_tokens=120, extra_body=NO_EOS)
    assert e.value.status_code == 504 and "timed out" in str(e.value)
    assert wait_until(lambda: narrow.state.scheduler.stats()["active"] == 0)


def test_server_text_equals_the_single_request_engine(server, model, tok):
    """The same prompt through `tinyformer generate`'s engine (one request, its own cache) and through the
    server (continuous batching, a slot of the shared cache): equal text, greedy and seeded sampling."""
    from tinyformer.generation.generator import Generator
    from tinyformer.generation.sampling import SamplingParams

    engine = Generator(model, tok)
    engine.eos_token_id = None  # exactly max_new_tokens, like ignore_eos
    c = client(server)
    for params in (dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=11)):
        expected = engine.generate(["A prompt"], SamplingParams(max_new_tokens=30, **params))[0].text
        got = c.completions.create(model=NAME, prompt="A prompt", max_tokens=30, extra_body=NO_EOS, **params)
        assert got.choices[0].text == expected
