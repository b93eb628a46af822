"""Which device and dtype a command runs on: one set of rules for train, generate, chat, serve and eval.

    device "auto"            cuda if available, else mps if available, else cpu
    device cpu | cuda | cuda:N | mps    that device, or an error when this machine lacks it
    weights dtype "auto"     bfloat16 on cuda (float16 where the GPU has no bf16), float32 elsewhere
    autocast dtype "auto"    as the weights on cuda; None (plain float32, no autocast) elsewhere
    autocast float16 on cpu  an error (CPU autocast has no fp16 GradScaler path); bfloat16 on cpu is allowed

A bad name or a missing accelerator raises a ``TinyformerError`` subclass (``ConfigError`` unless the
caller names another), which the command line prints as one line and exit status 2.
"""

from __future__ import annotations

import torch

from tinyformer.errors import ConfigError, TinyformerError

#: Device types a model can run on (``torch.device`` also parses meta, xla, ..., which cannot run one here).
RUNNABLE_DEVICES = ("cpu", "cuda", "mps")

#: Floating dtypes a model's weights are stored or computed in, by the name the flags and files use.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def mps_available() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def resolve_device(name: str, error: type[TinyformerError] = ConfigError) -> torch.device:
    """``auto`` = CUDA, else Apple MPS, else CPU; an explicit name (cpu, cuda, cuda:N, mps) as given, where a name
    torch cannot parse, a device that cannot run a model (meta) or an accelerator this machine lacks raises
    ``error``."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if mps_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise error(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type not in RUNNABLE_DEVICES:  # e.g. meta: tensors without data, nothing to compute on
        raise error(f"device {name!r} cannot run a model; use auto, cpu, cuda, cuda:N or mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise error(f"device {name!r} was asked for but CUDA is not available on this machine; use cpu or auto")
    if device.type == "mps" and not mps_available():
        raise error(f"device {name!r} was asked for but MPS is not available on this machine; use cpu or auto")
    return device


def _gpu_half() -> torch.dtype:
    """bf16 where the GPU supports it, else fp16 (pre-Ampere cards)."""
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def parse_dtype(name: str | torch.dtype | None, error: type[TinyformerError] = ConfigError) -> torch.dtype | None:
    """The dtype a name in ``DTYPES`` stands for; a torch.dtype as it is; None for None (the caller's default
    applies)."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise error(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_dtype(name: str, device: torch.device, error: type[TinyformerError] = ConfigError) -> torch.dtype:
    """The dtype a model's weights are loaded in for inference: ``auto`` = half precision on CUDA,
    float32 on CPU and MPS; an explicit name as given (bfloat16 on CPU too)."""
    if name == "auto":
        return _gpu_half() if device.type == "cuda" else torch.float32
    dtype = parse_dtype(name, error)
    assert dtype is not None
    return dtype


def autocast_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for training and evaluation, or None for plain float32: bf16 where supported on
    GPU, else fp16 (with a GradScaler, since fp16 gradients underflow); float32 on CPU unless bfloat16 is
    asked for."""
    if name == "auto":
        return _gpu_half() if device.type == "cuda" else None
    if parse_dtype(name) == torch.float32:
        return None
    if name == "float16" and device.type == "cpu":
        raise ConfigError("train.dtype='float16' needs a GPU; on CPU use float32 or bfloat16")
    return DTYPES[name]
