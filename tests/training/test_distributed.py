"""Distributed training on CPU (gloo, 2 processes): DDP and FSDP updates equal one process accumulating
gradients, ranks read disjoint data shards, checkpoints move between world sizes, `--nproc` launches a
real run, and a rank that fails ends the job instead of hanging it.

Run as a script, this file is also the worker those tests start:
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/training/test_distributed.py train OUT
    python tests/training/test_distributed.py fail OUT          (launches 2 ranks itself; rank 1 raises at step 2)
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tinyformer.config import ModelConfig
from tinyformer.training.objectives import Objective
from tinyformer.training.train_config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
MODEL = ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, d_ff=64, max_seq_len=16)
MODEL_DROPOUT = MODEL.replace(dropout=0.2)
B, T = 4, 16
LAUNCH_TIMEOUT_S = 240  # a bound on a hang; the jobs take ~10-30 s even on a loaded machine


class SeededBatches(Objective):
    """Language modelling on random token sequences, laid out so that data parallelism is checkable.

    Every call draws ``world_size`` seeds from the sampler stream and builds the batch from seed[rank].
    All ranks share that stream (same seed, same draws), so update t's micro-batch k is the same
    tensor whether it is rank k's (W ranks, 1 micro-step) or micro-step k of one process (1 rank,
    W micro-steps): ``randint`` of W values reads the stream exactly as W draws of one value.
    """

    name = "seeded"
    uses_corpus = False

    def __init__(self, cfg: TrainConfig, fail_rank: int | None = None, fail_step: int | None = None) -> None:
        super().__init__(cfg, None, None)  # type: ignore[arg-type]
        self.fail_rank, self.fail_step, self.calls = fail_rank, fail_step, 0

    def get_batch(self, split, generator, rank=0, world_size=1):
        self.calls += 1
        if rank == self.fail_rank and self.calls == self.fail_step:
            raise RuntimeError(f"injected failure on rank {rank} at step {self.calls}")
        seeds = torch.randint(0, 2**31 - 1, (world_size,), generator=generator)
        x = torch.randint(0, MODEL.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(int(seeds[rank])))
        return {"input_ids": x[:, :-1], "targets": x[:, 1:]}

    def loss(self, model, batch):
        # model.loss, not forward: DDP and FSDP must treat it as a forward pass for gradients to sync
        return model.loss(batch["input_ids"], batch["targets"])


def train_config(**changes) -> TrainConfig:
    # decay_steps is fixed so that runs of different lengths share one learning-rate schedule
    base = dict(batch_size=B, block_size=T, lr=1e-2, warmup_steps=1, decay_steps=20, device="cpu", dtype="float32",
                threads=1, seed=7, log_interval=1, eval_interval=1000, sample_tokens=0, tensorboard=False,
                progress=False)
    return TrainConfig(**{**base, **changes})


def make_trainer(run_dir: Path, model_cfg: ModelConfig = MODEL, rank: int = 0, world_size: int = 1,
                 objective_args: dict | None = None, **changes):
    from tinyformer.training.trainer import Trainer

    cfg = train_config(**changes)
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer(model_cfg, cfg, SeededBatches(cfg, **(objective_args or {})), run_dir, rank=rank,
                   world_size=world_size)


# ---------------------------------------------------------------------------- the worker (under torchrun)


def worker_train(out: Path) -> None:
    """The 2-rank halves of the tests below; rank 0 writes what they compare."""
    from safetensors.torch import save_file

    from tinyformer.training.distributed import barrier, full_model_state, init_distributed

    ctx = init_distributed()
    rank, world = ctx.rank, ctx.world_size
    # DDP, 3 updates of 1 micro-batch per rank
    make_trainer(out / "ddp", rank=rank, world_size=world, max_steps=3, parallel="ddp").fit()
    # FSDP, 4 updates, checkpoints at 3 and 4
    make_trainer(out / "fsdp", rank=rank, world_size=world, max_steps=4, checkpoint_interval=3,
                 parallel="fsdp", peak_flops=1e9).fit()
    barrier()
    # a 1-process checkpoint (step 3) resumed by 2 ranks: record the weights as loaded, then one more update
    trainer = make_trainer(out / "single_then_2", rank=rank, world_size=world, max_steps=4, checkpoint_interval=3,
                           parallel="ddp")
    trainer.restore(out / "single_then_2" / "state" / "step-000003")
    loaded = full_model_state(trainer.model)
    if rank == 0:
        save_file(loaded, str(out / "loaded_by_2.safetensors"))
    trainer.fit()
    barrier()
    # same world size, with dropout (per-rank random streams): 4 updates straight, and 2 + resume + 2
    make_trainer(out / "straight", MODEL_DROPOUT, rank=rank, world_size=world, max_steps=4, checkpoint_interval=2,
                 parallel="fsdp").fit()
    barrier()
    resumed = make_trainer(out / "resumed", MODEL_DROPOUT, rank=rank, world_size=world, max_steps=4,
                           checkpoint_interval=2, parallel="fsdp")
    resumed.restore(out / "straight" / "state" / "step-000002")
    resumed.fit()
    barrier()


def _fail_entry(args: argparse.Namespace) -> None:
    from tinyformer.training.distributed import init_distributed

    ctx = init_distributed()
    make_trainer(Path(args.out), rank=ctx.rank, world_size=ctx.world_size, max_steps=6,
                 objective_args={"fail_rank": 1, "fail_step": 2}).fit()


def worker_fail(out: Path) -> int:
    from tinyformer.training.distributed import launch

    return launch(2, argparse.Namespace(out=str(out)), target=_fail_entry)


# ---------------------------------------------------------------------------- helpers


def weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def losses(run: Path) -> dict[int, float]:
    from tinyformer.training.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"}


def dist_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_NUM_THREADS="1", TINYFORMER_DIST_TIMEOUT="60")
    return env


def run_job(cmd: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=dist_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    return proc, time.perf_counter() - t0


# ---------------------------------------------------------------------------- tests


def test_data_shards_of_ranks_are_disjoint_and_cover_the_split() -> None:
    from tinyformer.data.dataset import TokenDataset
    from tinyformer.training.objectives.lm import CausalLM

    n, block = 240, 8
    dataset = TokenDataset(np.arange(n, dtype=np.int64), val_fraction=0.0)  # token value = its position
    for world in (2, 3):
        seen: list[set[int]] = []
        for rank in range(world):
            cfg = TrainConfig(batch_size=8, block_size=block, sample_tokens=0)
            objective = CausalLM(cfg, None, dataset)  # type: ignore[arg-type]
            generator = torch.Generator().manual_seed(rank)
            tokens: set[int] = set()
            for _ in range(100):
                batch = objective.get_batch("train", generator, rank, world)
                tokens.update(batch["input_ids"].flatten().tolist() + batch["targets"].flatten().tolist())
            seen.append(tokens)
        for r in range(world):
            for q in range(r + 1, world):
                assert not seen[r] & seen[q], f"ranks {r} and {q} of {world} share tokens"
        assert set().union(*seen) == set(range(n))


def test_two_processes_equal_one_with_gradient_accumulation_and_checkpoints_cross_world_sizes(tmp_path: Path) -> None:
    """DDP and FSDP with 2 ranks x 1 micro-batch = 1 process x 2 micro-batches (to 1e-6 in float32);
    checkpoints go 2 -> 1 and 1 -> 2 ranks with the weights loaded exactly and the losses continuing;
    a same-world-size resume with dropout is bit-exact."""
    # the 1-process reference: 4 updates of 2 accumulated micro-batches, checkpoints at 3 and 4
    single = tmp_path / "single"
    make_trainer(single, grad_accum=2, max_steps=4, checkpoint_interval=3).fit()
    shutil.copytree(single, tmp_path / "single_then_2")
    shutil.rmtree(tmp_path / "single_then_2" / "state" / "step-000004")

    proc, _ = run_job([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                       str(Path(__file__)), "train", str(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]

    step3, step4 = (weights(single / "state" / f"step-00000{s}" / "model.safetensors") for s in (3, 4))
    ref_losses = losses(single)
    # data parallelism = gradient accumulation
    assert max_diff(weights(tmp_path / "ddp" / "model.safetensors"), step3) < 1e-6
    assert max_diff(weights(tmp_path / "fsdp" / "model.safetensors"), step4) < 1e-6
    assert max_diff(weights(tmp_path / "fsdp" / "state" / "step-000003" / "model.safetensors"), step3) < 1e-6
    fsdp_losses = losses(tmp_path / "fsdp")
    assert sorted(fsdp_losses) == [1, 2, 3, 4]
    for step, loss in ref_losses.items():
        assert math.isclose(fsdp_losses[step], loss, rel_tol=1e-5), step
    from tinyformer.training.metrics import read_metrics

    records = [r for r in read_metrics(tmp_path / "fsdp" / "metrics.jsonl") if r["kind"] == "train"]
    assert records[-1]["tokens"] == 4 * 2 * B * T  # global tokens: 4 updates x 2 ranks x B x T
    # MFU compares the global FLOP rate with the peak of both devices (--peak-flops is per device)
    from tinyformer.sizing import training_flops_per_token

    for r in records:
        assert r["flops_per_s"] == pytest.approx(r["tokens_per_s"] * training_flops_per_token(MODEL, T))
        assert r["mfu"] == pytest.approx(r["flops_per_s"] / (2 * 1e9))

    # 1 -> 2 ranks: weights loaded exactly, and the next update matches the 1-process run's
    assert max_diff(weights(tmp_path / "loaded_by_2.safetensors"), step3) == 0.0
    assert max_diff(weights(tmp_path / "single_then_2" / "model.safetensors"), step4) < 1e-6
    assert math.isclose(losses(tmp_path / "single_then_2")[4], ref_losses[4], rel_tol=1e-5)

    # 2 -> 1 rank: the FSDP run's consolidated step-3 checkpoint continues in one process
    trainer = make_trainer(tmp_path / "fsdp_then_1", grad_accum=2, max_steps=4)
    saved = weights(tmp_path / "fsdp" / "state" / "step-000003" / "model.safetensors")
    trainer.restore(tmp_path / "fsdp" / "state" / "step-000003")
    own = trainer.model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in saved.items())
    trainer.fit()
    assert max_diff(weights(tmp_path / "fsdp_then_1" / "model.safetensors"),
                    weights(tmp_path / "fsdp" / "model.safetensors")) < 1e-6
    assert math.isclose(losses(tmp_path / "fsdp_then_1")[4], fsdp_losses[4], rel_tol=1e-5)

    # same world size, dropout on: resuming at step 2 reproduces the straight run bit for bit
    straight, resumed = (weights(tmp_path / d / "model.safetensors") for d in ("straight", "resumed"))
    assert max_diff(straight, resumed) == 0.0
    assert losses(tmp_path / "straight")[4] == losses(tmp_path / "resumed")[4]


def test_nproc_launches_a_two_rank_run_that_one_process_resumes(tmp_path: Path, monkeypatch) -> None:
    from tinyformer.training.runner import RunSpec, prepare_distributed_run

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog;\n" * 300, encoding="utf-8")
    run = tmp_path / "run"
    args = ["--data", str(corpus), "--tokenizer", "char", "--out", str(run), "--model.d_model", "32",
            "--model.n_layer", "1", "--model.n_head", "2", "--model.d_ff", "64", "--model.max_seq_len", "32",
            "--batch-size", "4", "--block-size", "32", "--warmup-steps", "2", "--lr", "1e-2", "--eval-iters", "2",
            "--sample-tokens", "8", "--no-progress", "--log-interval", "1", "--eval-interval", "4", "--threads", "1",
            "--train.tensorboard", "false"]
    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path / "cache"))  # read by the launched job and this process
    proc, _ = run_job([sys.executable, "-m", "tinyformer", "train", "--nproc", "2", "--steps", "4", *args], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("run folder:") == 2, proc.stdout  # rank 0 alone prints (first and last line)
    assert "2 processes (ddp)" in proc.stdout
    first = losses(run)
    assert sorted(first) == [1, 2, 3, 4]
    from tinyformer.training.metrics import read_metrics

    train_records = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["tokens"] for r in train_records] == [s * 2 * 4 * 32 for s in (1, 2, 3, 4)]  # global counts

    prepared = prepare_distributed_run(RunSpec(out=str(run), resume=True, train_overrides={"max_steps": 6}))
    trainer = prepared.trainer
    assert trainer.world_size == 1 and trainer.step == 4
    saved = weights(run / "state" / "step-000004" / "model.safetensors")
    own = trainer.model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in saved.items())
    trainer.fit()
    after = losses(run)
    assert sorted(after) == [1, 2, 3, 4, 5, 6] and all(after[s] == first[s] for s in (1, 2, 3, 4))
    # training continues from where it stopped: no jump back towards the untrained loss
    assert abs(after[5] - first[4]) < 0.15 * first[4] and after[5] < first[1]


def test_a_failing_rank_ends_the_job_with_its_error(tmp_path: Path) -> None:
    proc, seconds = run_job([sys.executable, str(Path(__file__)), "fail", str(tmp_path / "run")], tmp_path)
    assert proc.returncode != 0
    assert "injected failure on rank 1 at step 2" in proc.stderr
    assert "rank 1 of 2 failed" in proc.stderr
    assert seconds < LAUNCH_TIMEOUT_S


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    if scenario == "train":
        worker_train(out_dir)
    elif scenario == "fail":
        raise SystemExit(worker_fail(out_dir))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
