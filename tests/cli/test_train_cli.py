"""`tinyformer train` end to end on tiny models: run folder, data sources, configs, fine-tuning, bad input."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from tinyformer.cli.main import main
from tinyformer.data.tokenizer import Tokenizer
from tinyformer.run_folder import load_model, load_tokenizer
from tinyformer.training import checkpoint as ckpt
from tinyformer.training.metrics import read_metrics
from tinyformer.training.objectives.lm import CausalLM

TINY = ["--model.d_model", "32", "--model.n_layer", "1", "--model.n_head", "2", "--model.n_kv_head", "2",
        "--model.d_ff", "64", "--threads", "1",
        "--model.max_seq_len", "32", "--batch-size", "4", "--block-size", "32", "--warmup-steps", "2",
        "--eval-iters", "2", "--sample-tokens", "16", "--no-progress"]


@pytest.fixture(autouse=True)
def _token_cache_and_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # --threads 1 (fast for tiny models) must not leak into other tests


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    lines = [f"The {a} cat sat on the {b} mat, and the dog ran {c}.\n" for a in ("big", "small", "red", "old")
             for b in ("blue", "green", "warm") for c in ("away", "home", "fast", "far", "out")]
    path = tmp_path / "corpus.txt"
    path.write_text("".join(lines * 6), encoding="utf-8")
    return path


def train(*args: str) -> int:
    return main(["train", *TINY, *args])


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err


# ---------------------------------------------------------------------------- a normal run


def test_run_folder_holds_a_loadable_model_that_learnt(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train("--data", str(corpus), "--tokenizer", "char", "--out", str(run), "--steps", "60", "--lr", "1e-2",
                 "--eval-interval", "20", "--keep-last", "2") == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "train.yaml", "metrics.jsonl",
                 "samples.txt", "loss.png"):
        assert (run / name).is_file(), name
    assert [s for s, _ in ckpt.step_dirs(run)] == [40, 60]
    model, tok = load_model(run), load_tokenizer(run)
    assert tok.kind == "char" and model.cfg.vocab_size == tok.vocab_size
    # a model that learnt the corpus beats the uniform guess ln(V) by far
    text = corpus.read_text()
    ids = torch.tensor([tok.encode(text[:33])])
    with torch.no_grad():
        loss = model.loss(ids[:, :-1], ids[:, 1:]).item()
    assert loss < math.log(tok.vocab_size) - 1.0
    evals = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [20, 40, 60]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert evals[-1]["val_ppl"] == pytest.approx(math.exp(evals[-1]["val_loss"]))
    assert (run / "samples.txt").read_text().count("===== step") == 3


@pytest.mark.parametrize("kind", ["folder", "glob", "jsonl"])
def test_data_can_be_a_folder_a_glob_or_jsonl(kind: str, corpus: Path, tmp_path: Path) -> None:
    text = corpus.read_text()
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"part{i}.txt").write_text(text[i::3], encoding="utf-8")
    (docs / "skip.bin").write_bytes(b"\xff\xfe")  # not .txt/.md: ignored in a folder
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("".join(json.dumps({"body": text[i * 500:(i + 1) * 500], "id": i}) + "\n" for i in range(8)))
    source = {"folder": [str(docs)], "glob": [str(docs / "part*.txt")], "jsonl": [str(jsonl), "--text-field", "body"]}
    run = tmp_path / "run"
    assert train("--data", *source[kind], "--tokenizer", "char", "--out", str(run), "--steps", "2") == 0
    tok = load_tokenizer(run)
    assert set(tok.decode(range(3, tok.vocab_size))) == set(text[: 4000 if kind == "jsonl" else None])


def test_bpe_tokenizer_gets_the_asked_vocab_size(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train("--data", str(corpus), "--tokenizer", "bpe", "--vocab-size", "300", "--out", str(run),
                 "--steps", "2") == 0
    tok = Tokenizer.load(run / "tokenizer.json")
    assert tok.kind == "bpe" and tok.vocab_size == 300
    assert json.loads((run / "config.json").read_text())["vocab_size"] == 300
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)


def test_config_file_then_set_then_flags_take_precedence(corpus: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  preset: tiny\n  n_layer: 3\ntrain:\n  lr: 0.002\n  weight_decay: 0.05\n"
                   "  seed: 11\n  max_steps: 2\n")
    run = tmp_path / "run"
    assert train("--config", str(cfg), "--data", str(corpus), "--tokenizer", "char", "--out", str(run),
                 "--set", "train.weight_decay=0.01", "--set", "train.lr=5e-3", "--lr", "4e-3",
                 "--set", "model.n_layer=1", "--model.n_head", "4") == 0
    import yaml

    saved = yaml.safe_load((run / "train.yaml").read_text())
    assert saved["train"]["lr"] == 4e-3  # flag beats --set beats file
    assert saved["train"]["weight_decay"] == 0.01  # --set beats file
    assert saved["train"]["seed"] == 11  # file beats default
    assert saved["model"]["n_layer"] == 1 and saved["model"]["n_head"] == 4 and saved["model"]["d_model"] == 32
    assert saved["train"]["block_size"] == 32  # resolved and written down


def test_toml_config_is_accepted(corpus: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text('[model]\npreset = "tiny"\n\n[train]\nmax_steps = 2\ntokenizer = "char"\n')
    assert train("--config", str(cfg), "--data", str(corpus), "--out", str(tmp_path / "run")) == 0


def test_init_from_starts_with_the_other_runs_weights_and_tokenizer(corpus: Path, tmp_path: Path) -> None:
    from tinyformer.training.runner import RunSpec, prepare_run

    base = tmp_path / "base"
    assert train("--data", str(corpus), "--tokenizer", "char", "--out", str(base), "--steps", "5") == 0
    spec = RunSpec(train_overrides={"data": str(corpus), "init_from": str(base), "max_steps": 3,
                                    "progress": False, "sample_tokens": 0},
                   out=str(tmp_path / "tuned"))
    prepared = prepare_run(spec, log=lambda _: None)
    want = load_model(base).state_dict()
    for name, value in prepared.trainer.model.state_dict().items():
        assert torch.equal(value, want[name]), name
    assert prepared.tokenizer.to_json() == load_tokenizer(base).to_json()
    prepared.trainer.fit()
    assert (tmp_path / "tuned" / "model.safetensors").is_file()


def test_resume_of_a_finished_run_with_more_steps_continues(corpus: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert train("--data", str(corpus), "--tokenizer", "char", "--out", str(run), "--steps", "4",
                 "--eval-interval", "2") == 0
    assert main(["train", "--resume", str(run), "--steps", "6", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "resuming from" in out and "(step 4)" in out
    assert [s for s, _ in ckpt.step_dirs(run)] == [4, 6]


# ---------------------------------------------------------------------------- bad input: exit 2, one line


@pytest.mark.parametrize(
    "make, args, message",
    [
        (lambda d: None, ["--data", "{d}/missing.txt"], "does not exist"),
        (lambda d: (d / "empty.txt").write_text("  \n\n"), ["--data", "{d}/empty.txt"], "empty"),
        (lambda d: (d / "empty.txt").write_text(""), ["--data", "{d}/empty.txt", "--tokenizer", "bpe"], "empty"),
        (lambda d: (d / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1") * 50),
         ["--data", "{d}/latin1.txt"], "not UTF-8"),
        (lambda d: (d / "small.txt").write_text("tiny corpus " * 20),
         ["--data", "{d}/small.txt", "--tokenizer", "bpe", "--vocab-size", "5000"], "larger than this corpus"),
        (lambda d: (d / "ok.txt").write_text("hello world " * 100),
         ["--data", "{d}/ok.txt", "--block-size", "64"], "above the model's max_seq_len 32"),
        (lambda d: (d / "ok.txt").write_text("hello world " * 5),
         ["--data", "{d}/ok.txt"], "too few for block_size"),
        (lambda d: None, ["--objective", "nope"], "unknown objective 'nope'; known objectives: clm"),
        (lambda d: None, ["--set", "train.lr=-1"], "train.lr must be a positive number"),
        (lambda d: None, ["--set", "train.learning_rate=1"], "train.learning_rate is not a field"),
        (lambda d: None, ["--preset", "gpt5"], "unknown preset"),
        pytest.param(lambda d: None, ["--dtype", "float16"], "needs a GPU",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="float16 is valid on a GPU")),
    ],
    ids=["missing", "empty-char", "empty-bpe", "not-utf8", "vocab-too-big", "block-too-long", "too-short",
         "objective", "bad-value", "bad-field", "bad-preset", "fp16-on-cpu"],
)
def test_bad_input_is_one_line_and_exit_2(make, args: list[str], message: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    make(tmp_path)
    args = [a.replace("{d}", str(tmp_path)) for a in args]
    if "--data" not in args:
        (tmp_path / "ok.txt").write_text("hello world " * 100)
        args += ["--data", str(tmp_path / "ok.txt")]
    assert train(*args, "--tokenizer" if "--tokenizer" not in args else "--seed",
                 "char" if "--tokenizer" not in args else "1", "--out", str(tmp_path / "run"), "--steps", "2") == 2
    assert message in one_line_error(capsys)
    assert not (tmp_path / "run" / "state").exists()


def test_existing_run_folder_is_not_overwritten_without_force(corpus: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert train("--data", str(corpus), "--tokenizer", "char", "--out", str(run), "--steps", "2") == 0
    (run / "notes.txt").write_text("mine")
    before = tree_digest(run)
    assert train("--data", str(corpus), "--tokenizer", "char", "--out", str(run), "--steps", "3") == 2
    assert "already exists and is not empty" in one_line_error(capsys)
    assert tree_digest(run) == before
    assert train("--data", str(corpus), "--tokenizer", "char", "--out", str(run), "--steps", "3", "--force") == 0
    assert (run / "notes.txt").read_text() == "mine"  # --force removes run files only
    assert [s for s, _ in ckpt.step_dirs(run)] == [3]


def test_resume_with_another_config_is_refused_and_changes_nothing(corpus: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert train("--data", str(corpus), "--tokenizer", "char", "--out", str(run), "--steps", "2") == 0
    capsys.readouterr()
    before = tree_digest(run)
    assert main(["train", "--resume", str(run), "--model.d_model", "64", "--no-progress"]) == 2
    assert "trained with model.d_model=32 but this run asks for 64" in one_line_error(capsys)
    assert main(["train", "--resume", str(run), "--lr", "0.5", "--no-progress"]) == 2
    assert "train.lr" in one_line_error(capsys)
    assert tree_digest(run) == before


def test_resume_with_a_checkpoint_from_another_model_is_refused(corpus: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    small, wide = tmp_path / "small", tmp_path / "wide"
    assert train("--data", str(corpus), "--tokenizer", "char", "--out", str(small), "--steps", "2") == 0
    assert train("--data", str(corpus), "--tokenizer", "char", "--out", str(wide), "--steps", "2",
                 "--model.d_model", "64") == 0
    capsys.readouterr()
    import shutil

    shutil.rmtree(small / "state")
    shutil.copytree(wide / "state", small / "state")  # a checkpoint that is not this run's
    assert main(["train", "--resume", str(small), "--steps", "4", "--no-progress"]) == 2
    assert "does not match this model's config" in one_line_error(capsys)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(corpus: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    real_loss = CausalLM.loss
    calls = {"train": 0}

    def loss_turns_nan(self, model, batch):
        loss = real_loss(self, model, batch)
        if model.training:
            calls["train"] += 1
            if calls["train"] == 5:  # the 5th update
                return loss * float("nan")
        return loss

    monkeypatch.setattr(CausalLM, "loss", loss_turns_nan)
    run = tmp_path / "run"
    assert train("--data", str(corpus), "--tokenizer", "char", "--out", str(run), "--steps", "10",
                 "--eval-interval", "2") == 2
    err = one_line_error(capsys)
    assert "loss is nan at step 5" in err and "step-000004" in err
    assert [s for s, _ in ckpt.step_dirs(run)] == [2, 4]
    model = load_model(run)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_full_disk_on_save_is_a_clear_error_and_keeps_the_previous_checkpoint(
        corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    real = ckpt.write_tensors
    calls = []

    def disk_fills_up(path, tensors):
        calls.append(path)
        if len(calls) > 2:  # the second checkpoint's first file
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, tensors)

    monkeypatch.setattr(ckpt, "write_tensors", disk_fills_up)
    run = tmp_path / "run"
    assert train("--data", str(corpus), "--tokenizer", "char", "--out", str(run), "--steps", "6",
                 "--eval-interval", "3") == 2
    err = one_line_error(capsys)
    assert "no space left on device" in err and "step-000003 is intact" in err
    assert [s for s, _ in ckpt.step_dirs(run)] == [3]
    assert not [p for p in (run / "state").iterdir() if p.name.startswith(".")]
    monkeypatch.setattr(ckpt, "write_tensors", real)
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0  # space is back: carry on
    assert [s for s, _ in ckpt.step_dirs(run)] == [3, 6]


def test_compiled_training_compiles_the_layers_and_keeps_the_fused_loss(corpus: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """--compile compiles each block in place: the loop calls the plain DecoderLM (so its loss is the fused
    head + cross-entropy, not full logits through a compiled forward), the losses equal eager training's
    and the saved weights have the same names and (nearly) the same values."""
    from tinyformer.models.decoder import DecoderLM

    fused_calls = []
    real_loss = DecoderLM.loss

    def counting_loss(self, *args, **kwargs):
        fused_calls.append(1)
        return real_loss(self, *args, **kwargs)

    monkeypatch.setattr(DecoderLM, "loss", counting_loss)
    args = ["--data", str(corpus), "--tokenizer", "char", "--steps", "3", "--eval-interval", "3",
            "--log-interval", "1", "--seed", "7"]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    assert train(*args, "--out", str(eager)) == 0
    eager_calls = len(fused_calls)
    assert train(*args, "--out", str(compiled), "--compile") == 0
    # every training and evaluation loss went through it (a whole compiled model would skip it in training)
    assert len(fused_calls) - eager_calls >= eager_calls
    def losses(run: Path) -> list[float]:
        return [r["loss"] if r["kind"] == "train" else r["val_loss"] for r in read_metrics(run / "metrics.jsonl")
                if r["kind"] in ("train", "eval")]

    want, got = losses(eager), losses(compiled)
    assert len(want) == 4 and got == pytest.approx(want, rel=1e-4)
    a, b = load_model(eager).state_dict(), load_model(compiled).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-3, atol=1e-5)
