"""Loading a quantized run with a chosen kernel, for the tests that compare it with a float reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from tinyformer.components import quant_kernels
from tinyformer.run_folder import QUANT_KEY, load_config, load_model, quant_spec


def load_weight_only(run: Path, **kwargs: Any) -> nn.Module:
    """``run`` loaded with a weight-only kernel (``cpp``, or ``dequant`` without the C++ kernels) instead of the
    run's ``auto``, which takes the act8 kernel where the CPU has integer dot products: y = x dequant(W)^T + b,
    what transformers' dequantizing loaders compute. A float run loads as it is."""
    cfg = load_config(run)
    spec = quant_spec(cfg)
    if spec is not None:
        kernel = "cpp" if quant_kernels.available() else "dequant"
        cfg.extra = {**cfg.extra, QUANT_KEY: {**spec.to_dict(), "kernel": kernel}}
    return load_model(run, cfg=cfg, **kwargs)
