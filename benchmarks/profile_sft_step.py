"""Where a fine-tuning step's time goes: one profiled step of each side of ``bench_lora.py``, by category.

Builds the same pair as ``bench_lora.py`` (SmolLM2-135M shape, identical weights and LoRA adapters, same batch),
runs two warm-up steps of each side, then profiles ONE step of each with ``torch.profiler`` (``with_flops``,
``record_shapes``) and sums the self CPU time of its ops by category:

- ``gemm``: dense matrix products (``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``, ``addmm_``, ``addbmm``, ...);
- ``attention``: the fused attention kernels (``aten::_scaled_dot_product_*`` forward and backward);
- ``optimizer``: the ``foreach`` AdamW ops (``aten::_foreach_*``, ``aten::_fused_adamw_``) and the Python of
  ``Optimizer.step`` / ``zero_grad`` (their ``record_function`` ranges' self time);
- ``other``: everything else (elementwise, norms, RoPE, softmax / cross-entropy, copies, autograd overhead).

GEMM FLOPs are counted by hand from the recorded input shapes (2 * m * k * n per product, batched products
times the batch), so both sides are counted by the same rule; the achieved GFLOP/s is those FLOPs over the GEMM
self time. From the two profiles it prints the bounds on our speedup: at equal GEMM time (HF's step over our
GEMM + attention time), and the speedup if all our non-GEMM, non-attention time were removed. One thread is
the default (``torch.set_num_threads``), so the self times are not spread over an intra-op pool.

    OMP_NUM_THREADS=1 python benchmarks/profile_sft_step.py                          # both modes, 30 layers
    OMP_NUM_THREADS=1 python benchmarks/profile_sft_step.py --prompt-fraction 0.5    # SFT-style masked prompts
    OMP_NUM_THREADS=1 python benchmarks/profile_sft_step.py --small                  # checks that it runs
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import time

import torch
from bench_lora import batch, build, step_fn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::baddbmm_",
            "aten::addbmm", "aten::addbmm_", "aten::_addmm_activation"}
OPTIMIZER_PREFIXES = ("aten::_foreach_", "aten::_fused_adam", "Optimizer.")


def in_optimizer(ev) -> bool:
    """Whether the event runs inside ``Optimizer.step`` / ``zero_grad``: on CPU a ``_foreach_*`` op loops over
    per-tensor ops (``aten::sqrt``, ``aten::mul_``, ...), whose self time must count as the optimizer's."""
    while ev is not None:
        if ev.name.startswith(OPTIMIZER_PREFIXES):
            return True
        ev = ev.cpu_parent
    return False


def category(name: str) -> str:
    if name in GEMM_OPS:
        return "gemm"
    if name.startswith("aten::_scaled_dot_product") or name.startswith("aten::_flash_attention"):
        return "attention"
    if name.startswith(OPTIMIZER_PREFIXES):
        return "optimizer"
    return "other"


def gemm_flops(name: str, shapes: list) -> int:
    """2 m k n (times the batch for bmm / baddbmm) from the recorded input shapes; 0 when they are missing."""
    try:
        if name in ("aten::mm",):
            (m, k), (_, n) = shapes[0], shapes[1]
            return 2 * m * k * n
        if name in ("aten::addmm", "aten::addmm_", "aten::_addmm_activation"):
            (m, k), (_, n) = shapes[1], shapes[2]
            return 2 * m * k * n
        if name == "aten::bmm":
            (b, m, k), (_, _, n) = shapes[0], shapes[1]
            return 2 * b * m * k * n
        if name in ("aten::baddbmm", "aten::baddbmm_", "aten::addbmm", "aten::addbmm_"):
            (b, m, k), (_, _, n) = shapes[1], shapes[2]
            return 2 * b * m * k * n
    except (ValueError, IndexError, TypeError):
        return 0
    return 0


def profile_step(step) -> dict:
    """One profiled call of ``step``: per-category self CPU seconds, GEMM FLOPs, the step's wall time, the top ops
    and the GEMMs grouped by shape."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
    by_cat: dict[str, float] = collections.defaultdict(float)
    by_op: dict[str, float] = collections.defaultdict(float)
    gemms: dict[tuple, list] = {}
    flops = 0
    events = prof.events()
    for ev in events:
        self_s = ev.self_cpu_time_total / 1e6
        by_cat["optimizer" if in_optimizer(ev) else category(ev.name)] += self_s
        by_op[ev.name] += self_s
        if ev.name in GEMM_OPS:
            shapes = [tuple(s) for s in ev.input_shapes]
            f = gemm_flops(ev.name, shapes)
            flops += f
            key = (ev.name, tuple(s for s in shapes if s))
            entry = gemms.setdefault(key, [0, 0.0, 0])
            entry[0] += 1
            entry[1] += self_s
            entry[2] += f
    total = sum(by_cat.values())
    return {"wall_s": wall, "self_s": total, "n_events": len(events), "by_cat": dict(by_cat), "gemm_flops": flops,
            "top_ops": sorted(by_op.items(), key=lambda kv: -kv[1])[:25],
            "gemms": sorted(((*k, *v) for k, v in gemms.items()), key=lambda r: -r[3])}


class OptimizerClock:
    """Times every ``optimizer.step()`` through torch's global step hooks, into ``times[self.kind]``."""

    def __init__(self, times: dict[str, list[float]]) -> None:
        self.times, self.kind, self.t0 = times, "", 0.0
        self.hooks = [register_optimizer_step_pre_hook(self.start), register_optimizer_step_post_hook(self.end)]

    def start(self, *_) -> None:
        self.t0 = time.perf_counter()

    def end(self, *_) -> None:
        self.times[self.kind].append(time.perf_counter() - self.t0)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def report(mode: str, res: dict[str, dict], plain: dict[str, float], plain_opt: dict[str, float]) -> dict:
    """Prints the category table and the bounds. ``plain`` / ``plain_opt``: median unprofiled step seconds of each
    side and of its ``optimizer.step()`` alone."""
    cats = ("gemm", "attention", "optimizer", "other")
    print(f"\n{mode}: self CPU seconds of one profiled step (share of its self time)")
    print(f"  {'category':10s} " + "  ".join(f"{k:>18s}" for k in ("tinyformer", "HF")))
    for c in cats:
        cells = []
        for k in ("ours", "hf"):
            v = res[k]["by_cat"].get(c, 0.0)
            cells.append(f"{v:7.3f} s ({100 * v / res[k]['self_s']:4.1f}%)")
        print(f"  {c:10s} " + "  ".join(f"{s:>18s}" for s in cells))
    print(f"  {'total':10s} " + "  ".join(f"{res[k]['self_s']:7.3f} s        " for k in ("ours", "hf"))
          + f"   (profiled wall {res['ours']['wall_s']:.3f} / {res['hf']['wall_s']:.3f} s, "
          f"{res['ours']['n_events']} / {res['hf']['n_events']} profiler events)")
    print(f"  unprofiled step (median): {plain['ours']:.3f} / {plain['hf']:.3f} s, HF/ours "
          f"{plain['hf'] / plain['ours']:.2f}x; its optimizer.step(): {plain_opt['ours']:.3f} / "
          f"{plain_opt['hf']:.3f} s")
    rates = {}
    for k in ("ours", "hf"):
        g, gflop = res[k]["by_cat"]["gemm"], res[k]["gemm_flops"] / 1e9
        rates[k] = gflop / g
        print(f"  {k}: GEMM {gflop:7.1f} GFLOP in {g:.3f} s: {rates[k]:6.1f} GFLOP/s")
    ours, hf = res["ours"], res["hf"]
    # the fastest rate any GEMM shape of at least 1 GFLOP reached in either profile: the machine's practical peak
    peak = max((f / s / 1e9 for k in ("ours", "hf") for *_, s, f in res[k]["gemms"] if f >= 1e9 and s > 0),
               default=max(rates.values()))
    attn, opt = ours["by_cat"].get("attention", 0.0), plain_opt["ours"]
    left = {"gemm_attention_optimizer": ours["by_cat"]["gemm"] + attn + opt,
            "same_at_peak_gemm_rate": ours["gemm_flops"] / 1e9 / peak + attn + opt}
    bounds = {"unprofiled_ratio": plain["hf"] / plain["ours"], "peak_gflops": peak, "rates": rates,
              "gemm_flop_ratio_ours_over_hf": ours["gemm_flops"] / hf["gemm_flops"],
              "other_ours_s": plain["ours"] - left["gemm_attention_optimizer"],
              "other_hf_s": plain["hf"] - hf["by_cat"]["gemm"] - hf["by_cat"].get("attention", 0.0) - plain_opt["hf"],
              **{f"bound_{k}": plain["hf"] / v for k, v in left.items()}}
    print(f"  non-GEMM, non-attention, non-optimizer time (unprofiled step minus those): ours "
          f"{bounds['other_ours_s']:.3f} s, HF {bounds['other_hf_s']:.3f} s")
    print(f"  bounds on HF/ours (HF's unprofiled step over what would be left of ours): only our GEMMs + attention + "
          f"optimizer {bounds['bound_gemm_attention_optimizer']:.2f}x; the same with every GEMM at {peak:.0f} GFLOP/s "
          f"{bounds['bound_same_at_peak_gemm_rate']:.2f}x")
    print(f"  GEMM FLOPs ours / HF: {bounds['gemm_flop_ratio_ours_over_hf']:.3f}")
    for k in ("ours", "hf"):
        print(f"  {k}: top ops by self time: " + ", ".join(f"{n} {s:.3f}" for n, s in res[k]["top_ops"]))
        print(f"  {k}: GEMMs by shape (count, self s, GFLOP/s):")
        for name, shapes, n, s, f in res[k]["gemms"][:16]:
            rate = f / 1e9 / s if s else math.nan
            print(f"    {name:14s} {str(shapes):60s} x{n:<4d} {s:7.3f} s {rate:6.1f}")
    return bounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-fraction", type=float, default=0.0)
    ap.add_argument("--plain-steps", type=int, default=3, help="unprofiled steps per side (median reported)")
    ap.add_argument("--small", action="store_true", help="a tiny shape, to check that the script runs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), fp32, batch {args.batch} x {args.seq}, "
          f"{args.layers} layers, prompt fraction {args.prompt_fraction}; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start")
    out = {}
    for mode in args.modes:
        cfg, ours, hf = build("both", mode, args.small, args.layers)
        x, y = batch(cfg, args.batch, args.seq, args.prompt_fraction)
        steps = {"ours": step_fn(ours, "ours", x, y), "hf": step_fn(hf, "hf", x, y)}
        for fn in steps.values():
            fn()
            fn()  # warm-up: the optimizer state exists
        plain: dict[str, list[float]] = {"ours": [], "hf": []}
        plain_opt: dict[str, list[float]] = {"ours": [], "hf": []}
        clock = OptimizerClock(plain_opt)
        for r in range(args.plain_steps):  # unprofiled steps, alternating: the profiler slows per-op overhead
            for kind in (("ours", "hf") if r % 2 == 0 else ("hf", "ours")):
                clock.kind = kind
                t0 = time.perf_counter()
                steps[kind]()
                plain[kind].append(time.perf_counter() - t0)
        clock.remove()
        res = {kind: profile_step(fn) for kind, fn in steps.items()}
        med = {k: statistics.median(v) for k, v in plain.items()}
        med_opt = {k: statistics.median(v) for k, v in plain_opt.items()}
        out[mode] = {"bounds": report(mode, res, med, med_opt), "plain_steps_s": plain, "plain_opt_s": plain_opt,
                     **{k: {kk: res[k][kk] for kk in ("wall_s", "self_s", "by_cat", "gemm_flops")} for k in res}}
        del ours, hf, steps
    load = os.getloadavg()
    print(f"\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end")
    print("JSON " + json.dumps(out))


if __name__ == "__main__":
    main()
