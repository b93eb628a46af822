"""Training step and single-token decode: tinyformer vs transformers.LlamaForCausalLM, same weights.

For each shape, both models hold identical weights (mapped with tinyformer.families). Timings
alternate between the two implementations (A, B, A, B, ...) so that load from other processes hits
both alike, and the median is reported. Peak memory is measured in a fresh subprocess per
(implementation, shape): the peak resident set size during the training steps.

    python benchmarks/bench_model.py                # both shapes, 2 threads
    python benchmarks/bench_model.py --shapes stories15m --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

SHAPES = {
    # llama2.c stories15M: d 288, 6 layers, 6 heads, SwiGLU 768, vocab 32000
    "stories15m": dict(preset="stories15m", batch=8, seq=256),
    # ~110M LLaMA: d 768, 12 layers, 12 heads, SwiGLU 2048, vocab 32000
    "llama-110m": dict(preset="llama-110m", batch=8, seq=256),
}


def build_pair(preset: str):
    from tinyformer.presets import get_preset

    return build_pair_from_config(get_preset(preset))


def build_pair_from_config(cfg):
    """(cfg, tinyformer DecoderLM, transformers LlamaForCausalLM) holding the same random weights."""
    import transformers

    from tinyformer.families import config_to_hf, tinyformer_to_hf
    from tinyformer.models.decoder import DecoderLM

    torch.manual_seed(0)
    ours = DecoderLM(cfg)
    hf_cfg = config_to_hf(cfg)
    config = transformers.LlamaConfig(**{k: v for k, v in hf_cfg.items() if k != "architectures"})
    config._attn_implementation = "sdpa"
    hf = transformers.LlamaForCausalLM(config)
    hf.load_state_dict(dict(tinyformer_to_hf(cfg, ours.state_dict())), strict=False)
    return cfg, ours, hf


def train_step_fn(model, kind: str, x, y):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        if kind == "ours":
            loss = model.loss(x, y)
        else:
            loss = model(input_ids=x, labels=None).logits
            loss = torch.nn.functional.cross_entropy(loss.view(-1, loss.size(-1)), y.view(-1))
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def decode_step_fn(model, kind: str, cfg, prompt_len: int = 64):
    """One-token decode with a KV cache already holding `prompt_len` tokens."""
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len))
    tok = torch.randint(0, cfg.vocab_size, (1, 1))
    if kind == "ours":
        cache = model.new_cache(1, max_len=prompt_len + 4096)
        with torch.inference_mode():
            model(prompt, cache=cache, last_only=True)

        def step() -> None:
            with torch.inference_mode():
                model(tok, cache=cache, last_only=True)
                cache.length = prompt_len  # rewind so every step sees the same context length
        return step
    import transformers

    def step() -> None:
        with torch.inference_mode():
            past = transformers.DynamicCache(config=model.config)
            out = model(prompt, past_key_values=past, use_cache=True)
            past = out.past_key_values
        return past

    # HF's cache grows by concatenation; prefill once, then crop back after each step
    past = step()

    def hf_step() -> None:
        with torch.inference_mode():
            model(tok, past_key_values=past, use_cache=True, logits_to_keep=1)
            past.crop(-1)  # drop the token just appended
    return hf_step


def timed(fn, warmup: int, reps: int, cpu: list[float] | None = None) -> list[float]:
    """Wall seconds of each of ``reps`` calls; ``cpu`` (if given) receives their process CPU seconds (all
    threads), which other jobs on a shared machine inflate much less than the wall time."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.process_time() - c0)
    return times


def interleaved(fns: dict, warmup: int, reps: int, cpu: dict[str, list[float]] | None = None
                ) -> dict[str, list[float]]:
    for fn in fns.values():
        timed(fn, warmup, 0)
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            out[k] += timed(fn, 0, 1, None if cpu is None else cpu.setdefault(k, []))
    return out


def peak_memory_child(kind: str, shape: str, steps: int) -> None:
    """Runs in a subprocess: build, train `steps` steps, print the peak RSS in MiB."""
    spec = SHAPES[shape]
    cfg, ours, hf = build_pair(spec["preset"])
    model = ours if kind == "ours" else hf
    del ours, hf  # only the measured model stays alive
    x = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq"]))
    y = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq"]))
    import gc

    gc.collect()
    reset_peak_rss()  # building both models does not count
    step = train_step_fn(model, kind, x, y)
    for _ in range(steps):
        step()
    print(json.dumps({"peak_mib": peak_rss_mib()}))


def reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS counter of this process (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mib() -> float:
    """Peak resident set size of this process since the last ``reset_peak_rss``, in MiB (Linux)."""
    with open("/proc/self/status") as f:
        status = {line.split(":")[0]: line.split()[1] for line in f if len(line.split()) > 1}
    return int(status["VmHWM"]) / 1024  # VmHWM is in KiB


def run_json_child(kind: str, cmd: list[str], threads: int) -> dict:
    """Run one side of a comparison in its own process (``threads`` OpenMP threads) and return the JSON object
    its last stdout line holds; a failed child stops the benchmark with the end of its stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{kind} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def load_hf_causal_lm(folder: str, threads: int):
    """(model, tokenizer) of a Hugging Face folder in float32, with ``threads`` intra-op threads and a pad token
    (the EOS token when it has none): the TRL side of bench_dpo.py and bench_grpo.py."""
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--steps", type=int, default=8, help="timed training steps per implementation")
    ap.add_argument("--decode-steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args._child:
        peak_memory_child(args._child[0], args._child[1], 3)
        return
    print(f"torch {torch.__version__}, {args.threads} threads, fp32 CPU")
    rows = []
    for shape in args.shapes:
        spec = SHAPES[shape]
        cfg, ours, hf = build_pair(spec["preset"])
        x = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq"]))
        y = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq"]))
        # same weights, same input: the losses must agree before any timing means anything
        with torch.no_grad():
            l_ours = float(ours.loss(x, y))
            logits = hf(input_ids=x).logits
            l_hf = float(torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)))
        assert abs(l_ours - l_hf) < 1e-4, (l_ours, l_hf)
        train = interleaved({"ours": train_step_fn(ours, "ours", x, y), "hf": train_step_fn(hf, "hf", x, y)},
                            warmup=2, reps=args.steps)
        dec = interleaved({"ours": decode_step_fn(ours, "ours", cfg), "hf": decode_step_fn(hf, "hf", cfg)},
                          warmup=5, reps=args.decode_steps)
        row = {
            "shape": shape,
            "params": sum(p.numel() for p in ours.parameters()),
            "train_ms": {k: 1000 * statistics.median(v) for k, v in train.items()},
            "decode_ms": {k: 1000 * statistics.median(v) for k, v in dec.items()},
        }
        del ours, hf
        if not args.skip_memory:
            row["peak_mib"] = {}
            for kind in ("ours", "hf"):
                out = subprocess.run([sys.executable, __file__, "--threads", str(args.threads), "--_child", kind,
                                      shape], capture_output=True, text=True, check=True, env=os.environ)
                row["peak_mib"][kind] = json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]
        rows.append(row)
        tr, de = row["train_ms"], row["decode_ms"]
        print(f"\n{shape} ({row['params'] / 1e6:.1f}M params, batch {spec['batch']} x seq {spec['seq']})")
        print(f"  train step (fwd+bwd+AdamW)  tinyformer {tr['ours']:8.1f} ms   HF {tr['hf']:8.1f} ms   "
              f"speed-up {tr['hf'] / tr['ours']:.2f}x")
        print(f"  decode 1 token (ctx 64)     tinyformer {de['ours']:8.2f} ms   HF {de['hf']:8.2f} ms   "
              f"speed-up {de['hf'] / de['ours']:.2f}x")
        if "peak_mib" in row:
            pm = row["peak_mib"]
            print(f"  peak RSS during training    tinyformer {pm['ours']:8.0f} MiB  HF {pm['hf']:8.0f} MiB  "
                  f"ratio {pm['ours'] / pm['hf']:.2f}")
    print("\nJSON " + json.dumps(rows))


if __name__ == "__main__":
    main()
