"""Crash trials: interrupt `tinyformer train` at random moments, resume it, compare with an uninterrupted run.

Each trial starts a real training process, interrupts it at a time drawn uniformly over the reference
run's life (from the moment its run folder appears to its exit: tokenizer, steps, evaluations,
checkpoints and the final publishing all included), then runs ``train --resume`` (or, when the run was stopped
before its first step and so removed its folder, the original command) and compares the run folder
with the reference:

    kill -9         SIGKILL, no chance to clean up
    Ctrl-C          one SIGINT: the run must exit with code 130 after checkpointing its current step (or,
                    the run complete, exit 0 when the signal came during the last step, or die of SIGINT
                    with nothing on stderr when it came while Python was exiting: its finalization
                    restores the default action)
    Ctrl-C twice    two SIGINTs 50 ms apart: the second must end the process at once (< 2 s)

A trial passes when, after the resume, ``model.safetensors`` is byte-identical to the reference's,
``metrics.jsonl`` holds the same records (timing fields aside: tokens_per_s, flops_per_s, mfu, time),
the run's weights match its manifest, and ``loss.png`` was drawn when matplotlib is installed. The
checkpoint interval (7) is a multiple of neither the log (3) nor the evaluation interval (10), so a
resume lands inside the running averages' windows.

    python benchmarks/crash_trials.py                     # 6 kills, 3 Ctrl-C, 2 double Ctrl-C (a few minutes)
    python benchmarks/crash_trials.py --kills 20 --seed 1
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
TRAIN_ARGS = [
    "--tokenizer", "char", "--model.d_model", "32", "--model.n_layer", "2", "--model.n_head", "2",
    "--model.d_ff", "64", "--model.max_seq_len", "32", "--model.dropout", "0.1", "--batch-size", "4",
    "--block-size", "32", "--steps", "150", "--warmup-steps", "10", "--lr", "3e-3", "--log-interval", "3",
    "--eval-interval", "10", "--checkpoint-interval", "7", "--keep-last", "2", "--eval-iters", "2",
    "--sample-tokens", "8", "--threads", "1", "--no-progress", "--seed", "7",
]
TIMING = ("tokens_per_s", "flops_per_s", "mfu", "time")


def train_cmd(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tinyformer", "train", "--data", str(corpus), "--out", str(out), *TRAIN_ARGS,
            *extra]


def env_for(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["TINYFORMER_CACHE"] = str(cache)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def started(run: Path) -> bool:
    """The run folder exists (it appears complete, in one rename, just before training starts)."""
    return (run / "train.yaml").is_file()


def timed_run(cmd: list[str], env: dict[str, str], run: Path) -> float:
    """Run to completion; seconds from the run folder's appearance to the exit."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while not started(run) and proc.poll() is None:
        time.sleep(0.005)
    t0 = time.monotonic()
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"the reference run failed: {err.strip()}")
    return time.monotonic() - t0


def interrupt(cmd: list[str], env: dict[str, str], run: Path, delay: float, kind: str) -> tuple[int | None, float]:
    """Start a run, wait ``delay`` s after its folder appears, interrupt it; (exit code, seconds from the last
    signal to the exit). The exit code is None when the run finished before the interruption."""
    log = open(run.parent / "stderr.txt", "w")  # noqa: SIM115 - closed below, after the process ends
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
    while not started(run) and proc.poll() is None:
        time.sleep(0.005)
    time.sleep(delay)
    if proc.poll() is not None:
        log.close()
        return None, 0.0
    if kind == "kill":
        proc.send_signal(signal.SIGKILL)
    elif kind == "sigint":
        proc.send_signal(signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    proc.wait(timeout=120)
    log.close()
    return proc.returncode, time.monotonic() - t0


def complete(run: Path) -> bool:
    """The run's latest checkpoint is its last step."""
    from tinyformer.training.checkpoint import step_dirs

    steps = [s for s, _ in step_dirs(run)]
    return bool(steps) and steps[-1] == int(TRAIN_ARGS[TRAIN_ARGS.index("--steps") + 1])


def records(run: Path) -> list[dict]:
    from tinyformer.training.metrics import read_metrics

    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(run / "metrics.jsonl")]


def same_as(run: Path, ref: Path) -> str | None:
    """None when ``run`` matches the reference; else what differs."""
    from tinyformer.errors import CheckpointError
    from tinyformer.run_folder import checked_weight_files

    if (run / "model.safetensors").read_bytes() != (ref / "model.safetensors").read_bytes():
        return "weights differ"
    if records(run) != records(ref):
        return "metrics.jsonl differs"
    try:
        checked_weight_files(run)
    except CheckpointError as exc:
        return f"manifest: {exc}"
    if (ref / "loss.png").is_file() and not (run / "loss.png").is_file():
        return "no loss.png"
    return None


def trial(kind: str, corpus: Path, env: dict[str, str], ref: Path, work: Path, delay: float) -> tuple[bool, str]:
    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)
    cmd = train_cmd(corpus, run)
    code, exit_s = interrupt(cmd, env, run, delay, kind)
    note = f"{kind} at +{delay:.2f}s: "
    if code is None:
        note += "finished first; "
    elif kind == "sigint" and code == 0 and complete(run):
        note += "signal during the last step, the run completed (exit 0); "
    elif kind == "sigint" and code == -signal.SIGINT and complete(run) and not (work / "stderr.txt").read_text():
        # the run had finished and Python was exiting: finalization restores the default SIGINT action
        note += "signal after the run completed, while Python exited (killed by SIGINT); "
    elif kind == "sigint" and code != 130:
        said = (work / "stderr.txt").read_text().strip().replace("\n", " / ")
        return False, note + f"exit code {code}, expected 130; stderr: {said[-300:]}"
    elif kind == "double" and exit_s > 2.0:
        return False, note + f"the second Ctrl-C took {exit_s:.1f} s to end the process"
    else:
        note += f"exit {code}; "
    again = train_cmd(corpus, run, "--resume")
    if not run.exists():  # stopped before the first step: the run removed its files; start it again
        note += "nothing trained, run folder removed, started again; "
        again = cmd
    for _ in range(3):  # a resume interrupted by nothing should succeed at once
        done = subprocess.run(again, env=env, capture_output=True, text=True)
        if done.returncode == 0:
            break
    else:
        return False, note + f"resume failed: {done.stderr.strip()}"
    diff = same_as(run, ref)
    return diff is None, note + (diff or "identical")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=6, help="kill -9 trials (default 6)")
    p.add_argument("--sigints", type=int, default=3, help="single Ctrl-C trials (default 3)")
    p.add_argument("--doubles", type=int, default=2, help="double Ctrl-C trials (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the interruption times")
    p.add_argument("--verbose", action="store_true", help="print one line per trial")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="crash-trials-") as tmp:
        work = Path(tmp)
        corpus = work / "corpus.txt"
        corpus.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:30000] if SHAKESPEARE.is_file() else
                          "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(800)))
        env = env_for(work / "cache")
        ref = work / "reference"
        life = timed_run(train_cmd(corpus, ref), env, ref)
        rows = []
        started_at = time.monotonic()
        for kind, n, what in (("kill", args.kills, "`kill -9` at a random time, then `--resume`"),
                              ("sigint", args.sigints, "Ctrl-C (SIGINT) at a random time: exit 130, then `--resume`"),
                              ("double", args.doubles, "Ctrl-C twice, 50 ms apart: ends at once (< 2 s), then "
                                                       "`--resume`")):
            ok = hit = 0
            for _ in range(n):
                passed, note = trial(kind, corpus, env, ref, work, rng.uniform(0.0, life))
                ok += passed
                hit += "finished first" not in note
                if args.verbose or not passed:
                    print(("pass  " if passed else "FAIL  ") + note, file=sys.stderr)
            rows.append((what, ok, n, hit))
        elapsed = time.monotonic() - started_at
    load = os.getloadavg()
    print(f"command: python benchmarks/crash_trials.py --kills {args.kills} --sigints {args.sigints} "
          f"--doubles {args.doubles} --seed {args.seed}")
    print(f"reference run: {life:.1f} s from its run folder's appearance to its exit; trials took {elapsed:.0f} s; "
          f"load average {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} (a shared, loaded machine)")
    print()
    print("| trial (then: weights and metrics.jsonl identical to an uninterrupted run) | passed | still running "
          "when interrupted |")
    print("|---|---|---|")
    for what, ok, n, hit in rows:
        print(f"| {what} | {ok}/{n} | {hit}/{n} |")


if __name__ == "__main__":
    main()
