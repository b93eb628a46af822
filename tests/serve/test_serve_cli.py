"""`tinyformer serve` as a user runs it: starts, answers, stops; mistakes are one-line errors."""

from __future__ import annotations

import json
import re
import signal
import socket
import string
import subprocess
import sys
import urllib.request

import pytest

from tinyformer.cli.main import main
from tinyformer.config import ModelConfig
from tinyformer.data.tokenizer import build_tokenizer
from tinyformer.models.decoder import DecoderLM
from tinyformer.run_folder import save_model


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("serve_cli_run")
    tok = build_tokenizer("char", string.printable)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=1, n_head=2, max_seq_len=64)
    save_model(run, DecoderLM(cfg))
    tok.save(run)
    return run


def test_serve_starts_answers_and_stops(run_dir, cli_env):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinyformer", "serve", "--model", str(run_dir), "--port", "0", "--max-batch", "2",
         "--model-name", "m", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env)
    try:
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = f"http://127.0.0.1:{match.group(1)}"
        body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            answer = json.load(r)
        assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            assert json.load(r)["max_batch"] == 2
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0


def test_missing_run_folder_is_a_one_line_error(tmp_path, capsys):
    pytest.importorskip("fastapi")
    assert main(["serve", "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not exist" in err and "\n" not in err


def test_taken_port_is_a_one_line_error(run_dir, capsys):
    pytest.importorskip("fastapi")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--model", str(run_dir), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"cannot listen on 127.0.0.1:{port}" in err and "\n" not in err


def test_without_the_serve_extra_only_serve_fails_and_names_it(run_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # makes `import fastapi` raise ImportError
    assert main(["count", "--preset", "tiny", "--json"]) == 0  # the rest of the CLI is unaffected
    capsys.readouterr()
    assert main(["serve", "--model", str(run_dir)]) == 2
    assert "pip install 'tinyformer[serve]'" in capsys.readouterr().err
