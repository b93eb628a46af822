"""The next-token distribution after a prompt, and what temperature, top-k and top-p keep of it.

    p = softmax(logits / temperature)                      the distribution the truncations act on
    top-k keeps the k largest p; top-p keeps the smallest prefix of the sorted p whose sum reaches p
    q = p restricted to the kept set, renormalised          the distribution a token is drawn from

The kept set comes from the sampler's own processors (``generation/sampling.py``: ``build_processors``),
so the picture and the table show exactly what ``tinyformer generate`` samples from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tinyformer.generation.sampling import SamplingParams, build_processors
from tinyformer.inspect.plotting import pyplot, save_figure, token_label

FIGSIZE = (10.0, 4.5)  # inches; saved at plotting.DPI


@dataclass
class NextTokenDistribution:
    """All (V,) tensors are over the whole vocabulary, float32."""

    params: SamplingParams
    probs: torch.Tensor  # softmax(logits / temperature); temperature 0 (greedy) is shown at temperature 1
    kept: torch.Tensor  # bool: survives top-k and top-p
    sampled: torch.Tensor  # probs restricted to ``kept`` and renormalised: what a draw uses
    nucleus_base: torch.Tensor  # the distribution top-p cuts: probs restricted to the top-k set, renormalised
    order: torch.Tensor  # token ids by decreasing probability (ties by id)

    def top(self, n: int) -> list[int]:
        return self.order[:n].tolist()


def distribution_from_logits(logits: torch.Tensor, params: SamplingParams) -> NextTokenDistribution:
    """logits (V,) -> the tempered distribution and the top-k / top-p kept set of ``params``."""
    params.validate()
    logits = logits.detach().float().reshape(-1)
    temperature = params.temperature if params.temperature > 0 else 1.0  # temperature 0 shows p at 1
    probs = torch.softmax(logits / temperature, dim=-1)
    if params.greedy:  # temperature 0 or top-k 1: the argmax alone
        kept = torch.zeros_like(probs, dtype=torch.bool)
        kept[int(logits.argmax())] = True
    else:
        # the truncations only: the penalties need a history, which a single prompt does not have
        warp = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                              min_p=params.min_p)
        x = logits[None]
        for proc in build_processors(warp):
            x = proc(x, None)
        kept = torch.isfinite(x[0])
    sampled = torch.where(kept, probs, torch.zeros_like(probs))
    sampled = sampled / sampled.sum()
    order = torch.sort(probs, descending=True, stable=True).indices
    base = probs
    if 0 < params.top_k < probs.numel():  # HF order: top-p acts on what top-k left, renormalised
        base = torch.zeros_like(probs).index_copy_(0, order[: params.top_k], probs[order[: params.top_k]])
        base = base / base.sum()
    return NextTokenDistribution(params=params, probs=probs, kept=kept, sampled=sampled, nucleus_base=base,
                                 order=order)


@torch.no_grad()
def next_token_distribution(model: nn.Module, input_ids: torch.Tensor, params: SamplingParams) -> NextTokenDistribution:
    """The distribution over the token that follows ``input_ids`` (1, T)."""
    logits = model(input_ids, last_only=True)[0, -1]
    return distribution_from_logits(logits, params)


def format_table(dist: NextTokenDistribution, token_text: Callable[[int], str], n: int = 10) -> str:
    """A terminal table of the ``n`` most probable next tokens: probability, the cumulative probability
    top-p compares with p (over the top-k set when top-k is on), whether the token is kept, and the
    renormalised probability a draw uses. ``token_text(id)`` is the
    token's text (e.g. ``lambda i: tokenizer.decode([i])``)."""
    within_top_k = dist.params.top_k > 0 and dist.params.temperature > 0
    cum_label = "cum p in top-k" if within_top_k else "cum p"  # the column is not cumulative `p` then
    width = len(cum_label)
    rows = [f"{'rank':>4}  {'id':>6}  {'token':<14} {'p':>8}  {cum_label:>{width}}  {'kept':<4}  {'sampled':>8}"]
    cum = 0.0
    for rank, tid in enumerate(dist.top(n), start=1):
        p = float(dist.probs[tid])
        cum += float(dist.nucleus_base[tid])
        kept = bool(dist.kept[tid])
        rows.append(f"{rank:>4}  {tid:>6}  {token_label(token_text(tid), 14):<14} {p:>8.4f}  {cum:>{width}.4f}  "
                    f"{'yes' if kept else '-':<4}  {float(dist.sampled[tid]) if kept else 0.0:>8.4f}")
    n_kept = int(dist.kept.sum())
    rows.append(f"{n_kept} of {dist.probs.numel()} tokens kept ({_describe(dist.params)}); "
                f"their probability mass before renormalising: {float(dist.probs[dist.kept].sum()):.4f}")
    if within_top_k:
        rows.append(f"{cum_label}: cumulative probability renormalised over the top-{dist.params.top_k} tokens "
                    "(what top-p compares with p)")
    return "\n".join(rows)


def _describe(params: SamplingParams) -> str:
    if params.temperature == 0:
        return "temperature 0: greedy"
    parts = [f"temperature {params.temperature:g}"]
    if params.top_k > 0:
        parts.append(f"top-k {params.top_k}")
    if params.top_p < 1.0:
        parts.append(f"top-p {params.top_p:g}")
    if params.min_p > 0:
        parts.append(f"min-p {params.min_p:g}")
    return ", ".join(parts)


def plot_next_token(dist: NextTokenDistribution, token_text: Callable[[int], str], path: str | Path) -> Path:
    """Bars of the 30 most probable next tokens (kept ones coloured), the cumulative probability as a
    line with the top-p level, and a dashed line where the top-k / top-p cut falls."""
    plt = pyplot()
    ids = dist.top(min(30, dist.probs.numel()))
    probs = [float(dist.probs[i]) for i in ids]
    kept = [bool(dist.kept[i]) for i in ids]
    cum = dist.nucleus_base[torch.tensor(ids)].cumsum(0).tolist()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    xs = list(range(len(ids)))
    ax.bar(xs, probs, color=["tab:blue" if k else "lightgray" for k in kept], label="p (kept: blue)")
    cum_label = "cumulative p" + (" within top-k" if dist.params.top_k else "")
    ax.plot(xs, cum, "o-", color="tab:orange", markersize=3, linewidth=1.2, label=cum_label)
    if dist.params.top_p < 1.0:
        ax.axhline(dist.params.top_p, color="tab:red", linestyle=":", linewidth=1,
                   label=f"top-p = {dist.params.top_p:g}")
    n_kept_shown = sum(kept)
    if 0 < n_kept_shown < len(ids):
        ax.axvline(n_kept_shown - 0.5, color="black", linestyle="--", linewidth=1.2, label="cut")
    ax.set_xticks(xs, [token_label(token_text(i), 8) for i in ids], rotation=90, fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("probability")
    ax.set_title(f"next-token distribution ({_describe(dist.params)}; {int(dist.kept.sum())} tokens kept)", fontsize=10)
    ax.legend(fontsize=8, loc="center right")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)
