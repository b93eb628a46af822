"""Serving throughput and latency with 1, 4 and 16 concurrent clients (continuous batching).

A stories15m-shaped model (random weights) and a byte-level BPE tokenizer trained on tinyshakespeare
are written to a temporary run folder and served by `tinyformer serve` in a subprocess. For each
concurrency C, C clients stream completions back to back (OpenAI chunk format, usage in the last
chunk) until each has finished its share of requests. Reported per C:

  * throughput: generated tokens / wall time, all clients together
  * latency: p50 / p99 of whole-request time (send to [DONE])
  * time to first chunk: p50
  * ratio: throughput / throughput at C=1 (target: >= 8x at C=16)

Levels run in alternation for --rounds rounds and each level reports its median-throughput round.

Every request generates exactly --max-tokens tokens (ignore_eos), sampling with temperature 0.8.

Then, on the same server and model:

  * single-client decode tokens/s: (max_tokens - 1) / (request time - time to first token), against
    ``Generator(compile=True)`` (what ``tinyformer generate --compile`` runs) decoding the same prompts in
    a separate process with the same thread count, after a warm-up request (target >= 0.9x)
  * time to first token (TTFT) = time of a 1-token request: one client with a --ttft-prompt-tokens
    prompt, then --ttft-clients clients sending such prompts at the same moment; p50 of theirs vs the
    single client's (target <= 3x: the new prompts are prefilled together)
  * with --prefix-cache-mb > 0: a --prefix-tokens shared system prompt, TTFT of the second request (a new
    question after it) vs the first (target <= 0.2x); served with max_seq_len --prefix-context

    python benchmarks/bench_serve.py
    python benchmarks/bench_serve.py --clients 1 4 16 --rounds 3 --requests 8 --max-tokens 64 --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = ROOT.parent / "shared/data/tinyshakespeare/input.txt"


def make_run(run: Path, corpus: Path, bpe_vocab: int, max_seq_len: int | None = None) -> None:
    import torch

    from tinyformer.data.tokenizer import build_tokenizer
    from tinyformer.models.decoder import DecoderLM
    from tinyformer.presets import get_preset
    from tinyformer.run_folder import save_model

    tok = build_tokenizer("bpe", corpus.read_text(encoding="utf-8"), bpe_vocab)
    cfg = get_preset("stories15m")  # vocab 32000 as in llama2.c; ids beyond the BPE's decode to no text
    if max_seq_len is not None:
        cfg = dataclasses.replace(cfg, max_seq_len=max_seq_len)
    torch.manual_seed(0)
    save_model(run, DecoderLM(cfg))
    tok.save(run)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def one_request(client, url: str, body: dict) -> tuple[float, float, int]:
    """(latency s, time to first chunk s, completion tokens) of one streamed completion."""
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if first is None:
                first = time.perf_counter() - t0
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return time.perf_counter() - t0, first or 0.0, tokens


async def run_level(base: str, model: str, prompts: list[str], clients: int, per_client: int,
                    max_tokens: int) -> dict:
    import httpx

    url = base + "/v1/completions"
    results: list[tuple[float, float, int]] = []
    rng = random.Random(clients)

    async def worker(client) -> None:
        for _ in range(per_client):
            body = {"model": model, "prompt": rng.choice(prompts), "max_tokens": max_tokens, "temperature": 0.8,
                    "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
            results.append(await one_request(client, url, body))

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        wall = time.perf_counter() - t0
    lat = [r[0] for r in results]
    tokens = sum(r[2] for r in results)
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "p50_s": percentile(lat, 0.5), "p99_s": percentile(lat, 0.99),
            "ttfc_p50_s": statistics.median(r[1] for r in results)}


async def ttft(base: str, model: str, prompts: list[list[int]]) -> list[float]:
    """Seconds each 1-token request takes when all of ``prompts`` are sent at the same moment."""
    import httpx

    url = base + "/v1/completions"
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(ids: list[int]) -> float:
            t0 = time.perf_counter()
            r = await client.post(url, json={"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.8})
            r.raise_for_status()
            return time.perf_counter() - t0

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def start_server(run: Path, args: argparse.Namespace, extra: list[str]) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinyformer", "serve", "--model", str(run), "--port", "0", "--model-name", "m",
         "--max-batch", str(args.max_batch), "--max-queue", "256", "--threads", str(args.threads),
         "--log-level", "warning", *extra],
        stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    while line.startswith("compiling"):  # --compile announces its start-up compilation first
        print(f"server: {line.strip()}", flush=True)
        line = proc.stdout.readline()
    match = re.search(r"(http://[^ ]+:\d+)", line)
    if not match:
        proc.kill()
        raise RuntimeError(f"the server did not start: {line!r}")
    print(f"server: {line.strip()}", flush=True)
    return proc, match.group(1)


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


GENERATE_REF = """
import sys, time, torch
from tinyformer.generation.generator import Generator
from tinyformer.generation.sampling import SamplingParams
run, n, threads, compile_ = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
prompts = [line for line in sys.stdin.read().split("\\n") if line]
torch.set_num_threads(threads)
gen = Generator.from_run(run, compile=compile_)
gen.eos_token_id = None
rates = []
for i, p in enumerate(prompts):
    gen.generate([p], SamplingParams(temperature=0.8, max_new_tokens=n), logprobs=False)
    if i:  # the first request compiles
        rates.append(gen.timings.decode_tokens_per_s)
rates.sort()
print(rates[len(rates) // 2])
"""


def generate_reference(run: Path, prompts: list[str], n: int, threads: int, compile_: bool) -> float:
    """Median decode tokens/s of Generator (as `tinyformer generate`) over the prompts, first one excluded."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", GENERATE_REF, str(run), str(n), str(threads), "1" if compile_ else "0"],
                         input="\n".join(prompts), capture_output=True, text=True, env=env, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=3, help="repeat every level this often; report the median")
    ap.add_argument("--requests", type=int, default=8,
                    help="requests per level at C=1; each level runs max(this, 2*C) rounded to a multiple of C")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the server (default 1: with 2 cores shared with the clients, and "
                         "often other jobs, a second OpenMP thread mostly waits at barriers)")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--bpe-vocab", type=int, default=8192)
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                    help=f"text for the tokenizer and prompts (default {DEFAULT_CORPUS})")
    ap.add_argument("--compile", action="store_true", help="serve with --compile")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--single", type=int, default=6, help="single-client requests for decode tokens/s (0: skip)")
    ap.add_argument("--ttft-clients", type=int, default=16, help="0 skips the time-to-first-token level")
    ap.add_argument("--ttft-prompt-tokens", type=int, default=200)
    ap.add_argument("--prefix-cache-mb", type=int, default=0, help="> 0 runs the shared-system-prompt level")
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--prefix-context", type=int, default=1152)
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = ap.parse_args()
    if not args.corpus.is_file():
        print(f"corpus {args.corpus} not found; pass --corpus", file=sys.stderr)
        return 2

    text = args.corpus.read_text(encoding="utf-8")
    lines = [ln.strip() for ln in text.splitlines() if len(ln.strip()) > 20]
    prompts = [" ".join(lines[i : i + 3]) for i in range(0, min(len(lines), 3000), 7)]

    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp:
        run = Path(tmp) / "stories15m"
        make_run(run, args.corpus, args.bpe_vocab)
        extra = ["--prefill-chunk", str(args.prefill_chunk)] + (["--compile"] if args.compile else [])
        proc, base = start_server(run, args, extra)
        summary: dict[str, float] = {}
        try:
            print(f"model: stories15m shape, random weights; {args.max_tokens} tokens per request, "
                  f"temperature 0.8; server threads {args.threads}; max batch {args.max_batch}; "
                  f"compile {args.compile}; prefill chunk {args.prefill_chunk}")
            for c in args.clients:  # warm-up (with --compile: every batch size's graph)
                asyncio.run(run_level(base, "m", prompts, c, 1, args.max_tokens))
            runs: dict[int, list[dict]] = {c: [] for c in args.clients}
            for round_ in range(args.rounds):  # levels alternate, so drifting machine load hits all alike
                for c in args.clients:
                    n = max(args.requests, 2 * c)
                    r = asyncio.run(run_level(base, "m", prompts, c, -(-n // c), args.max_tokens))
                    runs[c].append(r)
                    print(f"  round {round_ + 1} C={c:<3} {r['requests']:>4} requests  {r['tokens_per_s']:8.1f} tok/s  "
                          f"p50 {r['p50_s']:6.2f} s  p99 {r['p99_s']:6.2f} s  first chunk p50 "
                          f"{r['ttfc_p50_s']:6.3f} s", flush=True)
            # per level: the round with the median throughput
            rows = [sorted(runs[c], key=lambda r: r["tokens_per_s"])[(len(runs[c]) - 1) // 2] for c in args.clients]
            rng = random.Random(0)
            if args.ttft_clients:
                long_prompts = [[rng.randrange(3, args.bpe_vocab) for _ in range(args.ttft_prompt_tokens)]
                                for _ in range(args.ttft_clients + 3)]
                asyncio.run(ttft(base, "m", long_prompts[:2]))  # warm-up: a batch of two new prompts
                alone = statistics.median(asyncio.run(ttft(base, "m", [p]))[0] for p in long_prompts[-3:])
                together = statistics.median(asyncio.run(ttft(base, "m", long_prompts[: args.ttft_clients])))
                summary.update(ttft_alone_s=alone, ttft_together_p50_s=together, ttft_ratio=together / alone)
                print(f"  TTFT, {args.ttft_prompt_tokens}-token prompt: alone {alone:.3f} s; {args.ttft_clients} "
                      f"together p50 {together:.3f} s", flush=True)
            if args.single:
                some = prompts[: args.single]
                t1 = statistics.median(asyncio.run(ttft(base, "m", [p]))[0] for p in some)
                lat = [asyncio.run(run_level(base, "m", [p], 1, 1, args.max_tokens))["p50_s"] for p in some]
                summary["serve_decode_tps"] = (args.max_tokens - 1) / (statistics.median(lat) - t1)
        finally:
            stop_server(proc)
        if args.single:
            summary["generate_compile_decode_tps"] = generate_reference(run, prompts[: args.single + 1],
                                                                        args.max_tokens, args.threads, True)
        if args.prefix_cache_mb > 0:
            prun = Path(tmp) / "long"
            make_run(prun, args.corpus, args.bpe_vocab, max_seq_len=args.prefix_context)
            proc, base = start_server(prun, args, ["--prefix-cache-mb", str(args.prefix_cache_mb)])
            try:
                rng = random.Random(1)
                system = [rng.randrange(3, args.bpe_vocab) for _ in range(args.prefix_tokens)]
                first = asyncio.run(ttft(base, "m", [system + [5, 6, 7, 8]]))[0]
                second = asyncio.run(ttft(base, "m", [system + [9, 10, 11, 12, 13]]))[0]
                summary.update(prefix_first_s=first, prefix_second_s=second, prefix_ratio=second / first)
            finally:
                stop_server(proc)

    base_tps = rows[0]["tokens_per_s"]
    print()
    print(f"{'clients':>8} {'tok/s':>9} {'x vs C=' + str(rows[0]['clients']):>10} {'p50 s':>7} {'p99 s':>7}")
    for r in rows:
        r["ratio"] = r["tokens_per_s"] / base_tps
        print(f"{r['clients']:>8} {r['tokens_per_s']:>9.1f} {r['ratio']:>10.2f} {r['p50_s']:>7.2f} {r['p99_s']:>7.2f}")
    if 16 in args.clients and 1 in args.clients:
        ratio = next(r for r in rows if r["clients"] == 16)["ratio"]
        verdict = "met" if ratio >= 8 else "NOT met"
        print(f"\n16 clients vs 1: {ratio:.2f}x aggregate tokens/s (target >= 8x): {verdict}")
    if "serve_decode_tps" in summary:
        r = summary["serve_decode_tps"] / summary["generate_compile_decode_tps"]
        print(f"single client decode: serve {summary['serve_decode_tps']:.1f} tok/s vs generate --compile "
              f"{summary['generate_compile_decode_tps']:.1f} tok/s: {r:.2f}x (target >= 0.9x)")
    if "ttft_ratio" in summary:
        print(f"TTFT p50 of {args.ttft_clients} clients together vs alone: {summary['ttft_ratio']:.2f}x (target <= 3x)")
    if "prefix_ratio" in summary:
        print(f"shared {args.prefix_tokens}-token system prompt: TTFT second {summary['prefix_second_s']:.3f} s vs "
              f"first {summary['prefix_first_s']:.3f} s: {summary['prefix_ratio']:.2f}x (target <= 0.2x)")
    print(f"load average at the end: {os.getloadavg()}")
    if args.json:
        print(json.dumps({"levels": rows, **summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
