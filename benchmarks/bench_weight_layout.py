"""Three layouts of the float32 linear layers for batch-1 decoding on CPU, side by side in one process.

    python benchmarks/bench_weight_layout.py                   # stories15m and llama-110m, 2 threads
    python benchmarks/bench_weight_layout.py --shapes llama-110m --rounds 8 --threads 1
    python benchmarks/bench_weight_layout.py --dtype bfloat16     # the products only, row / input-major
    python benchmarks/bench_weight_layout.py --rows 5             # the products of 5 rows only (a verification)

``nn.Linear`` stores W (out, in) row-major and computes x W^T with MKL (``row``).
``tinyformer.generation.weight_layout`` offers two other ways (``prepare_for_decoding`` picks one):
``rows kernel``, the layer's product for up to 8 rows by ``quant_kernels.f32_linear`` (the same row-major W,
output rows split over the threads), and ``input-major``, the same values laid out W^T (in, out) contiguous
(``store_input_major``) so that ``F.linear`` hands MKL a contiguous W^T. Model copies with the same weights,
one per layout; each round times, for each in turn (so that the machine's drifting bandwidth hits all alike):

  * ``products``: the chain of products one decode step makes (every weight matrix of the model times one
    vector: q/k/v, output, gate/up and down of every layer, then the head);
  * ``generate``: ``Generator(model)`` greedy-decoding 200 tokens after an 8-token prompt (eager);
  * ``generate --compile``: the same with ``compile=True``; for the row-major copy the generator's
    layout step is switched off.

Printed per shape: the median over rounds of each, and the median of the per-round ratios to ``row`` (below 1:
faster than row-major MKL). All copies must decode the same tokens. With ``--dtype bfloat16`` only the
products of ``row`` and ``input-major`` are timed (the kernel is float32 only); with ``--rows R`` > 1 only the
products, of R rows each (a speculative verification of R - 1 drafts).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable

import torch
from bench_model import build_pair  # the same weights as the other benchmarks (a sibling script)

SHAPES = ("stories15m", "llama-110m")


def product_chain(model: torch.nn.Module, dtype: torch.dtype, layout: str, rows: int = 1) -> Callable[[], None]:
    """Every ``nn.Linear`` weight of ``model`` (in ``dtype``, in ``layout``) applied to one (rows, in) input, in
    module order."""
    from tinyformer.components import quant_kernels

    weights = [m.weight.detach().to(dtype) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = [w.t().contiguous().t() if layout == "input-major" else w.contiguous() for w in weights]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=dtype) for w in weights}
    product = quant_kernels.f32_linear if layout == "rows kernel" else torch.nn.functional.linear

    def fn() -> None:
        for w in weights:
            product(inputs[w.shape[1]], w)
    return fn


def bench_shape(shape: str, args: argparse.Namespace) -> None:
    import tinyformer.generation.engine as engine
    from tinyformer.components import quant_kernels
    from tinyformer.generation import compile_cache
    from tinyformer.generation.generator import Generator
    from tinyformer.generation.sampling import SamplingParams
    from tinyformer.generation.weight_layout import FewRowsLinear, prepare_for_decoding, store_input_major

    assert quant_kernels.available(), "the rows kernel needs tinyformer's CPU kernels (a C++ compiler)"
    _, row, hf = build_pair(shape)
    del hf
    row.eval()
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)
    prompt = [list(range(5, 5 + args.prompt_len))]

    def decode(gen: Generator, layout: str) -> Callable[[], list[int]]:
        def fn() -> list[int]:
            keep = engine.prepare_for_decoding, compile_cache.prepare_for_decoding
            if layout == "row":  # the compiled generator would lay the layers out on first use
                engine.prepare_for_decoding = compile_cache.prepare_for_decoding = lambda model: None
            try:
                return gen.generate(prompt, params, logprobs=False)[0].token_ids
            finally:
                engine.prepare_for_decoding, compile_cache.prepare_for_decoding = keep
        return fn

    dtype = getattr(torch, args.dtype)
    layouts = ["row", "input-major"] + (["rows kernel"] if dtype == torch.float32 else [])
    tasks = {"products": {k: product_chain(row, dtype, k, args.rows) for k in layouts}}
    col = kern = None
    if dtype == torch.float32 and args.rows == 1:  # the generators: a model copy per layout
        col, kern = copy.deepcopy(row), copy.deepcopy(row)
        store_input_major(col)
        prepare_for_decoding(kern, min_bytes=0)
        models = {"row": row, "input-major": col, "rows kernel": kern}
        for task, compiled in (("generate", False), ("generate --compile", True)):
            gens = {k: Generator(m, compile=compiled) for k, m in models.items()}
            for g in gens.values():
                g.eos_token_id = None
            tasks[task] = {k: decode(g, k) for k, g in gens.items()}
    tokens = {(task, k): fn() for task, fns in tasks.items() for k, fn in fns.items()}  # warm-up, compiles
    # each copy kept its layout through the warm-up
    assert row.lm_head.weight.is_contiguous() and type(row.lm_head) is torch.nn.Linear
    assert col is None or (not col.lm_head.weight.is_contiguous() and type(kern.lm_head) is FewRowsLinear)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in tokens}
    for _ in range(args.rounds):
        for task, fns in tasks.items():
            for k, fn in fns.items():
                reps = args.product_reps if task == "products" else 1
                t = time.perf_counter()
                for _ in range(reps):
                    fn()
                times[task, k].append((time.perf_counter() - t) / reps)
    print(f"\n== {shape}: {sum(p.numel() for p in row.parameters()) / 1e6:.1f}M params, {args.dtype}, "
          f"{args.threads} thread(s), {args.rounds} rounds, {args.rows} row(s), load {os.getloadavg()[0]:.2f}")
    for task in tasks:
        unit = "ms per step" if task == "products" else f"ms for {args.new_tokens} tokens"
        base = times[task, "row"]
        cells = [f"row {statistics.median(base) * 1e3:8.2f}"]
        for k in layouts[1:]:
            b = times[task, k]
            cells.append(f"{k} {statistics.median(b) * 1e3:8.2f} "
                         f"({statistics.median(y / x for x, y in zip(base, b)):.3f}x)")
        same = "" if task == "products" else (
            "; same tokens" if len({tuple(tokens[task, k]) for k in layouts}) == 1 else "; TOKENS DIFFER")
        print(f"  {task:>18}: " + ", ".join(cells) + f" {unit}{same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--product-reps", type=int, default=20, help="product chains timed per round")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--rows", type=int, default=1, help="activation rows of each product (> 1: products only)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads")
    for shape in args.shapes:
        bench_shape(shape, args)


if __name__ == "__main__":
    main()
