"""Peak memory of attention: the explicit formula (T x T scores) against fused SDPA, at growing T.

The reference path (``attn_impl="reference"``) builds scores = q k^T / sqrt(d), masks them and takes
the safe softmax: every step holds a (B, H, T, T) float32 tensor, B H T^2 4 bytes, so its memory
grows with T^2. ``torch.nn.functional.scaled_dot_product_attention`` (``attn_impl="sdpa"``) runs a
flash-style kernel that visits the keys block by block with a running softmax and keeps only O(B H T d).

Each (path, T) point runs in a fresh subprocess, so nothing one point allocated distorts another:
the child builds q, k, v, runs one warm-up at a small T, writes "5" to /proc/self/clear_refs (which
resets the peak resident set size, VmHWM, to the current RSS), runs the attention once (forward, or
forward + backward, as training does) and reports VmHWM minus the RSS before the call. That is the
extra memory the attention needed, inputs excluded. Linux only (CPU); on CUDA use
torch.cuda.max_memory_allocated instead (--device cuda does).

    python benchmarks/attention_memory.py                          # T = 256 .. 4096, forward and forward + backward
    python benchmarks/attention_memory.py --modes forward --seq-lens 512 2048
    python benchmarks/attention_memory.py --png attention_memory.png --markdown table.md
    python benchmarks/attention_memory.py --png docs/img/attention_memory.png --overwrite   # the docs' figure
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(args: argparse.Namespace) -> None:
    """One measurement; prints one JSON line."""
    import torch

    from tinyformer.components.attention import attend

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    B, H, T, D = args.batch, args.heads, args.seq_len, args.head_dim

    def inputs(t: int):
        g = torch.Generator(device="cpu").manual_seed(0)
        return [torch.randn(B, H, t, D, generator=g).to(device).requires_grad_(args.backward) for _ in range(3)]

    def once(q, k, v) -> None:
        out = attend(q, k, v, None, is_causal=True, impl=args.impl)
        if args.backward:
            out.sum().backward()
        del out

    once(*inputs(64))  # first-call costs (kernel setup, thread pools) are not the attention's memory
    q, k, v = inputs(T)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        once(q, k, v)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status_kib("VmRSS")
        once(q, k, v)
        extra = (_status_kib("VmHWM") - before) * 1024
    print(json.dumps({"impl": args.impl, "seq_len": T, "extra_bytes": extra}))


def measure(args: argparse.Namespace, impl: str, seq_len: int, backward: bool) -> int:
    cmd = [sys.executable, __file__, "--child", "--impl", impl, "--seq-len", str(seq_len), "--batch", str(args.batch),
           "--heads", str(args.heads), "--head-dim", str(args.head_dim), "--threads", str(args.threads),
           "--device", args.device] + (["--backward"] if backward else [])
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"measurement {impl} T={seq_len} failed:\n{done.stderr}")
    return int(json.loads(done.stdout.strip().splitlines()[-1])["extra_bytes"])


MODES = {"forward": False, "train": True}  # mode -> with backward
MODE_NAMES = {"forward": "forward", "train": "forward + backward"}


def table(rows: list[dict], args: argparse.Namespace) -> str:
    head = "| T | one T x T matrix (B H T^2 4 bytes) |"
    rule = "|---:|---:|"
    for mode in args.modes:
        name = MODE_NAMES[mode]
        head += f" reference, {name} | SDPA, {name} | reference / SDPA |"
        rule += "---:|---:|---:|"
    lines = [f"attention extra peak memory, causal, float32, B={args.batch} H={args.heads} "
             f"d_head={args.head_dim}, device {args.device}", "", head, rule]
    for r in rows:
        line = f"| {r['T']} | {r['scores'] / MiB:.1f} MiB |"
        for mode in args.modes:
            ref, sdpa = r[mode, "reference"], r[mode, "sdpa"]
            ratio = f"{ref / sdpa:.1f}x" if sdpa > 0 else "-"
            line += f" {ref / MiB:.1f} MiB | {sdpa / MiB:.1f} MiB | {ratio} |"
        lines.append(line)
    return "\n".join(lines)


def plot(rows: list[dict], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from tinyformer.utils.io import atomic_path

    Ts = [r["T"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    styles = {"forward": "-", "train": "--"}
    for mode in args.modes:
        ax.plot(Ts, [r[mode, "reference"] / MiB for r in rows], "o" + styles[mode], color="tab:red",
                label=f"reference (explicit T x T softmax), {MODE_NAMES[mode]}")
        ax.plot(Ts, [r[mode, "sdpa"] / MiB for r in rows], "s" + styles[mode], color="tab:blue",
                label=f"SDPA (fused), {MODE_NAMES[mode]}")
    ax.plot(Ts, [r["scores"] / MiB for r in rows], "k:", label="one T x T float32 matrix: B H T^2 4 bytes")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(Ts, [str(t) for t in Ts])
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("extra peak memory [MiB]")
    ax.set_title(f"causal attention memory (B={args.batch}, H={args.heads}, d_head={args.head_dim}, float32, "
                 f"{args.device})", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
        os.chmod(tmp, 0o644)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu (VmHWM) or cuda (max_memory_allocated)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                   help="forward, and/or train (forward + backward) (default: both)")
    p.add_argument("--png", type=Path, default=None, help="write the figure here")
    p.add_argument("--markdown", type=Path, default=None, help="write the table here")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --png / --markdown file (e.g. the figure under docs/img)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=["reference", "sdpa"], help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    p.add_argument("--backward", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return
    # checked before minutes of measuring: a tracked figure is replaced only when asked for
    taken = [str(path) for path in (args.png, args.markdown) if path is not None and path.exists()]
    if taken and not args.overwrite:
        p.error(f"{', '.join(taken)} already exist(s); pass --overwrite to replace, or write elsewhere")
    rows = []
    for T in args.seq_lens:
        row: dict = {"T": T, "scores": args.batch * args.heads * T * T * 4}
        for mode in args.modes:
            for impl in ("reference", "sdpa"):
                row[mode, impl] = measure(args, impl, T, MODES[mode])
            print(f"T={T:>6} {MODE_NAMES[mode]:>18}: reference {row[mode, 'reference'] / MiB:9.1f} MiB   "
                  f"sdpa {row[mode, 'sdpa'] / MiB:8.1f} MiB   (one T x T matrix {row['scores'] / MiB:.1f} MiB)",
                  flush=True)
        rows.append(row)
    text = table(rows, args)
    print()
    print(text)
    if args.markdown:
        from tinyformer.utils.io import atomic_write_text

        atomic_write_text(args.markdown, text + "\n")
    if args.png:
        plot(rows, args, args.png)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
