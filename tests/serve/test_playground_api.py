"""What the playground reads of the server: POST /apply-template (the exact prompt of a chat completion), GET
/props, and the page's static files, over real HTTP.

The rendered prompt is compared with jinja2 rendering the template itself and with what the chat endpoint
feeds: the same token count in its usage, and, greedy, the same reply as /v1/completions of that text.
"""

from __future__ import annotations

import string

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
jinja2 = pytest.importorskip("jinja2")

from serve_helpers import BackgroundServer  # noqa: E402

from tinyformer.config import ModelConfig  # noqa: E402
from tinyformer.data.tokenizer import build_tokenizer  # noqa: E402
from tinyformer.models.decoder import DecoderLM  # noqa: E402
from tinyformer.models.encoder import EncoderModel  # noqa: E402
from tinyformer.serve.app import create_app  # noqa: E402

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}[assistant]{% endif %}"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": [{"type": "text", "text": "Why?"}]}]


def decoder(template: str | None) -> tuple[DecoderLM, object]:
    tok = build_tokenizer("char", string.printable)
    tok.chat_template = template
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=1, n_head=2, max_seq_len=128,
                                  init_std=0.3)).eval()
    return model, tok


@pytest.fixture(scope="module")
def templated():
    model, tok = decoder(TEMPLATE)
    with BackgroundServer(create_app(model, tok, model_name="m")) as srv:
        yield srv, tok


def test_apply_template_is_the_prompt_the_chat_completion_feeds(templated):
    srv, tok = templated
    parts = [{**m, "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]}
             for m in MESSAGES]
    want = jinja2.Template(TEMPLATE).render(messages=parts, add_generation_prompt=True)
    got = httpx.post(srv.url + "/apply-template", json={"messages": MESSAGES})
    assert got.status_code == 200 and got.json() == {"prompt": want}
    tokens = httpx.post(srv.url + "/tokenize", json={"content": want, "add_special": False}).json()["tokens"]
    assert tokens == tok.encode(want, add_special_tokens=False)

    greedy = {"model": "m", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    chat = httpx.post(srv.url + "/v1/chat/completions", json={**greedy, "messages": MESSAGES}).json()
    assert chat["usage"]["prompt_tokens"] == len(tokens)
    text = httpx.post(srv.url + "/v1/completions", json={**greedy, "prompt": tokens}).json()["choices"][0]["text"]
    assert chat["choices"][0]["message"]["content"] == text


def test_apply_template_rejects_what_the_chat_endpoint_rejects(templated):
    srv, _ = templated
    for body, param in (({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "x"}]},
                                                         "messages.0.role"), ({}, "messages")):
        r = httpx.post(srv.url + "/apply-template", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_props_name_the_arch_context_and_chat_format():
    for template, fmt in ((TEMPLATE, "jinja"), (None, "plain")):
        model, tok = decoder(template)
        with BackgroundServer(create_app(model, tok, model_name="m", max_len=100)) as srv:
            props = httpx.get(srv.url + "/props").json()
            prompt = httpx.post(srv.url + "/apply-template", json={"messages": MESSAGES[1:2]}).json()["prompt"]
        assert props == {"model": "m", "arch": "decoder", "context_length": 100, "chat_format": fmt,
                         "chat_template": template}
        if template is None:  # plain turns, as tinyformer chat writes them for a base model
            assert prompt == "User: Hello there\nAssistant:"

    tok = build_tokenizer("char", string.ascii_lowercase + " ")
    from tinyformer.presets import get_preset

    cfg = get_preset("bert-base", vocab_size=tok.vocab_size, d_model=16, n_layer=1, n_head=2, d_ff=32, max_seq_len=24)
    with BackgroundServer(create_app(EncoderModel(cfg).eval(), tok, model_name="e")) as srv:
        props = httpx.get(srv.url + "/props").json()
        page = httpx.get(srv.url + "/")
    assert props == {"model": "e", "arch": "encoder", "context_length": 24, "chat_format": None, "chat_template": None}
    assert page.status_code == 200 and "/static/playground.js" in page.text


def test_the_page_and_its_files_are_served_and_nothing_else_is(templated):
    srv, _ = templated
    page = httpx.get(srv.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name, kind in (("playground.js", "text/javascript"), ("playground.css", "text/css")):
        r = httpx.get(f"{srv.url}/static/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and f"/static/{name}" in page.text
    for name in ("index.htm", "..%2Fapp.py", "__init__.py"):
        assert httpx.get(f"{srv.url}/static/{name}").status_code == 404
    # no resource from elsewhere: every src/href of the page is this server's own (or an inline data: URI)
    import re

    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert refs and all(r.startswith("/") or r.startswith("data:") for r in refs), refs
    js = httpx.get(srv.url + "/static/playground.js").text
    assert not re.search(r"https?://", js)
