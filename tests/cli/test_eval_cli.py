"""`tinyformer eval`: loss, perplexity and bits per byte against a direct computation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tinyformer.cli.main import main
from tinyformer.run_folder import load_model, load_tokenizer


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("eval")
    corpus = root / "train.txt"
    corpus.write_text("".join(f"Line {i}: the cat sat on the mat; héllo wörld.\n" for i in range(300)))
    mp = pytest.MonkeyPatch()
    mp.setenv("TINYFORMER_CACHE", str(root / "cache"))
    threads = torch.get_num_threads()
    try:
        code = main(["train", "--data", str(corpus), "--tokenizer", "bpe", "--vocab-size", "300", "--out",
                     str(root / "run"), "--steps", "20", "--lr", "1e-2", "--model.d_model", "32", "--model.n_layer",
                     "1", "--model.n_head", "2", "--model.n_kv_head", "2", "--model.d_ff", "64",
                     "--model.max_seq_len", "64", "--block-size", "16", "--batch-size", "4", "--threads", "1",
                     "--sample-tokens", "0", "--no-progress"])
    finally:
        torch.set_num_threads(threads)
        mp.undo()
    assert code == 0
    return root / "run"


def test_eval_json_matches_a_direct_computation(run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path / "cache"))
    text = "".join(f"Another {i} text: the mat sat on the cat, wörld.\n" for i in range(40))
    data = tmp_path / "held_out.txt"
    data.write_text(text, encoding="utf-8")
    assert main(["eval", "--model", str(run), "--data", str(data), "--batch-size", "3", "--json",
                 "--no-progress"]) == 0
    result = json.loads(capsys.readouterr().out)

    # independent: encode the text directly, cut windows of T + 1 tokens by hand, sum the NLL in float64
    model, tok = load_model(run).double(), load_tokenizer(run)
    ids = tok.encode(text)
    T = 16  # the run's training block size, which eval uses by default
    nll, count, nbytes = 0.0, 0, 0
    for start in range(0, len(ids) - T, T):
        window = torch.tensor(ids[start : start + T + 1])
        with torch.no_grad():
            logits = model(window[None, :-1])[0]
        nll += F.cross_entropy(logits, window[1:], reduction="sum").item()
        count += T
        nbytes += len(b"".join(map(tok.token_bytes, window[1:].tolist())))
    assert result["tokens"] == count and result["block_size"] == T
    assert result["loss"] == pytest.approx(nll / count, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert result["bits_per_byte"] == pytest.approx(nll / math.log(2) / nbytes, rel=1e-5)


def test_eval_prints_a_readable_line(run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "t.txt"
    data.write_text("the cat sat on the mat\n" * 30)
    assert main(["eval", "--model", str(run), "--data", str(data), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "loss" in out and "perplexity" in out and "bits/byte" in out


@pytest.mark.parametrize(
    "args, message",
    [(["--data", "{d}/missing.txt"], "does not exist"),
     (["--data", "{d}/short.txt"], "too few for one window"),
     (["--data", "{d}/ok.txt", "--block-size", "65"], "must be in [1, max_seq_len=64]"),
     (["--data", "{d}/ok.txt", "--model", "{d}/norun"], "does not exist")],
)
def test_eval_bad_input_is_one_line_exit_2(args: list[str], message: str, run: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path / "cache"))
    (tmp_path / "short.txt").write_text("hi")
    (tmp_path / "ok.txt").write_text("the cat sat on the mat\n" * 30)
    args = [a.replace("{d}", str(tmp_path)) for a in args]
    model = [] if "--model" in args else ["--model", str(run)]
    assert main(["eval", *model, *args, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("mode", ["chat", "preference", "reward", "text"])
def test_a_batch_size_below_one_is_one_line_in_every_eval_mode(run: Path, tmp_path: Path, mode: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    rows = {"chat": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cat"}]},
            "preference": {"prompt": "hi", "chosen": "the cat", "rejected": "the mat"},
            "reward": {"prompt": "hi", "answer": "the cat"}}
    data = tmp_path / ("train.txt" if mode == "text" else f"{mode}.jsonl")
    data.write_text("the cat sat\n" if mode == "text" else json.dumps(rows[mode]) + "\n")
    argv = ["eval", "--model", str(run), "--data", str(data), "--batch-size", "0", "--no-report"]
    if mode == "reward":
        argv += ["--reward", "builtin:exact", "--max-new-tokens", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines() == ["tinyformer eval: error: --batch-size must be "
                                                                   "positive, got 0"]
