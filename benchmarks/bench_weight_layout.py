"""Row-major vs input-major linear weights for batch-1 decoding on CPU, paired in one process.

    python benchmarks/bench_weight_layout.py                   # stories15m and llama-110m, 2 threads
    python benchmarks/bench_weight_layout.py --shapes llama-110m --rounds 8
    python benchmarks/bench_weight_layout.py --dtype bfloat16     # the products only

``nn.Linear`` stores W (out, in) row-major; ``tinyformer.generation.weight_layout.store_input_major``
keeps the values and shape but lays W out as W^T (in, out) contiguous, so that ``F.linear`` hands the
BLAS a contiguous W^T. Two model copies with the same weights, one per layout; each round times, for
both in turn (so that the machine's drifting bandwidth hits both alike):

  * ``products``: the chain of ``F.linear`` calls one decode step makes (every weight matrix of the
    model times one vector: q/k/v, output, gate/up and down of every layer, then the head);
  * ``generate``: ``Generator(model)`` greedy-decoding 200 tokens after an 8-token prompt (eager);
  * ``generate --compile``: the same with ``compile=True``; for the row-major copy the generator's
    layout step is switched off (it would store the weights input-major).

Printed per shape: the median over rounds of each, and the median of the per-round ratios
(input-major time / row-major time below 1 means input-major is faster). Both copies must decode the
same tokens. With ``--dtype bfloat16`` only the products are timed (``store_input_major`` moves float32
weights only), the input-major copy laid out directly.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from bench_model import build_pair  # the same weights as the other benchmarks (a sibling script)

SHAPES = ("stories15m", "llama-110m")


def product_chain(model: torch.nn.Module, dtype: torch.dtype, input_major: bool) -> Callable[[], None]:
    """Every ``nn.Linear`` weight of ``model`` (in ``dtype``, laid out input-major or row-major) applied to
    one (1, in) vector, in module order."""
    weights = [m.weight.detach().to(dtype) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = [w.t().contiguous().t() if input_major else w.contiguous() for w in weights]
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=dtype) for w in weights}

    def fn() -> None:
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)
    return fn


def bench_shape(shape: str, args: argparse.Namespace) -> None:
    import tinyformer.generation.generator as engine
    from tinyformer.generation.sampling import SamplingParams
    from tinyformer.generation.weight_layout import store_input_major

    _, row, hf = build_pair(shape)
    del hf
    row.eval()
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)
    prompt = [list(range(5, 5 + args.prompt_len))]

    def decode(gen: engine.Generator, layout: str) -> Callable[[], list[int]]:
        def fn() -> list[int]:
            keep = engine.store_input_major
            if layout == "row":  # the compiled generator would re-lay the weights out on first use
                engine.store_input_major = lambda model: None
            try:
                return gen.generate(prompt, params, logprobs=False)[0].token_ids
            finally:
                engine.store_input_major = keep
        return fn

    dtype = getattr(torch, args.dtype)
    tasks = {"products": {"row": product_chain(row, dtype, False), "input-major": product_chain(row, dtype, True)}}
    if dtype == torch.float32:  # the generators: a second model copy, stored input-major
        col = copy.deepcopy(row)
        store_input_major(col)
        for task, compiled in (("generate", False), ("generate --compile", True)):
            gens = {"row": engine.Generator(row, compile=compiled),
                    "input-major": engine.Generator(col, compile=compiled)}
            for g in gens.values():
                g.eos_token_id = None
            tasks[task] = {k: decode(g, k) for k, g in gens.items()}
    tokens = {(task, k): fn() for task, fns in tasks.items() for k, fn in fns.items()}  # warm-up, compiles
    # the row-major copy stayed so through the warm-up, the other did not
    assert row.lm_head.weight.is_contiguous() and (dtype != torch.float32 or not col.lm_head.weight.is_contiguous())
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
          f"{args.rounds} rounds")
    for task in tasks:
        a, b = times[task, "row"], times[task, "input-major"]
        unit = "ms per step" if task == "products" else f"ms for {args.new_tokens} tokens"
        same = "" if task == "products" else (
            "; same tokens" if tokens[task, "row"] == tokens[task, "input-major"] else "; TOKENS DIFFER")
        print(f"  {task:>18}: row-major {statistics.median(a) * 1e3:8.2f}, input-major "
              f"{statistics.median(b) * 1e3:8.2f} {unit}; input-major / row-major "
              f"{statistics.median(y / x for x, y in zip(a, b)):.3f} (median of rounds){same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--product-reps", type=int, default=20, help="product chains timed per round")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads")
    for shape in args.shapes:
        bench_shape(shape, args)


if __name__ == "__main__":
    main()
