"""Which CPU kernel multiplies by int8 / int4 weights fastest: one decode row and a prefill block.

    python benchmarks/bench_quant_kernels.py [--threads 2] [--rows 1 8 128] [--repeat 200] [--only cpp ...]
    python benchmarks/bench_quant_kernels.py --threads 1 --streaming 30 --repeat 7

Shapes are SmolLM2-135M's (d 576, d_ff 1536, vocab 49152): the fused gate/up matrix (3072 x 576), the
down projection (576 x 1536) and the head (49152 x 576). For each, y = x W^T (x: rows x in) by
  * fp32:          F.linear on float32 W (the baseline; weights read: 4 bytes each)
  * int8_aten:     torch.ops.aten._weight_int8pack_mm, int8 W with one scale per output row
  * int8_cpp_PATH / int4_cpp_PATH: tinyformer's C++ kernels (``tinyformer.components.quant_kernels``), the
    portable layout read in place, each weight widened to float32 in registers (per channel, G = 32), once
    for every code path this CPU has (avx512, avx2, plain)
  * int8_gemm_PATH / int4_gemm_PATH: the act8 GEMM (``quant_kernels.act8_gemm``, the ``cpp_act8`` kernel): the
    activations rounded to 8 bits per 32 columns and integer dot products (VNNI, AVX2) on weights packed at
    load, as llama.cpp's Q8_0 / Q4_0 products; not weight-only
  * int8_compiled: torch.compile of x @ (q * s)^T, per-channel and per-group (G = 32) scales (inductor
    writes the float matrix, then calls the BLAS)
  * int8_compiled_sum: torch.compile of (x[:, None, :] * q) .sum(-1) * s, written so that inductor fuses
    the int8 -> float widening into the reduction (no float matrix), output-major q (N, K) and input-major
    q^T (K, N)
  * int4_aten:     torch.ops.aten._weight_int4pack_mm_for_cpu, groups of G = 32 / 64 (576 = 9 x 64: no 128-groups)
  * int4_compiled: torch.compile of the unpack + dequantize + matmul, G = 32
  * fbgemm_dynamic: torch.ao's dynamically quantized Linear (int8 activations per row, int8 weights per
    output row, fbgemm's integer GEMM); not weight-only: the activations are rounded too
Time per call is the fastest (and the median) of ``--repeat`` calls after warm-up, in microseconds, and the
bytes of weights (with scales) read per second at the fastest call. Run on an idle machine for absolute
figures; on a shared one only the ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = time.perf_counter  # --clock: "cpu" is this thread's CPU time (with --threads 1 the kernels run in it)


def time_us(fn, repeat: int, warm: int = 3) -> tuple[float, float]:
    """(fastest, median) microseconds per call. On a loaded machine the fastest call is the one the
    scheduler did not interrupt, the best estimate of the kernel's own speed."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeat):
        t = clock()
        fn()
        times.append(clock() - t)
    return min(times) * 1e6, statistics.median(times) * 1e6


def alternate(cases: dict, repeat: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Each case timed ``rounds`` times in turn (A, B, C, A, B, C, ...), ``repeat`` calls a round: a change
    of load hits every case alike. The fastest call over all rounds and the median of the round medians."""
    best: dict[str, list[tuple[float, float]]] = {label: [] for label in cases}
    for r in range(rounds):
        for label, fn in cases.items():
            best[label].append(time_us(fn, repeat, warm=3 if r == 0 else 1))
    return {k: (min(v)[0], statistics.median(m for _, m in v)) for k, v in best.items()}


def bench_shape(name: str, n: int, k: int, rows: int, repeat: int, only: list[str] | None = None,
                rounds: int = 1) -> None:
    """Time every kernel on y = x W^T with W (n, k) and x (rows, k)."""
    w = torch.randn(n, k)
    x = torch.randn(rows, k)
    s8 = w.abs().amax(1) / 127
    q8 = torch.round(w / s8[:, None]).clamp(-127, 127).to(torch.int8)
    g = 32
    s8g = w.view(n, k // g, g).abs().amax(-1) / 127
    q8g = torch.round(w.view(n, k // g, g) / s8g[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)

    def int4(group: int):
        wg = w.view(n, k // group, group)
        scale = wg.abs().amax(-1) / 7
        q = (torch.round(wg / scale[..., None]).clamp(-8, 7) + 8).to(torch.int32).view(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = torch.stack([scale.t(), torch.zeros_like(scale.t())], -1).contiguous()  # (k/G, n, 2)
        return q, scale, packed, sz

    q4_32, s4_32, p4_32, sz32 = int4(32)
    _, _, p4_64, sz64 = int4(64)
    nib = (q4_32[:, 0::2] | (q4_32[:, 1::2] << 4)).to(torch.uint8)  # (n, k/2)

    @torch.compile(dynamic=False)
    def deq8(x, q, s):
        return x @ (q.float() * s[:, None]).t()

    @torch.compile(dynamic=False)
    def deq8g(x, q, s):
        return x @ (q.view(n, k // g, g).float() * s[..., None]).view(n, k).t()

    @torch.compile(dynamic=False)
    def deq4(x, packed, s):
        lo = (packed & 15).to(torch.int8) - 8
        hi = (packed >> 4).to(torch.int8) - 8
        q = torch.stack([lo, hi], -1).view(n, k // g, g).float()
        return x @ (q * s[..., None]).view(n, k).t()

    @torch.compile(dynamic=False)
    def sum8(x, q, s):
        return (x[:, None, :] * q.float()[None]).sum(-1) * s

    @torch.compile(dynamic=False)
    def sum8_in_major(x, qt, s):
        return (x[:, :, None] * qt.float()[None]).sum(1) * s

    q8t = q8.t().contiguous()
    zeros4 = torch.zeros_like(s4_32)  # the kernels' int4 form: w = s (u - 8) + z, here z = 0
    nib_u8 = nib

    dyn = torch.ao.nn.quantized.dynamic.Linear(k, n, bias_=False, dtype=torch.qint8)
    dyn.set_weight_bias(torch.quantize_per_channel(w, s8.double(), torch.zeros(n, dtype=torch.long), 0,
                                                   torch.qint8), None)

    from tinyformer.components import quant_kernels
    from tinyformer.components.quantized import CPP_MAX_ROWS, QuantizedLinear, QuantSpec

    cpp = quant_kernels.available()
    # every code path this CPU has, each forced (the kernels' "auto" takes the first)
    gemm_paths = [p for p, has in [("vnni", quant_kernels.has_vnni()), ("avx2", quant_kernels.has_avx2()),
                                   ("plain", cpp)] if has]
    wo_paths = [p for p, has in [("avx512", quant_kernels.has_avx512()), ("avx2", quant_kernels.has_avx2()),
                                 ("plain", cpp)] if has]
    weight_only = {}
    for path in wo_paths:
        weight_only.update({
            f"int8_cpp_{path} (per-channel)": lambda path=path: quant_kernels.int8_linear(x, q8, s8[:, None], path),
            f"int8_cpp_{path} (G=32)": lambda path=path: quant_kernels.int8_linear(x, q8g, s8g, path),
            f"int4_cpp_{path} (G=32)": lambda path=path: quant_kernels.int4_linear(x, nib_u8, s4_32, zeros4, path)})
    gemm = {}  # the 8-bit-activation GEMM over its packed weights, and the weight-only layer (its prefill path)
    if cpp:
        ports = {"int8 (per-channel)": ({"qweight": q8, "scales": s8[:, None]}, QuantSpec("int8", 0)),
                 "int8 (G=32)": ({"qweight": q8g, "scales": s8g}, QuantSpec("int8", 32)),
                 "int4 (G=32)": ({"qweight": nib, "scales": s4_32, "zeros": torch.zeros_like(s4_32)},
                                 QuantSpec("int4", 32))}
        for label, (part, spec) in ports.items():
            width, layout = label.split(" ", 1)
            packed, group = quant_kernels.pack_act8(part, width), spec.groups(k)
            for path in gemm_paths:
                gemm[f"{width}_gemm_{path} {layout}"] = (
                    lambda p=packed, w=width, g=group, path=path: quant_kernels.act8_gemm(x, p, n, g, w, path))
            if rows > CPP_MAX_ROWS:
                layer = QuantizedLinear(part, QuantSpec(width, spec.group_size, "cpp"), k)
                gemm[f"{width}_cpp_dequant_blas {layout}"] = lambda layer=layer: layer(x)
    cases = {
        "fp32": lambda: F.linear(x, w),
        **weight_only,
        "int8_compiled_sum (per-channel)": lambda: sum8(x, q8, s8),
        "int8_compiled_sum (input-major)": lambda: sum8_in_major(x, q8t, s8),
        "int8_aten (per-channel)": lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s8),
        "int8_compiled (per-channel)": lambda: deq8(x, q8, s8),
        "int8_compiled (G=32)": lambda: deq8g(x, q8g, s8g),
        "int4_aten (G=32)": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p4_32, 32, sz32),
        "int4_aten (G=64)": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p4_64, 64, sz64),
        "int4_compiled (G=32)": lambda: deq4(x, nib, s4_32),
        "fbgemm_dynamic (per-channel)": lambda: dyn(x),
        **gemm,
    }
    weight_bytes = {"fp32": 4.0, "int8": 1.0, "int4": 0.5, "fbgemm": 1.0}
    chosen = {label: fn for label, fn in cases.items()
              if fn is not None and not (only and label != "fp32" and not any(o in label for o in only))}
    with torch.inference_mode():
        times = alternate(chosen, repeat if rows <= 8 else max(3, repeat // 10), rounds)
        base = None
        for label, (us, med) in times.items():
            base = base or us
            per = weight_bytes[label.split("_")[0]]
            group = 32 if "G=32" in label else k
            read = n * k * per + n * (k // group) * 4 * (2 if label.startswith("int4") else 1) * (per < 4)
            print(f"rows {rows:4d}  {name:18s} {label:32s} {us:10.1f} us (median {med:9.1f})  "
                  f"{base / us:5.2f}x fp32  {read / us / 1e3:6.1f} GB/s", flush=True)



def streaming(layers: int, repeat: int) -> None:
    """Decode-like: one row through ``layers`` different gate_up-sized matrices in turn (as a decode step
    goes through the layers), so that the weights come from memory, not from a cache that one matrix fits
    in. Time per matrix, fastest and median of ``repeat`` passes."""
    from tinyformer.components import quant_kernels

    if not quant_kernels.available():
        print("streaming: the C++ kernels are not available here")
        return
    n, k = 3072, 576
    ws = [torch.randn(n, k) for _ in range(layers)]
    q8 = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for _ in range(layers)]
    s8 = [torch.rand(n, 1) for _ in range(layers)]
    q4 = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8) for _ in range(layers)]
    s4 = [torch.rand(n, k // 32) for _ in range(layers)]
    z4 = [torch.rand(n, k // 32) for _ in range(layers)]
    x = torch.randn(1, k)
    ops = torch.ops.tinyformer
    p8 = [quant_kernels.pack_act8({"qweight": q, "scales": s}, "int8") for q, s in zip(q8, s8)]
    p4 = [quant_kernels.pack_act8({"qweight": q, "scales": s, "zeros": z}, "int4") for q, s, z in zip(q4, s4, z4)]
    cases = {  # label: (pass over all layers, bytes of weights and scales per matrix)
        "fp32": (lambda: [F.linear(x, w) for w in ws], n * k * 4),
        "int8_cpp (per-channel)": (lambda: [ops.int8_linear(x, q, s) for q, s in zip(q8, s8)], n * k + n * 4),
        "int4_cpp (G=32)": (lambda: [ops.int4_linear(x, q, s, z) for q, s, z in zip(q4, s4, z4)],
                            n * k // 2 + n * k // 32 * 8),
        "int8_gemm (per-channel)": (lambda: [quant_kernels.act8_gemm(x, p, n, k, "int8") for p in p8],
                                    n * k + n * 4 + n * k // 32 * 4),
        "int4_gemm (G=32)": (lambda: [quant_kernels.act8_gemm(x, p, n, 32, "int4") for p in p4],
                             n * k // 2 + n * k // 32 * 8),
    }
    with torch.inference_mode():
        base = None
        for label, (fn, nbytes) in cases.items():
            us, med = time_us(fn, repeat)
            us, med = us / layers, med / layers
            base = base or us
            print(f"streaming {layers} x gate_up {label:28s} {us:8.1f} us/matrix (median {med:8.1f})  "
                  f"{base / us:5.2f}x fp32  {nbytes / us / 1e3:6.1f} GB/s", flush=True)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[2], help="one or more thread counts, in turn")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 128])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--only", nargs="+", default=None, help="kernels whose label contains one of these (and fp32)")
    ap.add_argument("--rounds", type=int, default=1, help="time the kernels this many times in turn (A B A B)")
    ap.add_argument("--clock", choices=list(CLOCKS), default="wall",
                    help="cpu: this thread's CPU time (use with --threads 1 on a loaded machine)")
    ap.add_argument("--shapes", nargs="+", default=None, help="only these shapes (gate_up, down, head, qkv, o)")
    ap.add_argument("--streaming", type=int, default=0, metavar="LAYERS",
                    help="instead: one row through LAYERS different gate_up matrices (weights from memory)")
    args = ap.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    torch.manual_seed(0)
    shapes = {"gate_up 3072x576": (3072, 576), "down 576x1536": (576, 1536), "head 49152x576": (49152, 576),
              "qkv 960x576": (960, 576), "o 576x576": (576, 576)}
    shapes = {k: v for k, v in shapes.items()
              if (args.shapes and k.split()[0] in args.shapes) or (not args.shapes and k.split()[0] in
                                                                   ("gate_up", "down", "head"))}
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"torch {torch.__version__}, {threads} threads, {args.clock} clock, load average {os.getloadavg()}, "
              f"CPU {cpu_model()}")
        if args.streaming:
            streaming(args.streaming, args.repeat)
        else:
            for rows in args.rows:
                for name, (n, k) in shapes.items():
                    bench_shape(name, n, k, rows, args.repeat, args.only, args.rounds)
        print(f"load average at the end {os.getloadavg()}")

if __name__ == "__main__":
    main()
