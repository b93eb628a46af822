"""One prepared check of a GPU machine (~5 minutes, no downloads): is the GPU path right, and how fast is it?

    bash benchmarks/gpu_check.sh                      # on the GPU machine, from the repository root
    python benchmarks/gpu_check.py --device cpu --tiny --peak-flops 1e11   # the same steps on CPU, in seconds

Sections, each printing as it goes; a short table comes last (and ``--json PATH`` writes it):

1. parity: the GPU forward of a GPT-2-shaped and a LLaMA-shaped model against the CPU forward of the same
   weights, float32 with TF32 off (max |logit difference| relative to max |logit|, bound 2e-4), and the
   fused SDPA kernels against the explicit attention formula (``attn_impl="reference"``), float32 and bf16.
2. training: gpt2-124m and a ~350M shape (gpt2-350m), vocabulary padded to a multiple of 128 as nanoGPT
   does, bf16 autocast, torch.compile, fused AdamW, synthetic tokens. Warm-up steps (compilation) are not
   timed; the timed steps are CUDA-synchronised. MFU = tokens/s x sizing.training_flops_per_token / peak.
3. decode: greedy tokens/s against the KV cache, bf16 weights, batch 1 and 16.
4. distributed smoke (when numpy, safetensors and tqdm are installed): a one-rank process group (NCCL on a
   GPU) trains with FSDP2 + bf16 mixed precision and with DDP, checkpoints, resumes and compares weights.

Only torch and tinyformer's model code are needed for 1-3 (the image may lack numpy, safetensors, tokenizers,
yaml, tqdm). Exit status: 0 when every check passed, 1 otherwise (the table says which).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tinyformer.config import ModelConfig
from tinyformer.models.decoder import DecoderLM
from tinyformer.presets import get_preset
from tinyformer.sizing import training_flops_per_token
from tinyformer.training.device import Timer, device_peak_flops, enable_tf32, sdpa_backend
from tinyformer.training.optim import build_optimizer
from tinyformer.training.train_config import TrainConfig

PARITY_BOUND = 2e-4  # float32 GPU vs CPU, relative to max |logit|
SDPA_BOUND = {"float32": 2e-4, "bfloat16": 3e-2}


def padded(cfg: ModelConfig, multiple: int = 128) -> ModelConfig:
    """The config with its vocabulary rounded up (50257 -> 50304): tensor-core friendly, as nanoGPT does."""
    return cfg.replace(vocab_size=math.ceil(cfg.vocab_size / multiple) * multiple)


def shapes(tiny: bool) -> dict[str, dict[str, Any]]:
    """name -> (config, batch, seq_len) of the training and decode runs."""
    if tiny:
        small = ModelConfig(vocab_size=96, d_model=32, n_layer=2, n_head=2, d_ff=64, max_seq_len=32)
        gpt = get_preset("gpt2-124m", vocab_size=96, d_model=32, n_layer=2, n_head=2, max_seq_len=32)
        return {"gpt2-124m (tiny)": {"cfg": gpt, "batch": 4, "seq": 32},
                "gpt2-350m (tiny)": {"cfg": small, "batch": 2, "seq": 32}}
    return {"gpt2-124m": {"cfg": padded(get_preset("gpt2-124m")), "batch": 32, "seq": 1024},
            "gpt2-350m": {"cfg": padded(get_preset("gpt2-350m")), "batch": 16, "seq": 1024}}


def parity_configs(tiny: bool) -> dict[str, ModelConfig]:
    if tiny:
        return {"gpt2 (tiny)": get_preset("gpt2-124m", vocab_size=96, d_model=32, n_layer=2, n_head=2, max_seq_len=32),
                "llama (tiny)": get_preset("stories15m", vocab_size=96, d_model=32, n_layer=2, n_head=4, n_kv_head=2,
                                           d_ff=64, max_seq_len=32)}
    return {"gpt2-124m": get_preset("gpt2-124m"),
            "llama-110m (GQA 12/4)": get_preset("llama-110m", vocab_size=32000, n_kv_head=4)}


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-12))


# ---------------------------------------------------------------------------- 1. parity


@torch.no_grad()
def check_parity(device: torch.device, tiny: bool, rows: list[dict[str, Any]]) -> None:
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # exact float32 here
    try:
        for name, cfg in parity_configs(tiny).items():
            torch.manual_seed(0)
            cpu_model = DecoderLM(cfg).eval()
            x = torch.randint(0, cfg.vocab_size, (2, min(256, cfg.max_seq_len)),
                              generator=torch.Generator().manual_seed(1))
            ref = cpu_model(x)
            model = DecoderLM(cfg).to(device).eval()
            model.load_state_dict(cpu_model.state_dict())
            err = rel_err(model(x.to(device)).cpu(), ref)
            _row(rows, "parity", f"{name}: {device.type} vs cpu, float32", err, PARITY_BOUND)
            # fused SDPA against the explicit formula, on the device
            reference = DecoderLM(cfg.replace(attn_impl="reference")).to(device).eval()
            reference.load_state_dict(cpu_model.state_dict())
            exact = reference(x.to(device)).float()
            for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
                if dtype == torch.bfloat16 and device.type == "cpu" and not tiny:
                    continue
                with torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext():
                    fused = model(x.to(device)).float()
                _row(rows, "parity", f"{name}: sdpa vs reference, {dtype_name}", rel_err(fused, exact),
                     SDPA_BOUND[dtype_name])
            if device.type == "cuda":
                try:  # prove the flash kernel runs this model (bf16, head size 64)
                    with sdpa_backend("flash"), torch.autocast("cuda", dtype=torch.bfloat16):
                        flash = model(x.to(device)).float()
                    _row(rows, "parity", f"{name}: flash kernel vs reference, bf16", rel_err(flash, exact),
                         SDPA_BOUND["bfloat16"])
                except RuntimeError as exc:
                    _row(rows, "parity", f"{name}: flash kernel unavailable ({str(exc).splitlines()[0][:60]})",
                         math.inf, SDPA_BOUND["bfloat16"])
            del cpu_model, model, reference
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _row(rows: list[dict[str, Any]], section: str, what: str, value: float, bound: float) -> None:
    ok = value <= bound
    rows.append({"section": section, "what": what, "value": value, "bound": bound, "ok": ok})
    print(f"  [{'ok' if ok else 'FAIL'}] {what}: {value:.2e} (bound {bound:.0e})", flush=True)


# ---------------------------------------------------------------------------- 2. training


def train_throughput(name: str, cfg: ModelConfig, batch: int, seq: int, device: torch.device, *, compile_model: bool,
                     amp: torch.dtype | None, warmup: int, steps: int, peak: float | None) -> dict[str, Any]:
    """Tokens/s and MFU of the training step the trainer runs: autocast forward, cross-entropy on the
    logits in float32, backward, gradient clipping, fused AdamW."""
    torch.manual_seed(0)
    model = DecoderLM(cfg).to(device).train()
    optimizer = build_optimizer(model, TrainConfig(lr=3e-4, warmup_steps=0), device.type)
    step_model = torch.compile(model) if compile_model else model
    generator = torch.Generator(device=device).manual_seed(0)

    def step() -> float:
        x = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device, generator=generator)
        with torch.autocast(device.type, dtype=amp) if amp is not None else contextlib.nullcontext():
            logits = step_model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    with Timer(device) as warm:
        for _ in range(warmup):
            step()
    with Timer(device) as timed:
        for _ in range(steps):
            last = step()
    tokens_per_s = batch * seq * steps / timed.seconds
    flops_per_token = training_flops_per_token(cfg, seq)
    mfu = tokens_per_s * flops_per_token / peak if peak else None
    result = {"shape": name, "params": sum(p.numel() for p in model.parameters()), "batch": batch, "seq": seq,
              "warmup_s": warm.seconds, "step_s": timed.seconds / steps, "tokens_per_s": tokens_per_s,
              "flops_per_token": flops_per_token, "tflops": tokens_per_s * flops_per_token / 1e12, "mfu": mfu,
              "loss": float(last), "peak_memory_gb": (torch.cuda.max_memory_allocated(device) / 2**30
                                                      if device.type == "cuda" else None)}
    mfu_text = f"{100 * mfu:.1f}%" if mfu is not None else "n/a (no peak known; --peak-flops)"
    print(f"  {name}: {result['params'] / 1e6:.1f}M params, batch {batch} x {seq}, warm-up {warm.seconds:.1f} s, "
          f"{1000 * result['step_s']:.1f} ms/step, {tokens_per_s:,.0f} tokens/s, {result['tflops']:.1f} TFLOP/s, "
          f"MFU {mfu_text}", flush=True)
    return result


# ---------------------------------------------------------------------------- 3. decode


@torch.no_grad()
def decode_throughput(name: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, batch: int,
                      prompt: int, new_tokens: int) -> dict[str, Any]:
    """Greedy decoding against the KV cache: prefill ``prompt`` tokens, then ``new_tokens`` single-token steps."""
    torch.manual_seed(0)
    model = DecoderLM(cfg).to(device=device, dtype=dtype).eval()
    x = torch.randint(0, cfg.vocab_size, (batch, prompt), device=device)

    def run(n: int) -> None:
        cache = model.new_cache(batch, prompt + n)
        token = model(x, cache=cache, last_only=True)[:, -1].argmax(-1)
        for _ in range(n - 1):
            token = model(token[:, None], cache=cache)[:, -1].argmax(-1)

    run(4)  # warm-up: kernels, allocator
    with Timer(device) as timer:
        run(new_tokens)
    tps = batch * new_tokens / timer.seconds
    print(f"  {name}: batch {batch}, prompt {prompt}, {new_tokens} new tokens: {tps:,.0f} tokens/s "
          f"({1000 * timer.seconds / new_tokens:.2f} ms/step)", flush=True)
    return {"shape": name, "batch": batch, "prompt": prompt, "new_tokens": new_tokens, "tokens_per_s": tps}


# ---------------------------------------------------------------------------- 4. distributed smoke


def distributed_smoke(device: torch.device, tiny: bool, rows: list[dict[str, Any]]) -> None:
    """A one-rank process group through the real trainer: FSDP2 (+ bf16 mixed precision on GPU) and DDP,
    each trained 4 steps straight and 2 + resume + 2 from a consolidated checkpoint (compiled on GPU)."""
    import socket

    from tinyformer.training.distributed import init_distributed, shutdown_distributed
    from tinyformer.training.objectives import Objective
    from tinyformer.training.trainer import Trainer

    class Synthetic(Objective):
        name, uses_corpus = "synthetic", False

        def get_batch(self, split, generator, rank=0, world_size=1):
            x = torch.randint(0, cfg.vocab_size, (4, 33), generator=generator)
            return {"input_ids": x[:, :-1], "targets": x[:, 1:]}

        def loss(self, model, batch):
            return F.cross_entropy(model(batch["input_ids"]).flatten(0, 1).float(), batch["targets"].flatten())

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cfg = ModelConfig(vocab_size=128, d_model=64, n_layer=2, n_head=2, d_ff=128, max_seq_len=32)
    init_distributed()
    try:
        for parallel in ("fsdp", "ddp"):
            with tempfile.TemporaryDirectory() as tmp:
                finals = []
                for run, resume in (("straight", None), ("resumed", "straight/state/step-000002")):
                    run_dir = Path(tmp) / run
                    run_dir.mkdir()
                    tc = TrainConfig(max_steps=4, batch_size=4, block_size=32, checkpoint_interval=2, eval_interval=100,
                                     lr=1e-3, warmup_steps=1, sample_tokens=0, progress=False, tensorboard=False,
                                     device=device.type, dtype="bfloat16" if device.type == "cuda" else "float32",
                                     parallel=parallel, compile=device.type == "cuda")
                    trainer = Trainer(cfg, tc, Synthetic(tc, None, None), run_dir, rank=0, world_size=1)
                    if resume:
                        trainer.restore(Path(tmp) / resume)
                    trainer.fit()
                    from safetensors.torch import load_file

                    finals.append(load_file(str(run_dir / "model.safetensors")))
                # bitwise on CPU; GPU kernels (atomics in backward) may differ in the last bits
                err = max(rel_err(finals[1][k], finals[0][k]) for k in finals[0])
                _row(rows, "distributed", f"{parallel}, 1 rank on {device.type}: resumed vs straight weights", err,
                     0.0 if device.type == "cpu" else 1e-2)
    finally:
        shutdown_distributed()


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run of every step)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, few steps: checks the script itself in seconds")
    p.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s of one device (default: known GPUs)")
    p.add_argument("--no-compile", action="store_true", help="time the eager model (default on CPU)")
    p.add_argument("--steps", type=int, default=None, help="timed training steps per shape (default 20; tiny 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps (default 3; tiny 1)")
    p.add_argument("--skip", default="", help="comma-separated sections to skip: parity,train,decode,dist")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; run with --device cpu --tiny for a dry run", file=sys.stderr)
        return 2
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    steps = args.steps or (2 if args.tiny else 20)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    compile_model = not args.no_compile and device.type == "cuda"
    amp = torch.bfloat16 if device.type == "cuda" else None
    peak = device_peak_flops(device, args.peak_flops)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_check: torch {torch.__version__}, device {name}, peak {peak / 1e12 if peak else 'unknown'} TFLOP/s "
          f"(bf16 dense), compile {compile_model}", flush=True)
    if device.type == "cuda":
        enable_tf32()  # what the trainer does; the parity section turns it off for its float32 comparison
    rows: list[dict[str, Any]] = []
    results: dict[str, Any] = {"device": name, "torch": torch.__version__, "peak_flops": peak, "checks": rows,
                               "train": [], "decode": []}
    t0 = time.perf_counter()
    if "parity" not in skip:
        print("1. parity", flush=True)
        check_parity(device, args.tiny, rows)
    if "train" not in skip:
        print(f"2. training ({'bf16 autocast' if amp else 'float32'}, fused AdamW, compile {compile_model})",
              flush=True)
        for shape, spec in shapes(args.tiny).items():
            results["train"].append(train_throughput(shape, spec["cfg"], spec["batch"], spec["seq"], device,
                                                     compile_model=compile_model, amp=amp, warmup=warmup, steps=steps,
                                                     peak=peak))
            if device.type == "cuda":  # the next shape starts from an empty allocator and a fresh peak
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
    if "decode" not in skip:
        print("3. decode (greedy, KV cache)", flush=True)
        shape, spec = next(iter(shapes(args.tiny).items()))
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        prompt, new = (8, 16) if args.tiny else (128, 256)
        for batch in (1, 16):
            results["decode"].append(decode_throughput(shape, spec["cfg"], device, dtype, batch, prompt, new))
    if "dist" not in skip:
        missing = [m for m in ("numpy", "safetensors", "tqdm") if importlib.util.find_spec(m) is None]
        if missing:
            print(f"4. distributed smoke skipped: {', '.join(missing)} not installed", flush=True)
        else:
            print("4. distributed smoke (one rank, real trainer, checkpoint and resume)", flush=True)
            distributed_smoke(device, args.tiny, rows)
    results["seconds"] = time.perf_counter() - t0

    print(f"\nsummary ({name}, {results['seconds']:.0f} s)")
    print(f"{'training shape':<22}{'batch x seq':>13}{'tokens/s':>12}{'TFLOP/s':>9}{'MFU':>7}")
    for r in results["train"]:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(f"{r['shape']:<22}{r['batch']:>6} x {r['seq']:<5}{r['tokens_per_s']:>12,.0f}{r['tflops']:>9.1f}{mfu:>7}")
    for r in results["decode"]:
        print(f"{'decode ' + r['shape']:<22}{'batch ' + str(r['batch']):>13}{r['tokens_per_s']:>12,.0f}")
    failed = [r["what"] for r in rows if not r["ok"]]
    print(f"checks: {len(rows) - len(failed)} of {len(rows)} passed"
          + (f"; FAILED: {'; '.join(failed)}" if failed else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
