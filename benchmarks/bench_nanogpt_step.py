"""nanoGPT's CPU Shakespeare-char recipe beside tinyformer's ``configs/shakespeare_char.yaml``: ms per iteration.

Both sides train on TinyShakespeare's characters (first 90% train, last 10% val), 4 layers, 4 heads,
d_model 128, block 64, batch 12, float32, on the CPU, for the same number of iterations:

    nanogpt      a GPT-2-style "baby GPT" and the training loop of nanoGPT's CPU recipe, written here from
                 the recipe's description (no nanoGPT code): token + learned position embeddings, Pre-LN
                 blocks (LayerNorm with bias), causal self-attention through F.scaled_dot_product_attention
                 with one fused qkv Linear (with bias), GELU MLP 4d, tied head, dropout 0, init N(0, 0.02)
                 with the residual projections at 0.02 / sqrt(2 n_layer); AdamW lr 1e-3, betas (0.9, 0.99),
                 weight decay 0.1 on the 2-D tensors only (embeddings included), torch's default (single-tensor,
                 unfused) implementation as nanoGPT's CPU run gets it (it asks for fused only on CUDA); lr set
                 each iteration (100 warm-up iterations, then cosine to 1e-4 at 2000); grad clip 1.0;
                 each batch re-opens a uint16 memmap (nanoGPT does, to avoid a memory leak) and draws its
                 12 windows with torch.randint, stacking int64 copies; ``loss.item()`` every
                 ``--nano-log-interval`` iterations (assumed 1: the README's CPU command passes
                 ``--log_interval=1``; the config file's own value is 10, and on a CPU the read-back costs
                 microseconds either way); no torch.compile (the CPU command passes ``--compile=False``).
    tinyformer   tinyformer's own Trainer on ``configs/shakespeare_char.yaml`` (its LLaMA-style model,
                 812,672 parameters against the baseline's 809,984 with its 65-character vocabulary), built
                 through the same ``prepare_run`` as ``tinyformer train --config configs/shakespeare_char.yaml
                 --data input.txt``, and stepped by ``Trainer.advance`` (the loop body of ``fit``: the update,
                 the running window and the metrics line every log_interval). Its settings are the config's,
                 ``compile`` included, unless ``--tf-set train.FIELD=VALUE`` changes them.

The two sides run in one process, alternating blocks of ``--block`` iterations (the order flips every block,
so neither always runs first after an evaluation), so that a change in machine load hits both alike.
Reported per side: wall ms and CPU ms (``time.process_time``, robust to other processes) per iteration
over the timed blocks, the ratio tinyformer / nanoGPT, and the exact validation loss (every
non-overlapping 64-token window of the val split) after each block, which is not timed; nor are a
tinyformer compile (its first step, reported on its own), checkpoints or samples. The CPU model and
the load average are printed next to the figures.

    python benchmarks/bench_nanogpt_step.py                        # 2000 iterations, blocks of 250
    python benchmarks/bench_nanogpt_step.py --iters 500 --block 100
    python benchmarks/bench_nanogpt_step.py --tf-set train.compile=false   # tinyformer eager
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared/data/tinyshakespeare/input.txt"
CONFIG = REPO / "configs/shakespeare_char.yaml"


# ----------------------------------------------------------------------------- the baseline model


class BabyBlock(nn.Module):
    """Pre-LN GPT-2 block: h = x + W_o attn(LN1(x)),  y = h + W_2 gelu(W_1 LN2(h) + b_1) + b_2."""

    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=2)  # (B, T, d) each
        q, k, v = (t.view(B, T, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, d / H)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class BabyGPT(nn.Module):
    """GPT-2-style LM: logits = E LN_f(blocks(E[x] + P[pos])), the head tied to the token table E."""

    def __init__(self, vocab: int, block: int, n_layer: int, n_head: int, d: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(BabyBlock(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:  # the residual projections scaled down by sqrt(2 n_layer), as GPT-2
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """idx, targets (B, T) -> mean cross-entropy over the full (B, T, vocab) logits."""
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class NanoLoop:
    """The baseline's training loop over uint16 .bin files (see the module docstring)."""

    def __init__(self, train_bin: Path, vocab: int, iters: int, log_interval: int, seed: int = 1337) -> None:
        torch.manual_seed(seed)
        self.train_bin, self.iters, self.log_interval = train_bin, iters, log_interval
        self.batch, self.block = 12, 64
        self.model = BabyGPT(vocab, self.block, n_layer=4, n_head=4, d=128)
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99))  # CPU: the for-loop implementation
        self.step = 0
        self.losses: list[float] = []
        self.x, self.y = self.get_batch()

    def lr(self, it: int) -> float:
        """100 warm-up iterations to 1e-3, cosine to 1e-4 at ``iters``."""
        warmup, top, floor = 100, 1e-3, 1e-4
        if it < warmup:
            return top * (it + 1) / (warmup + 1)
        ratio = min(1.0, (it - warmup) / max(1, self.iters - warmup))
        return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (top - floor)

    def get_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        data = np.memmap(self.train_bin, dtype=np.uint16, mode="r")  # re-opened each batch, as nanoGPT does
        ix = torch.randint(len(data) - self.block, (self.batch,))
        x = torch.stack([torch.from_numpy(data[i:i + self.block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + self.block].astype(np.int64)) for i in ix])
        return x, y

    def advance(self) -> None:
        for group in self.opt.param_groups:
            group["lr"] = self.lr(self.step)
        loss = self.model(self.x, self.y)
        self.x, self.y = self.get_batch()  # the next batch is drawn between forward and backward, as nanoGPT
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.step % self.log_interval == 0:
            self.losses.append(loss.item())
        self.step += 1

    @torch.no_grad()
    def val_loss(self, val: np.ndarray) -> float:
        """Mean loss over every non-overlapping 64-token window of ``val`` (tinyformer's exact evaluation)."""
        self.model.eval()
        starts = np.arange(0, len(val) - self.block, self.block)
        total = count = 0.0
        for b in range(0, len(starts), self.batch):
            s = starts[b:b + self.batch]
            x = torch.from_numpy(np.stack([val[i:i + self.block] for i in s]).astype(np.int64))
            y = torch.from_numpy(np.stack([val[i + 1:i + 1 + self.block] for i in s]).astype(np.int64))
            total += float(self.model(x, y)) * x.numel()
            count += x.numel()
        self.model.train()
        return total / count


# ----------------------------------------------------------------------------- the machine


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


# ----------------------------------------------------------------------------- main


def build_tinyformer(data: Path, out: Path, iters: int, overrides: list[str]):
    """tinyformer's trainer as ``tinyformer train --config configs/shakespeare_char.yaml`` builds it."""
    from tinyformer.training.runner import RunSpec, prepare_run
    from tinyformer.training.train_config import apply_override, read_run_file

    sections = read_run_file(CONFIG)
    for item in [f"train.data={data}", f"train.max_steps={iters}", "train.progress=false",
                 "train.tensorboard=false", *overrides]:
        apply_override(sections, item)
    spec = RunSpec(sections=sections, config_file=str(CONFIG), out=str(out))
    return prepare_run(spec, log=lambda _: None).trainer


PRODUCT_OPS = ("aten::mm", "aten::addmm", "aten::addmm_")


def profile_split(side: object, iters: int) -> dict[str, float]:
    """ms per iteration of ``iters`` more steps of ``side`` under torch.profiler (self CPU time): matrix
    products (mm, addmm), attention (every scaled_dot_product op, forward and backward, and bmm: the math backend's
    two products), the rest."""
    from torch.profiler import profile

    with profile(record_shapes=True) as prof:
        for _ in range(iters):
            side.advance()  # type: ignore[attr-defined]
    products = [(e.self_cpu_time_total / 1000 / iters, e.count // iters, e.input_shapes)
                for e in prof.key_averages(group_by_input_shape=True) if e.key in PRODUCT_OPS]
    for ms, calls, shapes in sorted(products, key=lambda r: -r[0])[:4]:  # the costliest products and their shapes
        print(f"    {ms:6.2f} ms in {calls} product(s) a step of {shapes}")
    split = {"products": 0.0, "attention": 0.0, "rest": 0.0}
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1000 / iters
        if event.key in PRODUCT_OPS:
            split["products"] += ms
        elif "scaled_dot_product" in event.key or event.key == "aten::bmm":  # bmm: SDPA's math backend
            split["attention"] += ms
        else:
            split["rest"] += ms
    rest = [(e.self_cpu_time_total / 1000 / iters, e.key) for e in prof.key_averages()
            if e.key not in PRODUCT_OPS and "scaled_dot_product" not in e.key and e.key != "aten::bmm"]
    print("    the rest's largest: " + ", ".join(f"{key[:48]} {ms:.2f}" for ms, key in sorted(rest, reverse=True)[:6]))
    split["total"] = sum(split.values())
    return split


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="TinyShakespeare input.txt")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--block", type=int, default=250, help="iterations per timed block (then both evaluate)")
    p.add_argument("--nano-log-interval", type=int, default=1, help="the baseline's loss.item() every N iterations")
    p.add_argument("--tf-set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="change tinyformer's config, e.g. train.compile=false (repeatable)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of both sides, tinyformer's train.threads too (default: torch's)")
    p.add_argument("--sides", nargs="+", default=["nanogpt", "tinyformer"], choices=["nanogpt", "tinyformer"])
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timed blocks, profile N more iterations of each side: ms per iteration in "
                        "matrix products, in attention (SDPA forward and backward) and in everything else")
    args = p.parse_args()
    if not args.data.is_file():
        raise SystemExit(f"{args.data} not found; pass --data PATH/TO/input.txt")

    if args.threads:
        torch.set_num_threads(args.threads)
        args.tf_set = [f"train.threads={args.threads}", *args.tf_set]
    tmp = Path(tempfile.mkdtemp(prefix="bench_nanogpt_step_"))
    text = args.data.read_text(encoding="utf-8")
    chars = sorted(set(text))  # nanoGPT's character vocabulary: the corpus' characters, sorted
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n_train = int(0.9 * len(ids))
    ids[:n_train].tofile(tmp / "train.bin")
    val = ids[n_train:]

    sides: dict[str, object] = {}
    compile_s = None
    if "tinyformer" in args.sides:
        tf = build_tinyformer(args.data, tmp / "run", args.iters, args.tf_set)
        sides["tinyformer"] = tf
    if "nanogpt" in args.sides:
        sides["nanogpt"] = NanoLoop(tmp / "train.bin", len(chars), args.iters, args.nano_log_interval)
    threads = torch.get_num_threads()
    print(f"CPU {cpu_model()} ({os.cpu_count()} logical), torch {torch.__version__}, {threads} threads; "
          f"load average {load()} at the start")
    if "tinyformer" in sides:
        print(f"tinyformer: compile={tf.cfg.compile}, {sum(p.numel() for p in tf.model.parameters()):,} parameters")
        if tf.cfg.compile:  # the first step compiles: timed on its own and left out of the per-iteration figures
            w0 = time.perf_counter()
            tf.advance()
            compile_s = time.perf_counter() - w0
            print(f"tinyformer: first step (compiles) {compile_s:.1f} s")
    if "nanogpt" in sides:
        nano = sides["nanogpt"]
        print(f"nanogpt: {sum(p.numel() for p in nano.model.parameters()):,} parameters")  # type: ignore[union-attr]

    wall = dict.fromkeys(sides, 0.0)
    cpu = dict.fromkeys(sides, 0.0)
    timed = dict.fromkeys(sides, 0)
    curves: dict[str, list[tuple[int, float]]] = {s: [] for s in sides}
    loads: list[float] = [os.getloadavg()[0]]
    order = list(sides)
    print(f"\n{'iter':>5} " + " ".join(f"{s + ' ms/it':>15} {'cpu ms/it':>9} {'val':>7}" for s in sides)
          + "   load(1 min)")
    for end in range(args.block, args.iters + 1, args.block):
        block_ms = {}
        for name in order:
            side = sides[name]
            w0, c0, s0 = time.perf_counter(), time.process_time(), side.step  # type: ignore[attr-defined]
            while side.step < end:  # type: ignore[attr-defined]
                side.advance()  # type: ignore[attr-defined]
            n = side.step - s0  # type: ignore[attr-defined]
            dw, dc = time.perf_counter() - w0, time.process_time() - c0
            wall[name] += dw
            cpu[name] += dc
            timed[name] += n
            block_ms[name] = (1000 * dw / n, 1000 * dc / n)
            v = (side.evaluate("val") if name == "tinyformer" else side.val_loss(val))  # type: ignore[attr-defined]
            curves[name].append((end, v))
        order.reverse()
        loads.append(os.getloadavg()[0])
        print(f"{end:>5} " + " ".join(f"{block_ms[s][0]:>15.2f} {block_ms[s][1]:>9.2f} {curves[s][-1][1]:>7.4f}"
                                      for s in sides) + f"   {loads[-1]:.2f}", flush=True)

    results = {"cpu": cpu_model(), "threads": threads, "torch": torch.__version__, "iters": args.iters,
               "block": args.block, "load_1min": loads, "load_end": load(), "tf_set": args.tf_set,
               "compile_s": compile_s, "sides": {}}
    print(f"\n{'side':<11}{'ms/iter':>9}{'cpu ms/it':>10}{'tokens/s':>10}{'final val':>10}")
    for name in sides:
        r = {"ms_per_iter": 1000 * wall[name] / timed[name], "cpu_ms_per_iter": 1000 * cpu[name] / timed[name],
             "tokens_per_s": 12 * 64 * timed[name] / wall[name], "timed_iters": timed[name],
             "val_curve": curves[name], "final_val": curves[name][-1][1]}
        results["sides"][name] = r
        print(f"{name:<11}{r['ms_per_iter']:>9.2f}{r['cpu_ms_per_iter']:>10.2f}{r['tokens_per_s']:>10,.0f}"
              f"{r['final_val']:>10.4f}")
    if args.profile:
        print(f"\nprofile of {args.profile} more iterations (torch.profiler self CPU time, ms per iteration):")
        for name, side in sides.items():
            print(f"  {name}:")
            split = profile_split(side, args.profile)
            results["sides"][name]["profile_ms"] = split
            print("    " + ", ".join(f"{k} {v:.1f}" for k, v in split.items()))
    if len(sides) == 2:
        t, n = results["sides"]["tinyformer"], results["sides"]["nanogpt"]
        results["ratio_wall"] = t["ms_per_iter"] / n["ms_per_iter"]
        results["ratio_cpu"] = t["cpu_ms_per_iter"] / n["cpu_ms_per_iter"]
        print(f"\ntinyformer / nanogpt: {results['ratio_wall']:.3f}x wall, {results['ratio_cpu']:.3f}x CPU "
              "per iteration")
    if compile_s is not None:
        t = results["sides"]["tinyformer"]
        print(f"tinyformer compile {compile_s:.1f} s = {1000 * compile_s / args.iters:.2f} ms/iter over "
              f"{args.iters} iterations; with it: {t['ms_per_iter'] + 1000 * compile_s / args.iters:.2f} ms/iter")
    print(f"load average {load()} at the end")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
