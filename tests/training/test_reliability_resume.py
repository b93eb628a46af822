"""Crashes at precise points of `train`, then `--resume`: nothing stale, nothing lost, logs equal.

A ``kill -9`` is simulated by raising :class:`Crash` (a BaseException, which no ``except Exception``
catches) at the exact point of interest; the run folder is then in the state the kill would leave,
since every write before that point went to disk. The reference is always an uninterrupted run with
the same seed; one real subprocess run checks Ctrl-C end to end.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tinyformer.cli.main import main
from tinyformer.training import checkpoint as ckpt
from tinyformer.training import runner
from tinyformer.training.interrupt import stop_on_signals
from tinyformer.training.metrics import read_metrics
from tinyformer.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.d_model", "32", "--model.n_layer", "1", "--model.n_head", "2", "--model.n_kv_head", "2",
        "--model.d_ff", "64", "--model.max_seq_len", "32", "--batch-size", "4", "--block-size", "32",
        "--warmup-steps", "2", "--eval-iters", "2", "--sample-tokens", "8", "--no-progress", "--threads", "1",
        "--tokenizer", "char", "--seed", "3"]
#: what depends on the wall clock, not on the computation
TIMING = ("tokens_per_s", "flops_per_s", "mfu", "time")


class Crash(BaseException):
    """Stands for a kill -9 at the point where it is raised."""


@pytest.fixture(autouse=True)
def _cache_and_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    # The signal tests start from an interactive process's handlers, whatever started pytest (a background
    # job has SIGINT ignored, which training respects, and children inherit it).
    handlers = {sig: signal.signal(sig, h) for sig, h in
                ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL))}
    yield
    torch.set_num_threads(threads)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"The {a} cat sat on the {b} mat, then ran {c}.\n" for a in ("big", "red", "old")
                            for b in ("blue", "warm") for c in ("away", "home", "far")) * 8, encoding="utf-8")
    return path


def train(corpus: Path, out: Path, *args: str) -> int:
    return main(["train", "--data", str(corpus), "--out", str(out), *TINY, *args])


def resume(out: Path, *args: str) -> int:
    return main(["train", "--resume", str(out), "--no-progress", *args])


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def metrics(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(run / "metrics.jsonl")]


def crash_when(monkeypatch: pytest.MonkeyPatch, target: object, name: str, hit,
               exc: type[BaseException] = Crash) -> None:
    """Make ``target.name`` raise ``exc`` on the call for which ``hit(*args)`` is true."""
    real = getattr(target, name)

    def wrapper(*args, **kwargs):
        if hit(*args, **kwargs):
            raise exc(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, wrapper)


# ---------------------------------------------------------------------------- published files


def test_resume_republishes_weights_a_crash_left_stale(corpus: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    # killed after the last checkpoint is committed, before its weights reach the run folder
    crash_when(monkeypatch, shutil, "copyfile", lambda src, dst, **kw: "step-000004" in str(src))
    with pytest.raises(Crash):
        train(corpus, run, "--steps", "4", "--eval-interval", "2")
    monkeypatch.undo()
    final = run / "state/step-000004/model.safetensors"
    assert final.is_file() and (run / "model.safetensors").read_bytes() != final.read_bytes()
    assert not (run / "loss.png").exists()

    assert resume(run) == 0
    assert (run / "model.safetensors").read_bytes() == final.read_bytes()
    pytest.importorskip("matplotlib")
    assert (run / "loss.png").is_file()


def test_resume_restores_run_files_that_were_deleted(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train(corpus, run, "--steps", "2", "--eval-interval", "2") == 0
    names = ("config.json", "tokenizer.json", "tokenizer_config.json", "train.yaml", "model.safetensors",
             "manifest.json", "report.md")
    before = {n: (run / n).read_bytes() for n in names}
    for n in (*names, "loss.png"):
        (run / n).unlink()
    assert resume(run) == 0
    assert {n: (run / n).read_bytes() for n in names} == before
    assert (run / "loss.png").is_file()


# ---------------------------------------------------------------------------- a failed resume writes nothing


@pytest.mark.parametrize("damage, message", [
    (lambda run: (run / "state/step-000002/optimizer.safetensors").write_bytes(b"\0" * 100), "checksum"),
    (lambda run: (run / "state/step-000002/model.safetensors").open("r+b").write(b"\xff" * 9), "checksum"),
    (lambda run: (shutil.rmtree(run / "state"), (run / "state").write_text("oops")), "is not a folder"),
], ids=["truncated-optimizer", "flipped-weights", "state-is-a-file"])
def test_failed_resume_changes_nothing(damage, message: str, corpus: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert train(corpus, run, "--steps", "2", "--eval-interval", "2") == 0
    damage(run)
    capsys.readouterr()
    before = tree_digest(run)
    assert resume(run, "--steps", "4") == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert tree_digest(run) == before


# ---------------------------------------------------------------------------- run creation


def test_crash_while_creating_a_run_leaves_nothing_that_blocks_a_restart(corpus: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    # between the tokenizer and train.yaml
    crash_when(monkeypatch, runner, "to_yaml", lambda *a: True)
    with pytest.raises(Crash):
        train(corpus, run, "--steps", "2")
    monkeypatch.undo()
    # just before the staged folder is renamed into place
    crash_when(monkeypatch, os, "rename", lambda src, dst, *a, **k: Path(dst) == run)
    with pytest.raises(Crash):
        train(corpus, run, "--steps", "2")
    monkeypatch.undo()
    assert not run.exists()
    assert train(corpus, run, "--steps", "2") == 0  # no --force needed
    assert [s for s, _ in ckpt.step_dirs(run)] == [2]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".run.")) == []


# ---------------------------------------------------------------------------- logs


def test_metrics_of_a_resumed_run_equal_the_uninterrupted_runs(corpus: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["--steps", "11", "--log-interval", "3", "--eval-interval", "4", "--checkpoint-interval", "5"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert train(corpus, full, *args) == 0
    # killed during step 8: the last checkpoint (step 5) falls inside a log window and an eval window
    crash_when(monkeypatch, Trainer, "train_step", lambda self: self.step == 7)
    with pytest.raises(Crash):
        train(corpus, killed, *args)
    monkeypatch.undo()
    assert [s for s, _ in ckpt.step_dirs(killed)] == [5]
    assert resume(killed) == 0
    assert metrics(killed) == metrics(full)
    assert (killed / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()


# ---------------------------------------------------------------------------- pruning


def test_interrupted_pruning_leaves_no_step_folder_behind(corpus: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    real_rmtree = shutil.rmtree

    def dies_half_way(path, *args, **kwargs):
        path = Path(path)
        if "step-000002" in path.name and (path / ckpt.TRAINER_FILE).exists():
            (path / ckpt.TRAINER_FILE).unlink()  # the first file deleted, then the kill
            raise Crash("rmtree")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(ckpt.shutil, "rmtree", dies_half_way)
    with pytest.raises(Crash):
        train(corpus, run, "--steps", "4", "--eval-interval", "2", "--keep-last", "1")
    monkeypatch.undo()
    assert [s for s, _ in ckpt.step_dirs(run)] == [4]
    assert resume(run) == 0
    assert sorted(p.name for p in (run / "state").iterdir()) == ["step-000004"]


# ---------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_saves_the_current_step_and_resume_matches_an_uninterrupted_run(
        corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--steps", "8", "--eval-interval", "4", "--log-interval", "2"]
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    assert train(corpus, full, *args) == 0
    real = Trainer.train_step

    def ctrl_c_during_step_3(self):
        out = real(self)
        if self.step == 3:
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(Trainer, "train_step", ctrl_c_during_step_3)
    capsys.readouterr()
    assert train(corpus, stopped, *args) == 130
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert "stopped at step 3 of 8" in err and f"tinyformer train --resume {stopped}" in err
    assert [s for s, _ in ckpt.step_dirs(stopped)] == [3]  # not a checkpoint step: saved for the interrupt
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
    assert resume(stopped) == 0
    assert (stopped / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    assert metrics(stopped) == metrics(full)


def test_ctrl_c_before_the_first_step_leaves_no_run_folder(corpus: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    real = Trainer.fit

    def interrupted_at_once(self):
        signal.raise_signal(signal.SIGINT)
        return real(self)

    monkeypatch.setattr(Trainer, "fit", interrupted_at_once)
    run = tmp_path / "run"
    assert train(corpus, run, "--steps", "4") == 130
    assert "nothing was trained" in capsys.readouterr().err
    assert not run.exists()
    # earlier, while the trainer is being built (the run folder exists, the loop has not taken the signals)
    monkeypatch.undo()
    crash_when(monkeypatch, Trainer, "_flops_per_token", lambda self: True, exc=KeyboardInterrupt)
    assert train(corpus, run, "--steps", "4") == 130
    assert not run.exists()


def test_after_the_first_signal_a_second_one_takes_the_default_action() -> None:
    with stop_on_signals() as stop:
        assert not stop
        signal.raise_signal(signal.SIGTERM)
        assert stop.signal_name == "SIGTERM"
        # not caught any more: the kernel's default action ends the process at once
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_ignored_at_the_start_stays_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell starts a background job
    with stop_on_signals() as stop:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.raise_signal(signal.SIGINT)
        assert not stop
        signal.raise_signal(signal.SIGTERM)  # SIGTERM was not ignored: it is still caught
        assert stop.signal_name == "SIGTERM"
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_sigint_to_a_real_training_process_saves_and_says_how_to_resume(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tinyformer", "train", "--data", str(corpus), "--out", str(run), *TINY,
           "--steps", "100000", "--eval-interval", "50000", "--log-interval", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and len(read_metrics(run / "metrics.jsonl")) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    steps = [s for s, _ in ckpt.step_dirs(run)]
    assert len(steps) == 1 and steps[0] >= 3
    assert f"stopped at step {steps[0]} of 100000" in err and "--resume" in err
