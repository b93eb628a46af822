"""Decode speed: tinyformer's Generator vs transformers ``generate()``, same weights, greedy, fp32.

    python benchmarks/bench_decode.py                          # stories15m and llama-110m, 2 threads
    python benchmarks/bench_decode.py --shapes stories15m --repeats 7

Per shape (random weights, mapped into a ``LlamaForCausalLM`` with sdpa attention; ours with its linear
weights stored input-major, as ``tinyformer generate`` loads them on CPU):
  * batch 1, 8-token prompt, 200 new tokens (EOS off, so both run all 200; neither computes
    log-probabilities, as HF's default does not): tokens/s of both and the ratio. Runs alternate
    (ours, HF, ours, HF, ...) so that load from other processes hits both alike; the median and the
    best of ``--repeats`` are printed;
  * the bandwidth ceiling: decoding one token reads every weight matrix once (the embedding table
    only one row), so tokens/s <= bandwidth / bytes read per token. The ceiling is measured in the
    same rounds as the decoders (so that the machine's drifting bandwidth hits all alike): the
    fastest of three vector-matrix products (see ``stream_rate``) over a float32 matrix of exactly
    the bytes a token reads, with the same thread count. That is one kernel streaming the model's
    bytes with nothing else to do; whether they come from DRAM or the last-level cache depends on
    the model's size, as for the decoder. For reference the script also prints the best of a sum,
    an mv and a copy over 1 GiB;
  * batch 8 (eight 8-token prompts): generated tokens/s;
  * time to first token (prefill + first sample) for a 512-token prompt (or the longest prompt the
    shape's context allows).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
from bench_model import build_pair  # the same weight pair as the model benchmark (a sibling script)

SHAPES = ("stories15m", "llama-110m")


def bytes_read_per_token(model: torch.nn.Module) -> int:
    """Every parameter is read once per decoded token, except the token embedding table (one row);
    a tied head reads the whole table anyway."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.cfg.tie_embeddings:
        emb = model.tok_emb.weight
        total -= emb.numel() * emb.element_size()
    return total


def memory_bandwidth(gib: float = 1.0, repeats: int = 7) -> dict[str, float]:
    """Read bandwidth in GB/s of three streaming reads of a ``gib`` GiB float32 tensor (far larger than any
    cache), best of ``repeats`` each: ``sum``, ``mv`` (a matrix-vector product, the operation decoding
    is made of) and ``copy`` (read + write, counted as 2 bytes moved per byte)."""
    n = int(gib * 2**30) // 4
    src = torch.ones(n)
    dst = torch.zeros(n)
    matrix, vec = src.view(-1, 1024), torch.ones(1024)
    ops = {"sum": (src.sum, 1), "mv": (lambda: torch.mv(matrix, vec), 1), "copy": (lambda: dst.copy_(src), 2)}
    result = {}
    for name, (fn, moved) in ops.items():
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        result[name] = moved * n * 4 / best / 1e9
    return result


def stream_rate(per_token: int, width: int, calls: int = 20) -> Callable[[], dict[str, float]]:
    """A function that times ``calls`` products of a vector with a float32 matrix of ``per_token`` bytes in
    each of three layouts and returns the median tokens/s of each: one product = one token's weight
    reads. MKL streams the same bytes at rates that differ by up to 1.7x between these
    layouts on the reference machine (an mv over 768-wide rows reads DRAM at ~27 GB/s, over 1024-wide
    rows at ~43 GB/s), so the ceiling is the best of them, not whichever one decoding happens to use:

    * ``mv``: ``W @ x`` with W (rows, width), as ``nn.Linear`` stores weights (row-major);
    * ``mv-1024``: the same with 1024-wide rows;
    * ``vm``: ``x @ W`` with W (width, rows) contiguous (the input-major layout)."""
    rows = per_token // 4 // width
    kernels = {
        "mv": (torch.randn(rows, width), torch.randn(width), lambda m, v: torch.mv(m, v)),
        "mv-1024": (torch.randn(per_token // 4 // 1024, 1024), torch.randn(1024), lambda m, v: torch.mv(m, v)),
        "vm": (torch.randn(width, rows), torch.randn(1, width), lambda m, v: v @ m),
    }

    def fn() -> dict[str, float]:
        rates = {}
        for name, (matrix, vec, op) in kernels.items():
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                op(matrix, vec)
                times.append(time.perf_counter() - t)
            rates[name] = 1 / statistics.median(times)
        return rates
    return fn


def alternate(fns: dict[str, Callable[[], object]], repeats: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Run each function once to warm up (timed: it includes compilation where there is one), then
    ``repeats`` rounds of all of them in turn. Returns (seconds per run, seconds of the warm-up run)."""
    warmup = {}
    for name, fn in fns.items():
        t = time.perf_counter()
        fn()
        warmup[name] = time.perf_counter() - t
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return times, warmup


def bench_shape(shape: str, args: argparse.Namespace, read_bw: float) -> None:
    from tinyformer.generation.generator import Generator
    from tinyformer.generation.sampling import SamplingParams
    from tinyformer.generation.weight_layout import prepare_for_decoding

    cfg, ours, hf = build_pair(shape)
    ours.eval(), hf.eval()
    # as Generator.from_run (the CLI) does on CPU; the compiled generator would do it anyway, and the
    # eager one shares its model
    prepare_for_decoding(ours)
    gens = {"ours": Generator(ours)}
    if args.compile:
        gens["ours+compile"] = Generator(ours, compile=True)
    for gen in gens.values():
        gen.eos_token_id = None
    names = [*gens, *([] if args.skip_hf else ["hf"])]
    greedy = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=g)
    n_ttft = min(args.ttft_prompt, cfg.max_seq_len - 1)
    long = torch.randint(0, cfg.vocab_size, (1, n_ttft), generator=g)

    def run(name: str, x: torch.Tensor, n: int) -> list[int]:
        """Greedy-decode ``n`` tokens after each row of ``x``; the first row's new tokens."""
        if name == "hf":
            with torch.inference_mode():
                out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
            return out[0, x.shape[1]:].tolist()
        params = dataclasses.replace(greedy, max_new_tokens=n)
        return gens[name].generate(x.tolist(), params, logprobs=False)[0].token_ids

    # Every forward call (prefill, then one per token) is time-stamped, for both models alike: the gaps
    # between consecutive stamps are whole decode steps (forward + choosing the token + loop overhead).
    # Their 10th percentile shows the cost of a step that no other process disturbed.
    # (The compiled step is left unhooked: a hook would be traced into the compiled graph.)
    stamps: list[float] = []
    steps: dict[str, list[float]] = {name: [] for name in names}
    results: dict[str, list[int]] = {}

    def batch1(name: str) -> Callable[[], None]:
        def fn() -> None:
            stamps.clear()
            hook = None
            if "compile" not in name:
                hook = (hf if name == "hf" else ours).register_forward_hook(
                    lambda *_: stamps.append(time.perf_counter()))
            results[name] = run(name, prompt[:1], args.new_tokens)
            if hook is not None:
                hook.remove()
            steps[name].extend(b - a for a, b in zip(stamps[1:], stamps[2:]))  # stamps[0] ends the prefill
        return fn

    per_token = bytes_read_per_token(ours)
    stream = stream_rate(per_token, cfg.d_model)
    kernel_rates: list[dict[str, float]] = []
    fns = {name: batch1(name) for name in names}
    fns["ceiling"] = lambda: kernel_rates.append(stream())
    t1, warm = alternate(fns, args.repeats)
    del t1["ceiling"]
    kernel_rates = kernel_rates[1:]  # the warm-up round's is dropped like the others'
    ceilings = [max(r.values()) for r in kernel_rates]
    ceiling = statistics.median(ceilings)
    kernels = ", ".join(f"{k} {statistics.median(r[k] for r in kernel_rates):.0f}" for k in kernel_rates[0])
    print(f"\n== {shape}: {ours.num_params() / 1e6:.1f}M params, {per_token / 1e6:.0f} MB read per token; "
          f"ceiling (the fastest vector-matrix product over those bytes, per round) median {ceiling:.0f} "
          f"tokens/s = {ceiling * per_token / 1e9:.1f} GB/s, range {min(ceilings):.0f}-{max(ceilings):.0f} "
          f"(medians per kernel, tokens/s: {kernels}); at the 1 GiB bandwidth {read_bw:.1f} GB/s it would be "
          f"{read_bw * 1e9 / per_token:.0f} tokens/s")
    rate = {k: [args.new_tokens / t for t in v] for k, v in t1.items()}
    for name, r in rate.items():
        # the same round's ceiling: the ratio is robust to bandwidth drifting between rounds
        share = statistics.median(x / c for x, c in zip(r, ceilings))
        print(f"  batch 1, {args.new_tokens} tokens  {name:>12}: median {statistics.median(r):7.1f} tokens/s, "
              f"best {max(r):7.1f}  ({share:.0%} of the same round's ceiling, median)"
              + (f"; first run (compiling) {warm[name]:.1f} s" if "compile" in name else ""))
    for name in names:
        if len(steps[name]) >= 10:
            p10 = statistics.quantiles(steps[name], n=10)[0]
            print(f"  decode step {name:>12}: median {statistics.median(steps[name]) * 1e3:6.2f} ms, 10th "
                  f"percentile {p10 * 1e3:6.2f} ms = {1 / p10:7.1f} tokens/s ({1 / p10 / ceiling:.0%} of ceiling)")
    if "hf" in rate:
        for name in gens:
            print(f"  ratio {name}/HF: median {statistics.median(rate[name]) / statistics.median(rate['hf']):.2f}x, "
                  f"best {max(rate[name]) / max(rate['hf']):.2f}x")
            same = next((i for i, (a, b) in enumerate(zip(results[name], results["hf"])) if a != b), None)
            print(f"  {name} greedy tokens equal HF's: " + ("all" if same is None else f"first {same} (fp32 near-tie)"))

    t8, _ = alternate({name: (lambda name=name: run(name, prompt, args.new_tokens)) for name in names},
                      max(1, args.repeats // 2))
    for name, v in t8.items():
        print(f"  batch {args.batch}: {name:>12} {args.batch * args.new_tokens / statistics.median(v):7.1f} "
              f"generated tokens/s (median)")

    tt, _ = alternate({name: (lambda name=name: run(name, long, 1)) for name in names if "compile" not in name},
                      args.repeats)
    for name, v in tt.items():
        print(f"  time to first token, {n_ttft}-token prompt: {name:>4} {statistics.median(v) * 1e3:7.1f} ms "
              f"(median), best {min(v) * 1e3:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ttft-prompt", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-hf", action="store_true", help="time tinyformer only")
    ap.add_argument("--compile", action="store_true", help="also time Generator(compile=True)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bw = memory_bandwidth()
    read_bw = max(bw.values())
    print(f"torch {torch.__version__}, {args.threads} threads; memory bandwidth (1 GiB, best of 7): "
          + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bw.items()))

    for shape in args.shapes:
        bench_shape(shape, args, read_bw)


if __name__ == "__main__":
    main()
