"""What a GPU needs to train fast, in one place: TF32 matmuls, the device's peak FLOP/s (for MFU),
synchronised timing, and the choice of scaled-dot-product-attention kernel.

Model FLOPs utilisation (PaLM, Chowdhery et al. 2022, appendix B):

    MFU = (tokens/s  x  training FLOPs per token) / (devices x peak FLOP/s of one device)

with training FLOPs per token = 6 N_matmul + 12 n_layer H d_h T (``sizing.training_flops_per_token``):
the FLOPs the model needs, not what the hardware happened to execute (recomputation does not count).

The peaks (:data:`PEAK_FLOPS_TABLE`, each with its source) are dense (no 2:4 sparsity) bf16 tensor-core figures
with FP32 accumulation, from the vendor datasheets; datasheets usually print the sparse figure, twice the dense one.
Any other device: pass ``--peak-flops`` (or ``train.peak_flops``), per device.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator

import torch

#: (substring of ``torch.cuda.get_device_name()``, dense bf16/fp16 peak FLOP/s); the first match wins,
#: so the more specific names come first ("H100 PCIe" before "H100", "A100" before "A10").
PEAK_FLOPS_TABLE: tuple[tuple[str, float], ...] = (
    ("H200 NVL", 835.5e12),  # H100 NVL / H200 NVL: NVIDIA H100 / H200 datasheets (1,671 with sparsity)
    ("H200", 989.4e12),  # H200 SXM: NVIDIA H200 Tensor Core GPU datasheet (1,979 "with sparsity")
    ("H100 PCIe", 756.5e12),  # NVIDIA H100 datasheet (1,513 with sparsity)
    ("H100 NVL", 835.5e12),
    ("H100", 989.4e12),  # H100 SXM: NVIDIA H100 Tensor Core GPU datasheet (1,979 "with sparsity")
    ("GH200", 989.4e12),
    ("A100", 312e12),  # SXM and PCIe: NVIDIA A100 datasheet (624 with sparsity)
    ("L40S", 362.05e12),  # NVIDIA L40S datasheet (733 with sparsity)
    ("L4", 121e12),  # NVIDIA L4 datasheet (242 with sparsity)
    # AWS g5: NVIDIA does not publish it; AWS/NVIDIA figures as collected by Baseten ("NVIDIA A10 vs A10G for ML
    # model inference") and MosaicML Composer's speed monitor. The 125e12 sometimes quoted for it is the A10's.
    ("A10G", 70e12),
    ("A10", 125e12),  # NVIDIA A10 datasheet (250 with sparsity)
    # RTX 4090: NVIDIA Ada (AD102) whitepaper, FP16/BF16 with FP32 accumulate (330.3 is the FP16-accumulate
    # figure, which training does not use)
    ("4090", 165.2e12),
    ("3090", 71e12),  # RTX 3090: NVIDIA Ampere GA102 whitepaper, FP32 accumulate
    ("V100", 125e12),  # V100 and T4: fp16 (these chips have no bf16)
    ("T4", 65e12),
)

SDPA_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")


def peak_flops_for(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of one device named ``device_name`` (as CUDA reports it), or None if unknown.

    Keys match as whole tokens, so "L4" does not match "L40S" nor "A10" match "A100".
    """
    name = device_name.upper()
    for key, flops in PEAK_FLOPS_TABLE:
        if re.search(rf"(?<![A-Z0-9]){re.escape(key.upper())}(?![A-Z0-9])", name):
            return flops
    return None


def device_peak_flops(device: torch.device, override: float | None = None) -> float | None:
    """Peak FLOP/s of one ``device``: ``override`` when given, else the table for a known GPU, else None."""
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    return peak_flops_for(torch.cuda.get_device_name(device))


def enable_tf32() -> None:
    """Let float32 matmuls and convolutions use TF32 tensor cores (10-bit mantissa inputs, FP32 accumulate).

    Only float32 work changes (bf16/fp16 autocast regions do not use it); on Ampere and later this makes
    the float32 parts (and float32 training) several times faster at ~1e-3 relative error per product.
    """
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued kernels: a wall-clock time taken after this counts their work.

    CUDA runs kernels asynchronously; without this, a timer stops when the CPU has *queued* the work.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class Timer:
    """Wall-clock seconds of a block, synchronised with the device at both ends."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.seconds = 0.0

    def __enter__(self) -> Timer:
        synchronize(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        synchronize(self.device)
        self.seconds = time.perf_counter() - self._t0


@contextlib.contextmanager
def sdpa_backend(name: str = "auto") -> Iterator[None]:
    """Restrict ``scaled_dot_product_attention`` to one kernel family inside the block.

    ``auto`` lets PyTorch pick (flash when the dtype is fp16/bf16 and the head size allows it, else the
    memory-efficient kernel, else the math fallback); ``flash``/``efficient``/``cudnn`` fail loudly
    when that kernel cannot run the call, which is how a benchmark proves which one it measured.
    The explicit softmax formula (``ModelConfig.attn_impl = "reference"``) is selected by config instead.
    """
    if name not in SDPA_BACKENDS:
        raise ValueError(f"sdpa backend {name!r} is not one of {', '.join(SDPA_BACKENDS)}")
    if name == "auto":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]
    with sdpa_kernel([backend]):
        yield
