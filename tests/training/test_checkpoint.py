"""Checkpoints: optimizer/RNG state round trips, atomic writes, pruning, and exact resume after kill -9."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tinyformer.config import ModelConfig
from tinyformer.errors import CheckpointError
from tinyformer.models import build_model
from tinyformer.training import checkpoint as ckpt
from tinyformer.training.optim import build_optimizer
from tinyformer.training.train_config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
CFG = ModelConfig(vocab_size=40, d_model=32, n_layer=1, n_head=2, d_ff=64, max_seq_len=16)


def _trained(steps: int = 3, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = build_model(CFG)
    opt = build_optimizer(model, TrainConfig(lr=1e-2), "cpu")
    for _ in range(steps):
        x = torch.randint(0, CFG.vocab_size, (2, 8))
        model.loss(x, x).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_optimizer_state_round_trips_through_safetensors_and_json() -> None:
    model, opt = _trained()
    tensors, meta = ckpt.optimizer_to_tensors(opt.state_dict())
    restored = ckpt.optimizer_from_tensors(load_file_roundtrip(tensors), meta)
    model2 = build_model(CFG)
    model2.load_state_dict(model.state_dict())
    opt2 = build_optimizer(model2, TrainConfig(lr=1e-2), "cpu")
    opt2.load_state_dict(restored)
    # one more identical step on both gives bit-identical weights
    x = torch.randint(0, CFG.vocab_size, (2, 8))
    for m, o in ((model, opt), (model2, opt2)):
        m.loss(x, x).backward()
        o.step()
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name
    assert restored["param_groups"][0]["betas"] == opt.param_groups[0]["betas"]


def load_file_roundtrip(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load, save

    return load(save(tensors))


def test_rng_capture_and_restore_replays_every_stream() -> None:
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    tensors, meta = ckpt.capture_rng(gen)
    tensors = load_file_roundtrip(tensors)
    first = (torch.rand(4), torch.randint(0, 100, (4,), generator=gen), np.random.rand(3), random.random())
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    gen.manual_seed(99)
    ckpt.restore_rng(tensors, meta, gen)
    again = (torch.rand(4), torch.randint(0, 100, (4,), generator=gen), np.random.rand(3), random.random())
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert np.array_equal(first[2], again[2]) and first[3] == again[3]


def test_save_is_complete_and_keeps_only_the_last_n(tmp_path: Path) -> None:
    model, opt = _trained()
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, model, opt, {"tokens_seen": step}, None, keep_last=2)
    assert [s for s, _ in ckpt.step_dirs(tmp_path)] == [2, 3]
    assert not [p for p in (tmp_path / "state").iterdir() if p.name.startswith(".")]
    model2, opt2 = _trained(steps=0, seed=1)
    state = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path), model2, opt2, None)
    assert state["step"] == 3 and state["tokens_seen"] == 3
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)


def test_full_disk_leaves_previous_checkpoint_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _trained()
    ckpt.save_checkpoint(tmp_path, 1, model, opt, {}, None, keep_last=1)
    before = {p.name: p.read_bytes() for p in (tmp_path / "state" / "step-000001").iterdir()}
    real = ckpt.write_tensors
    calls = []

    def full_disk(path: Path, tensors: dict) -> None:
        calls.append(path)
        if len(calls) == 2:  # the optimizer file of the new checkpoint
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, tensors)

    monkeypatch.setattr(ckpt, "write_tensors", full_disk)
    with pytest.raises(CheckpointError, match="no space left on device.*step-000001 is intact"):
        ckpt.save_checkpoint(tmp_path, 2, model, opt, {}, None, keep_last=1)
    assert [s for s, _ in ckpt.step_dirs(tmp_path)] == [1]
    assert not [p for p in (tmp_path / "state").iterdir() if p.name.startswith(".")]
    after = {p.name: p.read_bytes() for p in (tmp_path / "state" / "step-000001").iterdir()}
    assert after == before


def test_loading_a_checkpoint_of_another_shape_is_a_clear_error(tmp_path: Path) -> None:
    model, opt = _trained()
    ckpt.save_checkpoint(tmp_path, 1, model, opt, {}, None, keep_last=1)
    other = build_model(CFG.replace(d_model=64))
    other_opt = build_optimizer(other, TrainConfig(), "cpu")
    with pytest.raises(CheckpointError, match="does not match this model's config"):
        ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path), other, other_opt, None)


# ---------------------------------------------------------------------------- exact resume after SIGKILL

TRAIN_ARGS = [
    "--tokenizer", "char", "--model.d_model", "32", "--model.n_layer", "2", "--model.n_head", "2",
    "--model.d_ff", "64", "--model.max_seq_len", "32", "--model.dropout", "0.1", "--batch-size", "4",
    "--block-size", "32", "--steps", "400", "--warmup-steps", "10", "--lr", "3e-3", "--eval-interval", "20",
    "--eval-iters", "2", "--sample-tokens", "8", "--threads", "1", "--no-progress", "--seed", "7",
    # the first checkpoint early (step 20), so that on a fast idle machine the kill still lands mid-run
    "--checkpoint-interval", "20",
]


def _train_cmd(data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tinyformer", "train", "--data", str(data), "--out", str(out), *TRAIN_ARGS, *extra]


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["TINYFORMER_CACHE"] = str(tmp_path / "cache")
    return env


def test_resume_after_sigkill_mid_run_gives_bit_identical_weights(tmp_path: Path) -> None:
    text = (ROOT.parent / "shared/data/tinyshakespeare/input.txt")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text.read_text(encoding="utf-8")[:30000] if text.is_file() else
                      "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(800)))
    env = _env(tmp_path)
    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run(_train_cmd(corpus, full), env=env, check=True, capture_output=True, timeout=300)

    interrupted_at = sigkill_after_first_checkpoint(_train_cmd(corpus, killed), env, killed, 0.25, seed=1234)
    assert 0 < interrupted_at < 400

    resumed = subprocess.run(_train_cmd(corpus, killed, "--resume"), env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"(step {interrupted_at})" in resumed.stdout  # it continued, it did not start over

    a, b = load_file(full / "model.safetensors"), load_file(killed / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert_same_optimizer_moments(full, killed)  # so training could go on identically


def sigkill_after_first_checkpoint(cmd: list[str], env: dict[str, str], run: Path, max_delay: float,
                                   seed: int) -> int:
    """Start the training command ``cmd``, SIGKILL it at a random moment (up to ``max_delay`` s) after its
    first checkpoint in ``run``; returns the step of the last checkpoint it completed."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not ckpt.step_dirs(run) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(random.Random(seed).uniform(0.0, max_delay))  # somewhere after the first checkpoint, mid-step
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed: make it longer"
    return ckpt.step_dirs(run)[-1][0]


def assert_same_optimizer_moments(run_a: Path, run_b: Path) -> None:
    """The optimizer state of the latest checkpoints of two runs is bit-identical."""
    oa = load_file(ckpt.latest_checkpoint(run_a) / "optimizer.safetensors")
    ob = load_file(ckpt.latest_checkpoint(run_b) / "optimizer.safetensors")
    for name in oa:
        if name.startswith("optim."):
            assert torch.equal(oa[name], ob[name]), name
