"""Lines under src/ at three commits, read from git, with the files added for new features set apart.

Issue #25 ("one home per concept") asked that the package get smaller. Between the start of that
restructuring (acf3333) and its end (169d819) new features landed too, in files of their own; this
prints, for each commit, the Python and C++ lines under src/, the lines of those feature files, and
the rest ("same features"), so the restructuring can be compared with the package it started from.
Lines are every line of a file (blank lines, comments and docstrings included), as ``wc -l`` counts.

    python benchmarks/count_src_lines.py                       # acf3333, 169d819 and HEAD
    python benchmarks/count_src_lines.py --commits acf3333 HEAD
    python benchmarks/count_src_lines.py --growth 15            # also the 15 files that grew most
    python benchmarks/count_src_lines.py --commits acf3333 169d819 --by-commit   # who added the lines

``--by-commit`` sums main's first-parent commits as the restructuring (``RESTRUCTURING``), the clean-up after
it, and features and fixes (every commit before its end that is not in ``RESTRUCTURING``, and ``FEATURES_AFTER``
after it): restructuring + clean-up is what the restructuring did to the package's size, features apart.

Feature growth inside files that existed before (a new branch in engine.py, a new flag in a CLI
module) is not in the feature column: ``--growth`` lists the files that grew most, for a reader who
wants to look (paired across renames as ``git diff -M`` pairs them: generation/engine.py, renamed from
batch_engine.py onto an older file's name, is compared with that older engine.py). The script reads only
git objects, so it runs from any checkout that holds these commits (not a shallow clone).
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "src/tinyformer/"

#: Python files added after acf3333 for a new feature (not moved from an older file), and the feature.
FEATURE_FILES = {
    "generation/compile_cache.py": "compiled decoding, kernels cached on disk (6331f66)",
    "generation/constraint.py": "constrained decoding: JSON schema, regex, grammar (b413f84)",
    "generation/speculative.py": "speculative decoding (e7544b5)",
    "generation/token_pieces.py": "tinyformer tokenize (7896968)",
    "cli/tokenize.py": "tinyformer tokenize (7896968)",
    "serve/structured.py": "serve: response_format, tools (91c91be)",
    "serve/tokens_embeddings.py": "serve: /tokenize, /detokenize, /v1/embeddings (2e71254)",
    "serve/http_server.py": "serve: graceful shutdown, timeouts, connection cap (689ff45)",
    "training/objectives/grpo.py": "GRPO objective (80550b9)",
    "training/rewards.py": "GRPO program rewards (80550b9)",
    "evaluation/reward_scoring.py": "tinyformer eval --reward (e669114)",
}


#: The commits on main's first-parent line from acf3333 to 169d819 that restructured (moves, one home per
#: concept, no import cycles); every other commit of that range added a feature or fixed something.
RESTRUCTURING = {
    "2548f8d": "s-homes: objectives/, evaluation/, sizing/ and data/ homes",
    "88c18f0": "s-families: one folder per model family",
    "63fb5bb": "s-template: one ChatTemplate (its render limits included)",
    "634cf25": "s-model: one forward path, one KV cache object",
    "9c1fe88": "no import cycle in components/",
    "aaf55ea": "no import points up",
    "e5c39e4": "s-sampler: one sampler, one token loop for the searches",
    "6d69029": "families: one home for the pad id and the fixed-field check",
    "7bbdc08": "oneloop: the searches on BatchEngine, the one decode loop",
}

#: The end of the restructuring: commits after it are the clean-up that shrank the package, but for these,
#: which added a feature or a kernel (main's first-parent line; a merge counts its whole branch).
RESTRUCTURED = "169d819"
FEATURES_AFTER = {
    "690a597": "a CPU generator reads its weights into its own memory",
    "0b53bb3": "compiled speculative verification (spec-pkg)",
    "e2ba96d": "f32_linear: float32 decoding kernel",
    "2e3eee5": "prepare_for_decoding: the fp32 kernel's threshold",
    "6062a0c": "quant_kernels: a stale build lock is removed",
    "82efb5f": "train.compile compiles the objective's loss whole",
    "8516faf": "speculative verification bit for bit the steps (eager)",
    "3815df0": "speculative verification bit for bit the steps (packaged)",
    "9386436": "speculative decoding on an AVX-512 CPU",
    "296fe8b": "fix: MoE router losses under torchrun with --compile",
    "3257955": "fix: a corrupt adapter.safetensors is a CheckpointError",
    "4926b6b": "fix: count --config with an unknown field beside a preset",
    "7b33a46": "fix: speculative rows refuse sampled_logprobs",
}


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout


def line_counts(commit: str, suffix: str) -> dict[str, int]:
    """path under src/tinyformer/ -> its number of lines at ``commit``, for files ending in ``suffix``."""
    out = git("grep", "-c", "", commit, "--", f"src/*{suffix}")  # "commit:path:count" a file
    counts = {}
    for row in out.splitlines():
        path, n = row[len(commit) + 1:].rsplit(":", 1)
        counts[path.removeprefix(PKG)] = int(n)
    return counts


def net_lines(commit: str) -> int:
    """Lines ``commit`` adds to src/**.py less those it removes, against its first parent."""
    rows = git("diff", "--numstat", f"{commit}^1", commit, "--", "src/*.py").splitlines()
    return sum(int(a) - int(d) for a, d, _ in (row.split("\t", 2) for row in rows))


def by_commit(first: str, last: str) -> None:
    totals = {"restructuring": 0, "features and fixes": 0, f"clean-up after {RESTRUCTURED}": 0}
    later = list(FEATURES_AFTER)
    print(f"\nnet Python lines of each first-parent commit, {first} -> {last}:")
    for row in git("log", "--first-parent", "--reverse", "--format=%h %s", f"{first}..{last}").splitlines():
        short, subject = row.split(" ", 1)
        kind = next((k for k in RESTRUCTURING if short.startswith(k) or k.startswith(short)), None)
        after = subprocess.run(["git", "-C", str(ROOT), "merge-base", "--is-ancestor", RESTRUCTURED, short],
                               capture_output=True).returncode == 0 and not short.startswith(RESTRUCTURED)
        after = after and not any(short.startswith(k) or k.startswith(short) for k in later)
        n = net_lines(short)
        totals["restructuring" if kind else f"clean-up after {RESTRUCTURED}" if after else "features and fixes"] += n
        if n:
            print(f"  {n:>+6}  {short}  {'[R] ' + RESTRUCTURING[kind] if kind else subject[:90]}")
    for what, n in totals.items():
        print(f"  {n:>+6}  in all: {what}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commits", nargs="+", default=["acf3333", "169d819", "HEAD"])
    ap.add_argument("--by-commit", action="store_true",
                    help="net Python lines of each first-parent commit from the first to the last commit (a merge: "
                         "its whole branch), summed as restructuring (RESTRUCTURING) and the rest")
    ap.add_argument("--growth", type=int, default=0, metavar="N",
                    help="also list the N files that grew most from the first to the last commit")
    args = ap.parse_args()

    py = {c: line_counts(c, ".py") for c in args.commits}
    cpp = {c: sum(line_counts(c, ".cpp").values()) for c in args.commits}
    width = max(len(c) for c in args.commits)
    print(f"{'commit':<{width}}  {'python':>7}  {'c++':>5}  {'feature files':>13}  {'same features':>13}")
    for c in args.commits:
        total = sum(py[c].values())
        feature = sum(n for path, n in py[c].items() if path in FEATURE_FILES)
        print(f"{c:<{width}}  {total:>7}  {cpp[c]:>5}  {feature:>13}  {total - feature:>13}")

    first, last = args.commits[0], args.commits[-1]
    same = {c: sum(n for path, n in py[c].items() if path not in FEATURE_FILES) for c in (first, last)}
    print(f"\nsame features, {first} -> {last}: {same[first]} -> {same[last]} lines ({same[last] - same[first]:+d})")
    print(f"\nfeature files at {last} (under {PKG}):")
    for path, what in FEATURE_FILES.items():
        print(f"  {py[last].get(path, 0):>5}  {path:<30}  {what}")

    if args.by_commit:
        by_commit(first, last)
    if args.growth:
        rows = []
        for row in git("diff", "--numstat", "-M", first, last, "--", "src/*.py").splitlines():
            added, deleted, path = row.split("\t", 2)
            rows.append((int(added) - int(deleted), path))
        print(f"\nfiles that grew most, {first} -> {last} (net lines):")
        for net, path in sorted(rows, reverse=True)[: args.growth]:
            print(f"  {net:>+6}  {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
