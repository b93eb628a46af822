"""Server limits and local-only safety: the body cap answers 413 before reading the body, and without an API
key the server refuses cross-site browser requests and (bound to loopback) foreign Host names."""

from __future__ import annotations

import json
import socket
import string
import time

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from serve_helpers import BackgroundServer  # noqa: E402

from tinyformer.config import ModelConfig  # noqa: E402
from tinyformer.data.tokenizer import build_tokenizer  # noqa: E402
from tinyformer.models.decoder import DecoderLM  # noqa: E402
from tinyformer.serve.app import create_app  # noqa: E402
from tinyformer.serve.guard import RequestGuard, is_loopback_host  # noqa: E402

NAME = "guarded"
LIMIT = 4096


def make_app(**kwargs):
    tok = build_tokenizer("char", string.printable)
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layer=1, n_head=2, d_ff=32,
                                  max_seq_len=64)).eval()
    return create_app(model, tok, model_name=NAME, max_body_bytes=LIMIT, **kwargs)


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(make_app()) as srv:
        yield srv


@pytest.fixture(scope="module")
def keyed_server():
    with BackgroundServer(make_app(api_key="k")) as srv:
        yield srv


BODY = json.dumps({"model": NAME, "prompt": "ab", "max_tokens": 2, "temperature": 0})


def post(srv, body: str = BODY, **headers: str) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", content=body, headers=headers, timeout=30)


def test_a_declared_oversize_body_gets_413_before_it_is_sent(server):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        # the headers announce 100 MB; not one byte of the body is sent, so a server that reads it first hangs
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {100 * 2**20}\r\n\r\n".encode())
        started = time.monotonic()
        data = b""
        while chunk := sock.recv(65536):  # the server closes the connection after its answer
            data += chunk
        reply = data.decode("latin-1")
    assert reply.startswith("HTTP/1.1 413"), reply
    assert time.monotonic() - started < 5
    assert json.loads(reply.split("\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"


def test_a_chunked_oversize_body_is_cut_off_at_the_limit(server):
    sent = 0

    def chunks():
        nonlocal sent
        for _ in range(64):  # 64 KiB in 1 KiB chunks, no Content-Length
            sent += 1024
            yield b"x" * 1024

    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=30)
    assert r.status_code == 413, r.text


def test_a_body_within_the_limit_is_served(server):
    assert len(BODY) < LIMIT
    r = post(server)
    assert r.status_code == 200, r.text


def test_a_foreign_host_name_is_refused_on_loopback(server):
    r = post(server, Host="evil.example")  # a DNS-rebinding page: its name, our address
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_host"
    port = server.url.rsplit(":", 1)[1]
    assert post(server, Host=f"localhost:{port}").status_code == 200


def test_a_cross_site_text_plain_post_is_refused(server):
    r = post(server, Origin="http://evil.example", **{"Content-Type": "text/plain"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_origin"
    r = post(server, **{"Sec-Fetch-Site": "cross-site", "Content-Type": "text/plain"})
    assert r.status_code == 403


def test_the_servers_own_pages_and_loopback_origins_are_served(server):
    assert post(server, Origin=server.url).status_code == 200  # the playground at /
    assert post(server, Origin="http://localhost:3000").status_code == 200


def test_with_an_api_key_the_key_is_the_check(keyed_server):
    r = post(keyed_server, Origin="http://evil.example", Authorization="Bearer k")
    assert r.status_code == 200, r.text
    assert post(keyed_server, Origin="http://evil.example").status_code == 401


def test_bound_to_all_interfaces_names_pass_but_foreign_origins_do_not():
    guard = RequestGuard(None, local_only=True, bound_to_loopback=is_loopback_host("0.0.0.0"),
                         allowed_origins=["http://app.example:3000"])
    assert guard.refusal({"host": "box.lan:8000"}) is None
    assert guard.refusal({"host": "box.lan:8000", "origin": "http://box.lan:8000"}) is None
    assert guard.refusal({"host": "box.lan:8000", "origin": "http://app.example:3000"}) is None
    assert guard.refusal({"host": "box.lan:8000", "origin": "http://localhost:8000"}).status == 403
    assert guard.refusal({"host": "box.lan:8000", "origin": "null"}).status == 403


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True),
                                            ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                            ("192.168.1.5", False), ("localhost.evil.example", False)])
def test_loopback_hosts(host, loopback):
    assert is_loopback_host(host) is loopback
