"""RoPE made visible: each pair of dimensions turns like a clock hand, each pair at its own speed.

With the half-split pairing of ``components/rope.py``, dimensions i and i + d/2 of a query or key at
position m form a 2-D vector that RoPE rotates by the angle m * theta_i, theta_i = base^(-2i/d):
pair 0 turns by one radian per position, the last pair barely moves. Because both q and k are
rotated, their dot product depends on the positions only through m - n:

    <RoPE(q, m), RoPE(k, n)> = sum_i Re[ (q_i k_i^*) e^{j (m - n) theta_i} ]     (pairs as complex numbers)

For q = k = (1, ..., 1) this is 2 sum_i cos((m - n) theta_i), which falls off as |m - n| grows
(Su et al. 2021, section 3.4.3): the curve of the right-hand panel.
Shapes: a vector (d,) and P positions -> rotated vectors (P, d); distances 0 .. D-1 -> dot products (D,).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tinyformer.components.rope import RotaryEmbedding, apply_rope
from tinyformer.inspect.plotting import pyplot, save_figure

FIGSIZE = (11.0, 4.5)  # inches; saved at plotting.DPI


def rotate_over_positions(rope: RotaryEmbedding, x: torch.Tensor, n_positions: int) -> torch.Tensor:
    """RoPE(x, m) for m = 0 .. n_positions-1: x (d,) -> (n_positions, d), float64."""
    cos, sin = rope(0, n_positions)  # (P, d)
    return apply_rope(x.double().view(1, 1, 1, -1).expand(1, 1, n_positions, -1), cos.double(), sin.double())[0, 0]


def relative_dot_curve(rope: RotaryEmbedding, q: torch.Tensor, k: torch.Tensor, n_distances: int) -> torch.Tensor:
    """<RoPE(q, m), RoPE(k, 0)> for m = 0 .. n_distances-1, shape (n_distances,), float64."""
    rq = rotate_over_positions(rope, q, n_distances)
    rk = rotate_over_positions(rope, k, 1)[0]
    return rq @ rk


def plot_rope(rope: RotaryEmbedding, path: str | Path, n_distances: int) -> Path:
    """Left: the 2-D pairs (x_i, x_{i+d/2}) of (1, ..., 1) rotated to positions 0 .. 15, for pairs from the
    fastest to the slowest (each drawn on its own circle). Right: the dot product of rotated q and k (q = k =
    (1, ..., 1), and a random pair of seed 0) against their distance m - n, up to ``n_distances``."""
    plt = pyplot()
    d = rope.cos_cached.shape[-1]
    max_len = rope.cos_cached.shape[0]
    n_positions = min(16, max_len)
    n_distances = min(n_distances, max_len)
    half = d // 2
    ones = torch.ones(d, dtype=torch.float64)
    rotated = rotate_over_positions(rope, ones, n_positions)
    fig, (left, right) = plt.subplots(1, 2, figsize=FIGSIZE)
    pairs = sorted({0, half // 4, half // 2, half - 1})
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for n, (colour, i) in enumerate(zip(colours, pairs)):
        xy = torch.stack([rotated[:, i], rotated[:, i + half]], dim=-1)
        xy = xy / xy.norm(dim=-1, keepdim=True) * (1.0 - 0.2 * n)  # own radius per pair: curves do not overlap
        theta = float(rope.inv_freq[i])
        left.plot(xy[:, 0], xy[:, 1], "-", color=colour, linewidth=0.8, alpha=0.5)
        left.scatter(xy[:, 0], xy[:, 1], color=colour, s=10, label=f"pair {i}: {theta:.3g} rad/position")
        left.annotate("m=0", (float(xy[0, 0]), float(xy[0, 1])), fontsize=6, color=colour)
    left.set_aspect("equal")
    left.set_xlim(-1.1, 1.1)
    left.set_ylim(-1.1, 1.1)
    left.set_title(f"pair i = (x_i, x_(i+d/2)) at positions 0..{n_positions - 1} (one circle per pair)", fontsize=9)
    left.legend(fontsize=7, loc="center", frameon=False)
    left.grid(alpha=0.3)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(d, generator=gen, dtype=torch.float64), torch.randn(d, generator=gen, dtype=torch.float64)
    distances = list(range(n_distances))
    right.plot(distances, relative_dot_curve(rope, ones, ones, n_distances) / d, label="q = k = (1, ..., 1)")
    right.plot(distances, relative_dot_curve(rope, q, k, n_distances) / d, linewidth=0.8, alpha=0.8,
               label="random q, k")
    right.set_xlabel("relative distance m - n")
    right.set_ylabel("<RoPE(q, m), RoPE(k, n)> / d")
    right.set_title(f"dot product against distance (d_head {d})", fontsize=9)
    right.legend(fontsize=7)
    right.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)
