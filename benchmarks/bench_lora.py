"""Fine-tuning step on the SmolLM2-135M shape: tinyformer LoRA vs transformers + peft, and full vs transformers.

The shape is built offline from SmolLM2-135M's config values (hidden 576, 30 layers, 9 heads, 3 K/V heads,
intermediate 1536, vocab 49152, tied embeddings, RoPE theta 1e5); weights are random but identical on both
sides (mapped with tinyformer.families), and so are the LoRA A matrices (mapped with
tinyformer.interop.peft), so both sides compute the same losses: the benchmark checks that the step-0 and
step-1 losses agree before it times anything. One step = causal-LM loss on the same (B, T) token batch,
backward, AdamW (foreach, the same on both sides) over the trainable tensors: rank-8 adapters on every
linear layer (q, k, v, o, gate, up, down; alpha 8, no dropout) for LoRA, every weight for full fine-tuning.

Timings run in rounds: each round times ``--steps`` steps of one implementation, then ``--steps`` of the
other, the order swapped every round (A B, B A, A B, ...), so that load from other processes hits both alike.
Both use the same ``--threads`` (``torch.set_num_threads``; one process, so one setting; nothing here reads
the load). Reported: the median step over all rounds as tokens/s of wall time and per CPU second (all
threads of the process), and the ratio of each round (median step of the other side / of ours in that
round) with its min-max spread, which says how much the load moved the comparison. On a shared 2-core
machine, 2 threads per process means that an intra-op parallel region waits for a thread the kernel has
descheduled; ``--threads 1`` has no such waits and is the steadier comparison there. Peak memory is measured in
a fresh subprocess per (implementation, mode): the peak resident set size during the training steps (after model
construction).

    python benchmarks/bench_lora.py                      # SmolLM2-135M shape, batch 2 x 256, 2 threads
    python benchmarks/bench_lora.py --layers 4 --rounds 4 --steps 2 --threads 1 --skip-memory
    python benchmarks/bench_lora.py --small --steps 2    # a tiny shape: checks that the script runs
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from bench_model import build_pair_from_config, peak_rss_mib, reset_peak_rss, timed

RANK = 8


def model_config(small: bool, layers: int = 30):
    from tinyformer.presets import get_preset

    if small:
        return get_preset("llama-110m", d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=128, vocab_size=512,
                          tie_embeddings=True, max_seq_len=512)
    return get_preset("llama-110m", d_model=576, n_layer=layers, n_head=9, n_kv_head=3, d_ff=1536, vocab_size=49152,
                      tie_embeddings=True, rope_theta=100000.0, norm_eps=1e-5, max_seq_len=2048)


def compile_blocks(ours, hf) -> None:
    """``torch.compile`` every transformer block on both sides, in place (the head and loss stay eager)."""
    for block in ours.blocks:
        block.compile()
    inner = hf.get_base_model() if hasattr(hf, "get_base_model") else hf
    for layer in inner.model.layers:
        layer.compile()


def build(kind: str, mode: str, small: bool, layers: int = 30):
    """(ours, hf) with the same weights; with mode 'lora', both carry the same rank-8 adapters."""
    from tinyformer.components.lora import LoRAConfig, adapter_state_dict, apply_lora
    from tinyformer.interop.peft import HF_MODULES, peft_tensors

    cfg, ours, hf = build_pair_from_config(model_config(small, layers))
    if mode == "lora":
        import peft

        apply_lora(ours, LoRAConfig(RANK))
        targets = sorted({m.split(".")[1] for m in HF_MODULES.values()})
        hf = peft.get_peft_model(hf, peft.LoraConfig(r=RANK, lora_alpha=RANK, lora_dropout=0.0,
                                                     target_modules=targets, task_type="CAUSAL_LM"))
        missing = peft.set_peft_model_state_dict(hf, peft_tensors(adapter_state_dict(ours)))
        assert not missing.unexpected_keys, missing.unexpected_keys
    hf.train()
    ours.train()
    return cfg, ours, hf


def step_fn(model, kind: str, x, y):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0,
                            foreach=True)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        if kind == "ours":
            loss = model.loss(x, y)
        else:
            logits = model(input_ids=x, use_cache=False).logits  # no KV cache object: nothing to recompile on
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def batch(cfg, b: int, t: int, prompt_fraction: float = 0.0):
    """(inputs, targets) (b, t); the first ``prompt_fraction`` of each row's targets are -100, as the masked
    prompt of an SFT example (both sides ignore them: cross_entropy's default ignore_index)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (b, t + 1), generator=g)
    y = ids[:, 1:].clone()
    y[:, :int(prompt_fraction * t)] = -100
    return ids[:, :-1].contiguous(), y


def peak_memory_child(kind: str, mode: str, small: bool, b: int, t: int, steps: int, layers: int,
                      prompt_fraction: float, compile_: bool) -> None:
    """Runs in a subprocess: build, train ``steps`` steps of one implementation, print the peak RSS in MiB."""
    cfg, ours, hf = build(kind, mode, small, layers)
    if compile_:
        compile_blocks(ours, hf)
    model = ours if kind == "ours" else hf
    del ours, hf  # only the measured model stays alive
    gc.collect()
    x, y = batch(cfg, b, t, prompt_fraction)
    reset_peak_rss()  # construction does not count
    step = step_fn(model, kind, x, y)
    for _ in range(steps):
        step()
    print(json.dumps({"peak_mib": peak_rss_mib()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per implementation and round")
    ap.add_argument("--rounds", type=int, default=4, help="rounds, the order of the two swapped every round")
    ap.add_argument("--layers", type=int, default=30, help="transformer layers of the shape (SmolLM2-135M: 30)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-fraction", type=float, default=0.0,
                    help="share of each row's targets masked with -100 (an SFT example's prompt); default none")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile every transformer block on both sides (compile time reported apart)")
    ap.add_argument("--small", action="store_true", help="a tiny shape, to check that the script runs")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args._child:
        peak_memory_child(args._child[0], args._child[1], args.small, args.batch, args.seq, 2, args.layers,
                          args.prompt_fraction, args.compile)
        return
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads for both, fp32 CPU, batch {args.batch} x "
          f"{args.seq}, {args.layers} layers, {args.rounds} rounds of {args.steps} steps, prompt fraction "
          f"{args.prompt_fraction}, {'compiled blocks' if args.compile else 'eager'}; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start")
    rows = []
    for mode in args.modes:
        cfg, ours, hf = build("both", mode, args.small, args.layers)
        x, y = batch(cfg, args.batch, args.seq, args.prompt_fraction)
        if args.compile:
            compile_blocks(ours, hf)
        steps = {"ours": step_fn(ours, "ours", x, y), "hf": step_fn(hf, "hf", x, y)}
        # same weights, adapters and data: the losses agree at step 0 and, after one update, at step 1;
        # with --compile the first two steps also compile (forward and backward graphs): timed apart
        first, compile_s = {}, {}
        for k, fn in steps.items():
            t0 = time.perf_counter()
            first[k] = [fn(), fn()]
            compile_s[k] = time.perf_counter() - t0
        for i in range(2):
            assert abs(first["ours"][i] - first["hf"][i]) < 1e-3, (mode, first)
        cpu: dict[str, list[float]] = {"ours": [], "hf": []}
        times: dict[str, list[float]] = {"ours": [], "hf": []}
        round_ratios = []
        for r in range(args.rounds):
            medians = {}
            for kind in (("ours", "hf") if r % 2 == 0 else ("hf", "ours")):
                t = timed(steps[kind], 0, args.steps, cpu[kind])
                times[kind] += t
                medians[kind] = statistics.median(t)
            round_ratios.append(medians["hf"] / medians["ours"])
            print(f"  {mode} round {r + 1}: ours {medians['ours']:.2f} s/step, HF {medians['hf']:.2f} s/step, "
                  f"ratio {round_ratios[-1]:.2f}x, load {os.getloadavg()[0]:.2f}", flush=True)
        trainable = sum(p.numel() for p in ours.parameters() if p.requires_grad)
        total = sum(p.numel() for p in ours.parameters())
        row = {"mode": mode, "params": total, "trainable": trainable, "losses": first, "round_ratios": round_ratios,
               "first_two_steps_s": compile_s,
               "tokens_per_s": {k: args.batch * args.seq / statistics.median(v) for k, v in times.items()},
               "tokens_per_cpu_s": {k: args.batch * args.seq / statistics.median(v) for k, v in cpu.items()}}
        del ours, hf, steps
        gc.collect()
        if not args.skip_memory:
            row["peak_mib"] = {}
            for kind in ("ours", "hf"):
                cmd = [sys.executable, __file__, "--threads", str(args.threads), "--batch", str(args.batch),
                       "--layers", str(args.layers), "--prompt-fraction", str(args.prompt_fraction),
                       *(["--compile"] if args.compile else []),
                       "--seq", str(args.seq), *(["--small"] if args.small else []), "--_child", kind, mode]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ)
                row["peak_mib"][kind] = json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]
        rows.append(row)
        tps, tpc = row["tokens_per_s"], row["tokens_per_cpu_s"]
        what = f"LoRA r={RANK}, all linear layers" if mode == "lora" else "full fine-tuning"
        print(f"\n{what}: {trainable / 1e6:.2f}M of {total / 1e6:.1f}M parameters trained "
              f"({100 * trainable / total:.2f}%)")
        print(f"  step loss agreement (steps 0, 1): tinyformer {first['ours'][0]:.5f} {first['ours'][1]:.5f}, "
              f"HF {first['hf'][0]:.5f} {first['hf'][1]:.5f}")
        print(f"  first two steps (with --compile: compilation included): tinyformer {compile_s['ours']:.1f} s, "
              f"HF {compile_s['hf']:.1f} s")
        print(f"  tokens/s   tinyformer {tps['ours']:8.1f}   transformers{' + peft' if mode == 'lora' else ''} "
              f"{tps['hf']:8.1f}   ratio {tps['ours'] / tps['hf']:.2f}x (rounds: median "
              f"{statistics.median(round_ratios):.2f}x, spread {min(round_ratios):.2f}-{max(round_ratios):.2f}x)")
        print(f"  tokens per CPU second (all threads)   tinyformer {tpc['ours']:8.1f}   HF {tpc['hf']:8.1f}   "
              f"ratio {tpc['ours'] / tpc['hf']:.2f}x")
        if "peak_mib" in row:
            pm = row["peak_mib"]
            print(f"  peak RSS during training   tinyformer {pm['ours']:8.0f} MiB   HF {pm['hf']:8.0f} MiB   "
                  f"ratio {pm['ours'] / pm['hf']:.2f}")
    load = os.getloadavg()
    print(f"\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end")
    print("JSON " + json.dumps(rows))


if __name__ == "__main__":
    main()
