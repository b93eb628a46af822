"""`tinyformer serve` against hostile and unlucky clients, as a real process on a loopback port: sampler
values that overflow, prompts past the context, bodies over the cap, slow and idle sockets, SIGTERM
with streams open. Every loop here is bounded by a deadline or a count."""

from __future__ import annotations

import json
import re
import signal
import socket
import string
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tinyformer.config import ModelConfig
from tinyformer.data.tokenizer import build_tokenizer
from tinyformer.models.decoder import DecoderLM
from tinyformer.run_folder import save_model

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

CONTEXT = 2048


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("serve_faults_run")
    tok = build_tokenizer("char", string.printable)
    # large enough that 8 streams of CONTEXT tokens, two at a time, take seconds: SIGTERM finds them open
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=128, n_layer=4, n_head=4, max_seq_len=CONTEXT)
    save_model(run, DecoderLM(cfg))
    tok.save(run)
    return run


class ServeProcess:
    """`tinyformer serve --port 0 ...` in a subprocess; ``url`` once it prints its address."""

    def __init__(self, run_dir, cli_env, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tinyformer", "serve", "--model", str(run_dir), "--port", "0", "--model-name", "m",
             "--log-level", "warning", "--threads", "1", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env)
        line = self.proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        if not match:
            self.stop()
            raise AssertionError((line, self.proc.stderr.read()))
        self.port = int(match.group(1))
        self.url = f"http://127.0.0.1:{self.port}"

    def post(self, path: str, body: dict, timeout: float = 30) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as exc:
            return exc.code, json.load(exc)

    def health(self, timeout: float = 5) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=timeout) as r:
            return json.load(r)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def module_env():
    """conftest's cli_env, for the module-scoped server."""
    import os
    from pathlib import Path

    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["HF_HUB_OFFLINE"] = "1"
    return env


@pytest.fixture(scope="module")
def served(run_dir, module_env):
    srv = ServeProcess(run_dir, module_env, "--max-body-bytes", "100000", "--header-timeout", "1",
                       "--max-connections", "16")
    yield srv
    assert srv.stop() == 0


# ---------------------------------------------------------------------------- sampler values and context


@pytest.mark.parametrize("field,value", [("repetition_penalty", 1e-308), ("repetition_penalty", 1e308),
                                         ("temperature", 1e-308)])
def test_sampler_values_that_overflow_the_logits_are_a_400_naming_the_field(served, field, value):
    status, body = served.post("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 4, field: value})
    assert status == 400, body
    assert field in body["error"]["message"]


def test_a_prompt_past_the_context_is_told_the_limit(served):
    status, body = served.post("/v1/completions", {"model": "m", "prompt": [5] * 10_000, "max_tokens": 4})
    message = body["error"]["message"]
    assert status == 400
    assert f"maximum context length is {CONTEXT} tokens" in message
    assert f"at most {CONTEXT - 1} tokens" in message
    assert not re.search(r"-\d", message), message  # no negative count "for the completion"


# ---------------------------------------------------------------------------- the 413 reaches the client


def _read_all(sock: socket.socket, deadline: float) -> bytes:
    data = b""
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data + b"<reset>"
        if not chunk:
            break
        data += chunk
    return data


def test_the_413_reaches_a_client_still_uploading(served):
    """The client sends its head, then its body after the server has answered: without a lingering close
    the server's close resets the connection and the client never reads the answer."""
    size = 8 * 2**20
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {size}\r\n\r\n".encode())
            time.sleep(0.3)  # the answer is sent now, before a byte of the body
            sock.sendall(b" " * size)  # a reset here is what the client library reports instead of the 413
            answer = _read_all(sock, time.monotonic() + 15)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b"Request body too large" in answer


def test_the_openai_client_reports_the_413(served):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="-", max_retries=0, timeout=30)
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model="m", prompt="x" * 5_000_000, max_tokens=1)
    assert caught.value.status_code == 413


# ---------------------------------------------------------------------------- slow and idle clients


def test_a_slow_header_is_timed_out(served):
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
        start = time.monotonic()
        closed = False
        for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n":  # one byte per 0.2 s: 8 s in all
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            sock.settimeout(0.2)
            try:
                answer = sock.recv(1024)  # the 408, or b"" once closed
            except TimeoutError:
                continue
            except ConnectionResetError:
                answer = b""
            assert answer in (b"",) or answer.startswith(b"HTTP/1.1 408"), answer
            closed = True
            break
        assert closed, "the server kept a connection that never finished its request head"
        assert time.monotonic() - start < 5  # --header-timeout 1


def test_health_answers_while_more_idle_sockets_are_open_than_the_cap(served):
    idle = []
    try:
        for _ in range(40):  # --max-connections 16
            idle.append(socket.create_connection(("127.0.0.1", served.port), timeout=10))
            idle[-1].sendall(b"GET /hea")  # never finished
        assert served.health()["status"] == "ok"
        status, body = served.post("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})
        assert status == 200, body
    finally:
        for sock in idle:
            sock.close()


# ---------------------------------------------------------------------------- SIGTERM with streams open


def _stream(url: str, results: list, ended: list, index: int) -> None:
    body = json.dumps({"model": "m", "prompt": "a", "max_tokens": CONTEXT - 2, "ignore_eos": True,
                       "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    events: list[str] = []
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    events.append(line[6:])
        results[index] = events
        ended[index] = time.monotonic()
    except Exception as exc:  # a cut chunked body: http.client.IncompleteRead, a reset
        results[index] = f"{type(exc).__name__}: {exc}"


def test_sigterm_ends_every_stream_with_a_final_event_and_exits_0(run_dir, cli_env):
    srv = ServeProcess(run_dir, cli_env, "--max-batch", "2", "--max-queue", "8", "--shutdown-timeout", "3")
    n = 8
    results: list = [None] * n
    ended: list = [None] * n
    threads = [threading.Thread(target=_stream, args=(srv.url, results, ended, i), daemon=True) for i in range(n)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and srv.health()["waiting"] + srv.health()["active"] < n:
            time.sleep(0.05)
        assert srv.health()["waiting"] > 0  # some streams still queued, two running
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(30)
        for t in threads:
            t.join(15)
    finally:
        srv.stop()
    assert srv.proc.returncode == 0  # not killed by the signal
    # every stream ended within --shutdown-timeout 3 (the interpreter's own exit comes on top: seconds on a
    # loaded machine, so it is not timed here)
    assert max(t - start for t in ended if t is not None) < 3 + 0.5, ended
    for events in results:
        assert isinstance(events, list), events
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        assert "error" in last or last["choices"][0]["finish_reason"] in ("stop", "length"), last
