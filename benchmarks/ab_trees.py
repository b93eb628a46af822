"""One benchmark script run in two source trees in alternation: an old commit against the new one, same session.

    git worktree add /tmp/old <commit>
    python benchmarks/ab_trees.py --old /tmp/old --new . --rounds 2 -- benchmarks/bench_decode.py --shapes stories15m

Each round runs the script of each tree (``TREE/<script> ARGS``, with ``PYTHONPATH=TREE/src`` and ``TREE`` as the
working directory), the order swapped every round (old, new; new, old; ...) so that drifting load and memory
bandwidth hit both alike. Before each run the load average is printed; then the run's own output, or with
``--grep`` only its lines that contain one of the given words. A run that fails prints its last lines of stderr
and stops the comparison with exit code 1.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def run_one(tree: Path, script: str, args: list[str], grep: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    load = os.getloadavg()
    print(f"--- {tree} ({time.strftime('%H:%M:%S')}, load average {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f})",
          flush=True)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(tree / script), *args], cwd=tree, env=env, capture_output=True,
                          text=True)
    for line in proc.stdout.splitlines():
        if not grep or any(word in line for word in grep):
            print(line)
    print(f"    ({time.monotonic() - started:.0f} s)", flush=True)
    if proc.returncode != 0:
        print("\n".join(proc.stderr.splitlines()[-15:]), file=sys.stderr)
        raise SystemExit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="the old source tree (a worktree of the old commit)")
    ap.add_argument("--new", type=Path, default=Path("."), help="the new source tree (default: this one)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--grep", nargs="*", default=[], help="print only the output lines holding one of these")
    ap.add_argument("script", help="the benchmark script, relative to each tree (e.g. benchmarks/bench_decode.py)")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (after --)")
    a = ap.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    trees = [a.old.resolve(), a.new.resolve()]
    for r in range(a.rounds):
        print(f"=== round {r + 1} of {a.rounds}: {' '.join([a.script, *args])}", flush=True)
        for tree in trees if r % 2 == 0 else trees[::-1]:
            run_one(tree, a.script, args, a.grep)


if __name__ == "__main__":
    main()
