"""Pre-Norm vs Post-Norm: does a deep Post-Norm Transformer need learning-rate warm-up?

The claim (Vaswani et al. 2017 used warm-up; Liu et al. 2020, Xiong et al. 2020 explain it): in a
Post-Norm stack, y = Norm(x + F(x)), the gradient reaching the parameters near the output is large at
initialisation and the residual path is renormalised at every layer, so with Adam at a normal learning
rate and no warm-up training is unstable or stalls, and more so as depth grows. Pre-Norm,
y = x + F(Norm(x)), keeps an identity path through the whole stack and trains without warm-up.

This script trains the same deep, narrow GPT-2-style decoder (LayerNorm, learned positions, GELU MLP,
biases, tied head) four times on character-level TinyShakespeare: {pre, post} x {warm-up, no warm-up},
with identical data order, initial weights (same seed) and peak learning rate, no gradient clipping.
It records the training loss every step, the validation loss at the end, and the gradient norm of
each block's parameters (at initialisation and during training).

Outputs: docs/img/norm_placement.png (loss curves and per-layer gradient norms) and the results block
of docs/experiments/norm_placement.md (text outside the results markers is kept).

    python benchmarks/norm_placement.py                 # the recorded run (~10-15 min on 2 cores)
    python benchmarks/norm_placement.py --steps 50      # a quick smoke run (writes to --out-dir)
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tinyformer.config import ModelConfig
from tinyformer.models.decoder import DecoderLM

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared/data/tinyshakespeare/input.txt"
START, END = "<!-- results:start -->", "<!-- results:end -->"


def load_chars(path: Path) -> tuple[torch.Tensor, int]:
    """Character-level ids (index in sorted(set(text)), as nanoGPT's shakespeare_char) and vocab size."""
    text = path.read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), len(chars)


def model_config(vocab: int, args: argparse.Namespace, placement: str, n_layer: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab, d_model=args.d_model, n_layer=n_layer, n_head=args.n_head, d_ff=4 * args.d_model,
        max_seq_len=args.seq_len, norm="layernorm", norm_eps=1e-5, norm_placement=placement, pos="learned",
        ffn="gelu", attn_bias=True, attn_out_bias=True, mlp_bias=True, tie_embeddings=True,
        # a Post-Norm stack already ends in a norm; a Pre-Norm one needs the final norm
        final_norm=placement == "pre",
    )


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps (none when 0), then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def block_grad_norms(model: DecoderLM) -> list[float]:
    """||grad||_2 over all parameters of each block, block 0 (nearest the input) first."""
    norms = []
    for block in model.blocks:
        sq = sum(float(p.grad.float().pow(2).sum()) for p in block.parameters() if p.grad is not None)
        norms.append(math.sqrt(sq))
    return norms


def batches(data: torch.Tensor, steps: int, batch: int, seq_len: int, seed: int) -> list[torch.Tensor]:
    """The start offsets of every training batch, drawn once so all runs see the same data order."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g) for _ in range(steps)]


def window(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def evaluate(model: DecoderLM, data: torch.Tensor, seq_len: int, n_batches: int = 8, batch: int = 32) -> float:
    model.eval()
    g = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(n_batches):
        x, y = window(data, torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g), seq_len)
        losses.append(float(model.loss(x, y)))
    model.train()
    return sum(losses) / len(losses)


def train_one(name: str, cfg: ModelConfig, train: torch.Tensor, val: torch.Tensor, order: list[torch.Tensor],
              args: argparse.Namespace, warmup: int, lr: float) -> dict:
    torch.manual_seed(args.seed)  # identical initial weights for pre and post (same parameter shapes)
    model = DecoderLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0)
    losses: list[float] = []
    grad_total: list[float] = []
    grad_layers_init: list[float] = []
    grad_layers_sum = [0.0] * cfg.n_layer
    diverged_at = None
    t0 = time.perf_counter()
    for step, starts in enumerate(order):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, lr, warmup)
        x, y = window(train, starts, args.seq_len)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        value = loss.detach().item()
        if not math.isfinite(value):
            diverged_at = step
            break
        layer_norms = block_grad_norms(model)
        if step == 0:
            grad_layers_init = layer_norms
        grad_layers_sum = [a + b for a, b in zip(grad_layers_sum, layer_norms)]
        total = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None))
        grad_total.append(total)
        losses.append(value)
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"  {name:<22} step {step:>5}  loss {value:.4f}  grad {total:.3f}  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  {time.perf_counter() - t0:.0f}s", flush=True)
    seconds = time.perf_counter() - t0
    done = len(losses)
    return {
        "name": name,
        "placement": cfg.norm_placement,
        "n_layer": cfg.n_layer,
        "warmup": warmup,
        "lr": lr,
        "losses": losses,
        "grad_total": grad_total,
        "grad_layers_init": grad_layers_init,
        "grad_layers_mean": [s / max(1, done) for s in grad_layers_sum],
        "val_loss": evaluate(model, val, args.seq_len) if diverged_at is None else float("nan"),
        "diverged_at": diverged_at,
        "seconds": seconds,
    }


def ngram_baselines(train: torch.Tensor, val: torch.Tensor, vocab: int) -> tuple[float, float]:
    """Validation cross-entropy (nats/char) of add-one-smoothed unigram and bigram models of the training text:
    what a model that ignores its context (unigram), or sees only the current character (bigram), can reach."""
    uni = torch.bincount(train, minlength=vocab).double() + 1
    h1 = -torch.log(uni / uni.sum())[val].mean()
    pairs = torch.bincount(train[:-1] * vocab + train[1:], minlength=vocab * vocab).double().view(vocab, vocab) + 1
    h2 = -torch.log(pairs / pairs.sum(1, keepdim=True))[val[:-1], val[1:]].mean()
    return float(h1), float(h2)


def tail_mean(values: list[float], n: int) -> float:
    return sum(values[-n:]) / len(values[-n:]) if values else float("nan")


def first_step_below(values: list[float], level: float, smooth: int = 20) -> int | None:
    for i in range(smooth, len(values) + 1):
        if sum(values[i - smooth:i]) / smooth < level:
            return i
    return None


def plot(results: list[dict], path: Path, args: argparse.Namespace, baselines: tuple[float, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {("pre", True): "tab:blue", ("pre", False): "tab:cyan", ("post", True): "tab:red",
              ("post", False): "tab:orange"}
    lrs = sorted({r["lr"] for r in results})
    cols = max(2, len(lrs))
    fig, axes = plt.subplots(2, cols, figsize=(6.5 * cols, 9), squeeze=False)
    k = 20

    deep = max(r["n_layer"] for r in results)

    def style(r: dict) -> dict:
        if r["n_layer"] != deep:  # the shallow control runs
            return dict(color="tab:green" if r["warmup"] > 0 else "tab:olive", ls="-" if r["warmup"] > 0 else "--")
        return dict(color=colors[(r["placement"], r["warmup"] > 0)], ls="-" if r["warmup"] > 0 else "--")

    for col, lr in enumerate(lrs):
        ax = axes[0][col]
        for r in (r for r in results if r["lr"] == lr):
            vals = r["losses"]
            smooth = [sum(vals[max(0, i - k + 1):i + 1]) / len(vals[max(0, i - k + 1):i + 1])
                      for i in range(len(vals))]
            ax.plot(smooth, label=r["name"] + (" (diverged)" if r["diverged_at"] is not None else ""), **style(r))
        for level, what in ((baselines[0], "unigram"), (baselines[1], "bigram")):
            ax.axhline(level, color="grey", lw=0.8, ls=":")
            ax.annotate(f"{what} (val)", (0, level), xytext=(2, 2), textcoords="offset points", fontsize=7,
                        color="grey")
        ax.set(title=f"training loss ({k}-step mean), peak lr {lr:g}", xlabel="step",
               ylabel="cross-entropy (nats/char)")
        ax.set_ylim(top=min(4.5, ax.get_ylim()[1]))
    for col in range(len(lrs), cols):
        axes[0][col].axis("off")
    top_lr = lrs[-1]
    for r in (r for r in results if r["n_layer"] == deep):
        layers = list(range(1, len(r["grad_layers_init"]) + 1))
        if r["lr"] == lrs[0] and r["grad_layers_init"]:  # the same weights at every lr: draw once
            axes[1][0].plot(layers, r["grad_layers_init"], marker=".", label=r["name"], **style(r))
        if r["lr"] == top_lr:
            axes[1][1].plot(layers, r["grad_layers_mean"], marker=".", label=r["name"], **style(r))
    axes[1][0].set(title="per-block gradient norm at initialisation", xlabel="block (1 = nearest the input)",
                   ylabel="||grad||", yscale="log")
    axes[1][1].set(title=f"per-block gradient norm, mean over training (lr {top_lr:g})", xlabel="block",
                   ylabel="||grad||", yscale="log")
    for col in range(2, cols):
        axes[1][col].axis("off")
    for ax in axes.flat:
        if ax.has_data():
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"{args.n_layer}-layer decoder (and {args.control_layers}-layer Post-Norm controls), "
                 f"d_model {args.d_model}, TinyShakespeare chars, AdamW, no clipping")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("." + path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    tmp.replace(path)
    plt.close(fig)


def results_markdown(results: list[dict], args: argparse.Namespace, command: str, seconds: float,
                     baselines: tuple[float, float]) -> str:
    level = args.threshold
    lines = [
        START,
        "",
        f"Command: `{command}`  ",
        f"Model: d_model {args.d_model}, {args.n_head} heads, d_ff {4 * args.d_model}, LayerNorm, learned positions, "
        f"GELU, tied head; {args.n_layer} layers (and {args.control_layers}-layer Post-Norm controls). "
        f"Data: TinyShakespeare characters, T = {args.seq_len}, batch {args.batch}, {args.steps} steps, the same "
        f"batches and initial weights in every run. AdamW (0.9, 0.98), no weight decay, cosine decay to 10% of the "
        f"peak lr, linear warm-up of {args.warmup} steps where used, no gradient clipping, seed {args.seed}. "
        f"Wall time {seconds / 60:.1f} min on {torch.get_num_threads()} thread(s).",
        "",
        "Reference levels (validation cross-entropy of add-one-smoothed n-gram counts of the training text): "
        f"unigram, which ignores the input, {baselines[0]:.3f}; bigram, which sees only the current character, "
        f"{baselines[1]:.3f} nats/char.",
        "",
        f"| run | layers | peak lr | loss, first 50 steps | loss, last 50 steps | val loss | steps to loss < {level} "
        "| max grad norm | grad norm at init, blocks 1 / 2 / last | diverged |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        g0 = r["grad_layers_init"]
        init = " / ".join(f"{g:.3g}" for g in (g0[0], g0[1], g0[-1])) if len(g0) > 1 else "-"
        reach = first_step_below(r["losses"], level)
        first = sum(r["losses"][:50]) / max(1, len(r["losses"][:50]))
        lines.append(
            f"| {r['name']} | {r['n_layer']} | {r['lr']:g} | {first:.3f} "
            f"| {tail_mean(r['losses'], 50):.3f} | {r['val_loss']:.3f} | {reach if reach is not None else 'never'} "
            f"| {max(r['grad_total']) if r['grad_total'] else float('nan'):.2f} | {init} "
            f"| {'step ' + str(r['diverged_at']) if r['diverged_at'] is not None else 'no'} |"
        )
    lines += ["", "![loss curves and per-layer gradient norms](../img/norm_placement.png)", "", END]
    return "\n".join(lines)


def write_markdown(path: Path, block: str) -> None:
    from tinyformer.utils.io import atomic_write_text

    if path.is_file():
        text = path.read_text(encoding="utf-8")
        if START in text and END in text:
            head, rest = text.split(START, 1)
            tail = rest.split(END, 1)[1]
            atomic_write_text(path, head + block + tail)
            return
    atomic_write_text(path, "# Pre-Norm vs Post-Norm\n\n" + block + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="TinyShakespeare input.txt")
    p.add_argument("--n-layer", type=int, default=24)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=60, help="warm-up steps of the runs with warm-up")
    p.add_argument("--lr", type=float, nargs="+", default=[1e-3, 3e-3], help="peak learning rate(s)")
    p.add_argument("--threshold", type=float, default=2.8, help="loss level for the steps-to-reach column")
    p.add_argument("--control-layers", type=int, default=6,
                   help="depth of the Post-Norm control runs (0: none): does Post-Norm train when shallow?")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1 is fastest for these small matrices)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--out-dir", type=Path, default=REPO / "docs",
                   help="writes OUT/img/norm_placement.png and OUT/experiments/norm_placement.md")
    p.add_argument("--json", type=Path, default=None, help="also dump raw curves as JSON here")
    args = p.parse_args()
    if not args.data.is_file():
        raise SystemExit(f"TinyShakespeare not found at {args.data}; pass --data")
    torch.set_num_threads(args.threads)
    data, vocab = load_chars(args.data)
    n = int(0.9 * len(data))
    train, val = data[:n], data[n:]
    order = batches(train, args.steps, args.batch, args.seq_len, args.seed)
    t0 = time.perf_counter()
    results = []
    runs = [(placement, args.n_layer) for placement in ("pre", "post")]
    if args.control_layers:
        runs.append(("post", args.control_layers))
    for lr in args.lr:
        for placement, n_layer in runs:
            for warmup in (args.warmup, 0):
                name = f"{placement}-norm, {'warm-up ' + str(warmup) if warmup else 'no warm-up'}"
                if n_layer != args.n_layer:
                    name += f" ({n_layer} layers)"
                print(f"{name}, peak lr {lr:g}", flush=True)
                cfg = model_config(vocab, args, placement, n_layer)
                results.append(train_one(name, cfg, train, val, order, args, warmup, lr))
    seconds = time.perf_counter() - t0
    command = "python benchmarks/norm_placement.py" + "".join(
        f" --{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items()
        if k not in ("data", "out_dir", "json", "log_every") and v != p.get_default(k)
    )
    baselines = ngram_baselines(train, val, vocab)
    plot(results, args.out_dir / "img" / "norm_placement.png", args, baselines)
    block = results_markdown(results, args, command, seconds, baselines)
    write_markdown(args.out_dir / "experiments" / "norm_placement.md", block)
    if args.json:
        args.json.write_text(json.dumps(results))
    print(block)


if __name__ == "__main__":
    main()
