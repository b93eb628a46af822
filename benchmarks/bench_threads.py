"""Training speed on a busy machine: torch's old default threads vs tinyformer's load-based choice.

Runs the default model (``tinyformer train``, tiny preset, built-in corpus, BPE) for ``--steps`` steps in
a fresh process per setting, while ``--busy`` CPU-bound processes (``while True: pass``) compete for the
cores, and reports the seconds of training the command itself prints ("done: N steps ... in X s of
training"; tokenizer training and data preparation are excluded):

    old   one thread per core, spinning OpenMP waits (OMP_WAIT_POLICY=ACTIVE, --threads = cores):
          torch's behaviour before utils/threads.py
    new   no flags: OMP_WAIT_POLICY=PASSIVE and threads = idle cores by the load average

The settings alternate (old, new, old, new, ...) for ``--repeats`` rounds so that a change in the
machine's load hits both alike; the 1-minute load average is printed next to each run.

    python benchmarks/bench_threads.py                       # 20 steps, 1 busy process, 2 rounds
    python benchmarks/bench_threads.py --busy 0 --repeats 1  # the idle-machine case
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_train(steps: int, env: dict[str, str], extra: list[str], out: Path) -> float:
    cmd = [sys.executable, "-m", "tinyformer", "train", "--steps", str(steps), "--eval-interval", "100000",
           "--sample-tokens", "0", "--no-progress", "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    match = re.search(r"in ([0-9.]+) s of training", proc.stdout)
    if proc.returncode != 0 or not match:
        raise SystemExit(f"train failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--busy", type=int, default=1, help="CPU-bound processes running alongside")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    base["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + base.get("PYTHONPATH", "")
    settings = {
        "old": ({**base, "OMP_WAIT_POLICY": "ACTIVE"}, ["--threads", str(cores)]),
        "new": (base, []),
    }
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    results: dict[str, list[float]] = {name: [] for name in settings}
    print(f"{cores} cores, {args.busy} busy process(es), {args.steps} steps of the default model per run")
    print(f"{'round':>5} {'setting':>7} {'load (1 min)':>12} {'seconds':>8}")
    try:
        time.sleep(2 if busy else 0)
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.repeats):
                for name, (env, extra) in settings.items():
                    load = os.getloadavg()[0]
                    seconds = run_train(args.steps, env, extra, Path(tmp) / f"{name}-{r}")
                    results[name].append(seconds)
                    print(f"{r + 1:>5} {name:>7} {load:>12.2f} {seconds:>8.1f}", flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    old, new = (sum(results[k]) / len(results[k]) for k in ("old", "new"))
    print(f"mean: old {old:.1f} s, new {new:.1f} s, old/new = {old / new:.2f}x")


if __name__ == "__main__":
    main()
