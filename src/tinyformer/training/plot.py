"""The loss curve of a run as a PNG (``loss.png``), drawn from ``metrics.jsonl`` with matplotlib.

matplotlib is a dependency of the package (so the README's first command leaves a ``loss.png``); an
environment without it skips the plot and the caller is told why.
"""

from __future__ import annotations

from pathlib import Path

from tinyformer.training.metrics import read_metrics
from tinyformer.utils.io import atomic_path


def plot_loss_curve(metrics_path: str | Path, out_png: str | Path, title: str | None = None) -> str | None:
    """Draw train and validation loss against step into ``out_png``.

    Returns None on success, or a one-line note saying why no plot was made.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return "loss.png skipped: matplotlib is not installed (pip install matplotlib)"
    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train" and r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("kind") == "eval" and r.get("val_loss") is not None]
    if not train and not val:
        return "loss.png skipped: no metrics recorded yet"
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1.0, alpha=0.8)
    if val:
        ax.plot(*zip(*val), "o-", label="val loss", linewidth=1.5, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return None
