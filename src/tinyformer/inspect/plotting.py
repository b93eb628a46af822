"""Shared plotting helpers: the lazy matplotlib import, readable token labels and atomic PNG writes.

matplotlib is a dependency of the package (an environment may still lack it). It is imported only when a
picture is drawn, with the non-interactive Agg backend, so nothing here needs a display.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from tinyformer.errors import TinyformerError
from tinyformer.utils.io import atomic_path

DPI = 100  # pixels per inch of every picture: a figure of w x h inches is saved as (w * DPI) x (h * DPI) pixels


class PlottingUnavailableError(TinyformerError):
    """matplotlib is not installed."""


def pyplot() -> Any:
    """``matplotlib.pyplot`` with the Agg backend, or a one-line error saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlottingUnavailableError("drawing pictures needs matplotlib, which is not installed: pip install "
                                       "matplotlib (or pass --no-plots for the terminal table only)") from None
    return plt


def token_label(text: str, max_chars: int = 12) -> str:
    """A token's text made visible on an axis: spaces as '·', newline and tab escaped, long ones cut."""
    shown = text.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r").replace(" ", "·")
    if not shown:
        shown = "∅"
    return shown if len(shown) <= max_chars else shown[: max_chars - 1] + "…"


def save_figure(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at ``DPI`` (the figure's exact size: no tight bounding box), atomically."""
    plt = pyplot()
    path = Path(path)
    with warnings.catch_warnings():
        # tokens may hold characters the default font lacks (CJK, emoji): matplotlib draws a box and warns
        warnings.simplefilter("ignore", UserWarning)
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=DPI)
            os.chmod(tmp, 0o644)  # the temporary file is private (0600); a picture is for anyone to open
    plt.close(fig)
    return path
