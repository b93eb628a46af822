"""Prefill time of a long prompt, cold vs. with its prefix loaded from the prefix cache.

A stories15m-shaped model (random weights, max_seq_len raised to hold the prompt) prefills a --prompt-len
token prompt into one KV cache row:

  * cold: the whole prompt, model(prompt, cache) -> last logits
  * warm: PrefixCache.lookup (the prompt's cached whole blocks, at most len - 1 tokens: 992 of 1,000 with
    16-token blocks) + load into the row + prefill of the rest from position hit.length + release

The cache is filled once beforehand from a cold prefill. Cold and warm runs alternate for --rounds rounds;
medians are reported with warm / cold (target: <= 0.2x, the time to first token of a request whose system
prompt is cached), and the lookup + load part of the warm time on its own.

    python benchmarks/bench_prefix_cache.py
    python benchmarks/bench_prefix_cache.py --prompt-len 1000 --rounds 7 --threads 1
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch

from tinyformer.generation.prefix_cache import PrefixCache
from tinyformer.models.decoder import DecoderLM
from tinyformer.presets import get_preset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cfg = dataclasses.replace(get_preset("stories15m"), max_seq_len=max(1200, args.prompt_len))
    torch.manual_seed(0)
    model = DecoderLM(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_len,)).tolist()
    ids = torch.tensor([prompt])
    cache = model.new_cache(1)
    prefix = PrefixCache(cfg, block_size=args.block_size, budget_bytes=256 << 20)

    @torch.no_grad()
    def cold() -> torch.Tensor:
        return model(ids, cache=cache.row_view(0), last_only=True)[0, -1]

    @torch.no_grad()
    def warm() -> tuple[torch.Tensor, float]:
        t0 = time.perf_counter()
        hit = prefix.lookup(prompt)
        prefix.load(hit, cache, 0)
        t_load = time.perf_counter() - t0
        view = cache.row_view(0)
        view.length = hit.length
        logits = model(ids[:, hit.length :], cache=view, last_only=True)[0, -1]
        prefix.release(hit)
        return logits, t_load

    reference = cold()
    prefix.store(prompt, cache, 0, args.prompt_len)
    logits, _ = warm()
    hit_len = prefix.stats.tokens_reused
    err = float((logits - reference).abs().max() / reference.abs().max())

    t_cold, t_warm, t_load = [], [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        cold()
        t_cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _, tl = warm()
        t_warm.append(time.perf_counter() - t0)
        t_load.append(tl)

    c, w, ld = (statistics.median(t) for t in (t_cold, t_warm, t_load))
    print(f"model stories15m shape, max_seq_len {cfg.max_seq_len}, float32, {args.threads} thread(s); "
          f"prompt {args.prompt_len} tokens, {hit_len} from the prefix cache "
          f"({args.block_size}-token blocks of {prefix.block_bytes} bytes)")
    print(f"max |warm - cold| / max |cold| logits: {err:.1e}")
    print(f"cold prefill:  {c * 1e3:8.1f} ms (median of {args.rounds})")
    print(f"warm prefill:  {w * 1e3:8.1f} ms, of which lookup + load {ld * 1e3:.1f} ms")
    print(f"warm / cold:   {w / c:.3f}x (target <= 0.2x)")
    print("load average:  " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
