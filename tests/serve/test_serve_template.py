"""serve renders chat templates off its event loop, under the template's limits: a request whose template
loops gets a 400 naming the limit, while /health and other requests keep answering."""

from __future__ import annotations

import string
import threading

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("jinja2")
httpx = pytest.importorskip("httpx")

from serve_helpers import BackgroundServer  # noqa: E402

from tinyformer.config import ModelConfig  # noqa: E402
from tinyformer.data.tokenizer import build_tokenizer  # noqa: E402
from tinyformer.models.decoder import DecoderLM  # noqa: E402
from tinyformer.serve.app import create_app  # noqa: E402

NAME = "tiny-test"
LOOPING = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def hostile_app():
    tok = build_tokenizer("char", string.printable)
    tok.chat_template = LOOPING
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=1, n_head=2, n_kv_head=1,
                                  max_seq_len=64)).eval()
    return create_app(model, tok, model_name=NAME, template_timeout=0.5)


def test_a_looping_template_gets_a_400_while_the_server_keeps_answering(hostile_app):
    server = hostile_app.state.server
    rendering, release = threading.Event(), threading.Event()
    real_render = server.template.render

    def render(*args, **kwargs):  # holds the render in its thread until the other requests were answered
        rendering.set()
        assert release.wait(60)
        return real_render(*args, **kwargs)

    server.template.render = render
    answer: dict = {}
    with BackgroundServer(hostile_app) as srv:
        def chat() -> None:
            answer["response"] = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
                "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})

        client = threading.Thread(target=chat)
        client.start()
        try:
            assert rendering.wait(30)
            # the chat request's template is rendering now; were it on the event loop, nothing would answer
            assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
            completion = httpx.post(srv.url + "/v1/completions", timeout=30,
                                    json={"model": NAME, "prompt": "hello", "max_tokens": 2, "temperature": 0})
            assert completion.status_code == 200 and completion.json()["choices"][0]["finish_reason"] == "length"
        finally:
            release.set()
            client.join(60)
    response = answer["response"]
    assert response.status_code == 400
    error = response.json()["error"]
    assert "ran past its time limit of 0.5 s" in error["message"] and error["param"] == "messages"
