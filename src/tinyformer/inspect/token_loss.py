"""Per-token loss over a text: which tokens surprise the model.

    loss_t = -log softmax(logits_t)[x_{t+1}],   t = 0 .. T-2      (nats; the training loss is their mean)

Shapes: input_ids (1, T) -> losses (T-1,), one per predicted token x_1 .. x_{T-1}.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tinyformer.inspect.plotting import pyplot, save_figure, token_label

HEIGHT_INCHES = 4.0
INCHES_PER_TOKEN = 0.22
MIN_WIDTH_INCHES = 6.0
MAX_TOKENS = 120  # a longer text shows its last MAX_TOKENS predictions (the bars would be unreadable)


@torch.no_grad()
def per_token_loss(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids (1, T) with T >= 2 -> (T-1,) float32 cross-entropy of each next token given its prefix."""
    if input_ids.shape[-1] < 2:
        raise ValueError("per-token loss needs at least 2 tokens")
    logits = model(input_ids)[0, :-1].float()  # (T-1, V): the prediction made after each prefix
    targets = input_ids[0, 1:]
    return -torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def figure_width_inches(n_tokens: int) -> float:
    return max(MIN_WIDTH_INCHES, 1.2 + INCHES_PER_TOKEN * min(n_tokens, MAX_TOKENS))


def plot_token_loss(losses: torch.Tensor, targets: list[str], path: str | Path) -> Path:
    """One bar per predicted token (labelled with that token), height = its loss in nats; the mean as a line."""
    plt = pyplot()
    values = losses.float().cpu().tolist()[-MAX_TOKENS:]
    labels = [token_label(t, 8) for t in targets[-MAX_TOKENS:]]
    fig, ax = plt.subplots(figsize=(figure_width_inches(len(values)), HEIGHT_INCHES))
    xs = list(range(len(values)))
    mean = float(losses.float().mean())
    ax.bar(xs, values, color="tab:purple")
    ax.axhline(mean, color="black", linestyle="--", linewidth=1, label=f"mean {mean:.3f} nats")
    ax.set_xticks(xs, labels, rotation=90, fontsize=7)
    ax.set_xlim(-0.6, len(values) - 0.4)
    ax.set_ylabel("-log p(token | prefix)  [nats]")
    shown = "" if len(values) == losses.numel() else f"; last {len(values)} of {losses.numel()} predictions"
    ax.set_title(f"per-token loss (each bar: the token the model had to predict{shown})", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)
