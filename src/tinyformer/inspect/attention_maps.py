"""Attention probabilities of every layer and head, and their heat-map grid.

    P = softmax(Q K^T / sqrt(d_head) + M),   P[b, h, i, j] = how much query i of head h reads key j

The model's attention may run through a fused SDPA kernel that never builds P. Instead of changing
the model, a forward pre-hook on each ``SelfAttention`` takes the input the block hands it (the
normalised hidden states, RoPE's cos/sin and the mask) and recomputes P with the reference formula
from the module's own ``qkv`` weights: the same projections, the same RoPE, GQA's key/value sharing
and the safe softmax of ``components/attention.py``. ``P @ V`` through ``out`` gives back the module's
output (tests/inspect/test_inspect.py checks that), so the picture is what the model computed.

Shapes: input_ids (B, T) -> one (B, H, T, T) tensor per layer, each row summing to 1 and zero above
the diagonal (a causal model cannot look ahead).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tinyformer.components.attention import SelfAttention, safe_softmax
from tinyformer.components.kv_cache import WHOLE_SEQUENCE
from tinyformer.inspect.plotting import pyplot, save_figure, token_label

CELL_INCHES = 2.0  # each head's heat-map is a CELL_INCHES square
MARGIN_INCHES = 0.8  # room for titles and the colour bar, added once to each side of the grid


def attention_probs_of(attn: SelfAttention, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                       mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(s q k^T + M) for ``attn`` on its input x (B, T, d) -> (B, H, T, T), float32 (s = 1/sqrt(d_head)
    or the model's ``attn_scale``; with its q/k norms and score soft-cap when it has them).

    The prefix-free case (no KV cache): M is the causal mask when ``attn.causal`` and the boolean
    ``mask`` (True = may attend) when one is given, exactly as ``reference_attention`` applies them.
    """
    B, T, _ = x.shape
    H, H_kv = attn.n_head, attn.n_kv_head
    qkv = attn.qkv(x).view(B, T, H + 2 * H_kv, attn.head_dim).transpose(1, 2)  # (B, H + 2 H_kv, T, d_head)
    # the module's own QK-norm (if any) and RoPE (if any), as its forward applies them
    q, k = attn.rotate(attn._norm_qk(qkv[:, : H + H_kv]), rope).split((H, H_kv), dim=1)
    k = k.repeat_interleave(attn.n_head // attn.n_kv_head, dim=1)  # GQA: one K head per group of Q heads
    scale = attn.scale if attn.scale is not None else 1 / math.sqrt(attn.head_dim)
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale  # (B, H, T, T)
    if attn.softcap is not None:
        scores = torch.tanh(scores / attn.softcap) * attn.softcap
    if attn.causal and mask is None:
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return safe_softmax(scores)


@torch.no_grad()
def attention_maps(model: nn.Module, input_ids: torch.Tensor, **forward_kwargs: Any) -> list[torch.Tensor]:
    """Run ``model(input_ids)`` once and return every layer's attention probabilities (B, H, T, T),
    in the order of ``model.modules()`` (layer 0 first). The model is not modified: hooks are removed
    before returning, also on error."""
    maps: list[torch.Tensor] = []

    def capture(module: SelfAttention, args: tuple, kwargs: dict) -> None:
        bound = {**dict(zip(("x", "step"), args)), **kwargs}
        step = bound.get("step", WHOLE_SEQUENCE)
        if getattr(step, "cache", None) is not None:
            raise ValueError("attention_maps needs a forward without a KV cache")
        maps.append(attention_probs_of(module, bound["x"], step.rope[module.layer], step.masks[module.layer]))

    handles = [m.register_forward_pre_hook(capture, with_kwargs=True)
               for m in model.modules() if isinstance(m, SelfAttention)]
    try:
        model(input_ids, **forward_kwargs)
    finally:
        for h in handles:
            h.remove()
    return maps


def grid_size_inches(n_layer: int, n_head: int) -> tuple[float, float]:
    """(width, height) of the heat-map grid: one CELL_INCHES square per head (columns) and layer (rows)."""
    return n_head * CELL_INCHES + 2 * MARGIN_INCHES, n_layer * CELL_INCHES + 2 * MARGIN_INCHES


def plot_attention_grid(maps: list[torch.Tensor], tokens: list[str], path: str | Path, max_tokens: int = 32) -> Path:
    """Draw ``maps`` (one (1, H, T, T) or (H, T, T) tensor per layer) as a layers x heads grid of heat-maps
    of the last ``max_tokens`` queries and keys, rows = query positions, columns = key positions."""
    plt = pyplot()
    n_layer = len(maps)
    n_head = maps[0].shape[-3]
    T = maps[0].shape[-1]
    shown = min(T, max_tokens)
    labels = [token_label(t, 6) for t in tokens[-shown:]]
    width, height = grid_size_inches(n_layer, n_head)
    fig, axes = plt.subplots(n_layer, n_head, figsize=(width, height), squeeze=False)
    fig.subplots_adjust(left=MARGIN_INCHES / width, right=1 - MARGIN_INCHES / width,
                        bottom=MARGIN_INCHES / height, top=1 - MARGIN_INCHES / height, wspace=0.25, hspace=0.35)
    from matplotlib.colors import PowerNorm

    panels = [probs.reshape(-1, n_head, T, T)[0, :, -shown:, -shown:].float().cpu().numpy() for probs in maps]
    # one colour scale for the whole grid, so panels compare; the square root shows small weights too
    # (over a long context every weight is small, and a linear 0..1 scale would look black)
    scale = PowerNorm(gamma=0.5, vmin=0.0, vmax=max(float(p.max()) for p in panels) or 1.0)
    image = None
    for layer, p in enumerate(panels):
        for head in range(n_head):
            ax = axes[layer][head]
            image = ax.imshow(p[head], cmap="viridis", norm=scale, interpolation="nearest")
            ax.set_title(f"layer {layer} head {head}", fontsize=7)
            ticks = range(shown) if shown <= 16 else range(0, shown, max(1, shown // 8))
            ax.set_xticks(list(ticks), [labels[i] for i in ticks], fontsize=5, rotation=90)
            ax.set_yticks(list(ticks), [labels[i] for i in ticks], fontsize=5)
    fig.suptitle(f"attention probabilities (rows: queries, columns: keys; last {shown} of {T} tokens)", fontsize=9)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, pad=0.02)
    return save_figure(fig, path)
