"""Speculative decoding in the server: with continuous batching and the prefix cache, every greedy completion
equals plain greedy decoding of its prompt alone (``Generator``); the request body's ``"speculative"`` field."""

from __future__ import annotations

import string
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

httpx = pytest.importorskip("httpx")

from serve_helpers import BackgroundServer  # noqa: E402

from tinyformer.config import ModelConfig  # noqa: E402
from tinyformer.data.tokenizer import build_tokenizer  # noqa: E402
from tinyformer.generation.generator import Generator  # noqa: E402
from tinyformer.generation.sampling import SamplingParams  # noqa: E402
from tinyformer.generation.speculative import SpeculativeConfig  # noqa: E402
from tinyformer.models.decoder import DecoderLM  # noqa: E402
from tinyformer.serve.app import create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "m"
# prompts that repeat themselves (prompt lookup finds drafts), of different lengths; the last two continue
# the first, so their prefixes come from the prefix cache once the first has finished
TEXTS = ["abcdefgh abcdefgh abcdefgh abcdefgh abcd", "the cat sat. the cat", "xyz xyz xy",
         "0123456789 0123456789 012345"]


@pytest.fixture(scope="module")
def model_and_tok():
    tok = build_tokenizer("char", string.printable)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=160,
                      init_std=0.3)
    return DecoderLM(cfg).eval(), tok


def plain_greedy(model, tok, prompt_ids: list[int], n: int) -> list[int]:
    gen = Generator(model, tok)
    gen.eos_token_id = None
    return gen.generate([prompt_ids], SamplingParams(temperature=0, max_new_tokens=n))[0].token_ids


def completion_ids(srv, prompt_ids: list[int], n: int, **extra) -> list[int]:
    """The completion's token ids, read back from its logprobs' token pieces (one per token)."""
    body = {"model": NAME, "prompt": prompt_ids, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, **extra}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    server = srv.app.state.server
    ids = {server.token_text(i): i for i in range(server.vocab_size)}
    return [ids[t] for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def test_speculative_server_equals_plain_greedy_with_continuous_batching_and_prefix_cache(model_and_tok):
    model, tok = model_and_tok
    prompts = [tok.encode(t) for t in TEXTS]
    n = 30
    expected = [plain_greedy(model, tok, p, n) for p in prompts]
    # min_ngram=1: this random model seldom repeats two characters, so the default would keep no draft
    app = create_app(model, tok, model_name=NAME, max_batch=3, prefix_cache_mb=1, prefill_chunk=16,
                     speculative=SpeculativeConfig("ngram", draft_tokens=4, min_ngram=1))
    with BackgroundServer(app) as srv:
        first = completion_ids(srv, prompts[0], n)
        with ThreadPoolExecutor(4) as pool:  # more requests than slots: they join as others finish
            got = list(pool.map(lambda p: completion_ids(srv, p, n), prompts + [prompts[0]]))
        # continues the first prompt and its completion: its prefix comes from the prefix cache
        longer = prompts[0] + expected[0] + prompts[2]
        cont = completion_ids(srv, longer, n)
        off = completion_ids(srv, prompts[1], n, speculative=False)
        mine = completion_ids(srv, prompts[3], n, speculative={"method": "ngram", "draft_tokens": 2})
        engine = app.state.server.scheduler.engine
    assert first == expected[0]
    assert got == expected + [expected[0]]
    assert cont == plain_greedy(model, tok, longer, n)
    assert off == expected[1] and mine == expected[3]
    assert engine.prefix_cache is not None and engine.prefix_cache.stats.hits > 0
    assert engine.draft_proposed > engine.draft_accepted > 0


def test_speculative_request_field_errors_are_400_naming_the_field(model_and_tok):
    model, tok = model_and_tok
    app = create_app(model, tok, model_name=NAME, max_batch=1, speculative=SpeculativeConfig("ngram", 4))
    body = {"model": NAME, "prompt": "abc", "max_tokens": 3}
    with BackgroundServer(app) as srv:
        for spec, words in (({"method": "draft"}, "needs a server started with --draft-model"),
                            ({"method": "ngram", "draft_tokens": 9}, "at most 4"),
                            ({"method": "ngram", "draft_tokens": 0}, "draft_tokens"),
                            ({"method": "beam"}, "method")):
            r = httpx.post(srv.url + "/v1/completions", json={**body, "speculative": spec}, timeout=30)
            assert r.status_code == 400, (spec, r.text)
            assert words in r.json()["error"]["message"], r.text
