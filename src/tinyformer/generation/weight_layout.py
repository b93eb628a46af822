"""Linear layers laid out for decoding on CPU: float32 products for a few rows.

A decode step multiplies one vector per sequence by every weight matrix, so each matrix is read once per
token and the step is as fast as the product streams W from memory. ``nn.Linear`` computes y = x W^T with
MKL's sgemm/sgemv, which for one or two rows keeps the whole product on one thread and reads W at well
under the memory's rate. :func:`prepare_for_decoding` does one of two things to every float32 ``nn.Linear``:

  * **rows kernel** (float32 linear weights of ``KERNEL_MIN_BYTES`` or more, where tinyformer's CPU kernels
    are built, ``components/quant_kernels``): the layer becomes a :class:`FewRowsLinear`, same weight
    (row-major, shared, so a head tied to the token table stays tied) and same formula, whose product for up
    to 8 rows is ``quant_kernels.f32_linear``: every thread streams its own contiguous run of rows of W.
    SmolLM2-135M's 30 layers of products, one row, idle AMD EPYC: 23.9 ms against MKL's 43.4 at 2 threads,
    34.8 against 45.0 at one (docs/benchmarks/quantized.md, "fp32 decoding: our own product for a few rows").
    Past 8 rows (prefill) it is ``F.linear``.
  * **input-major** (smaller models, or no kernels: no C++ compiler): the weight keeps its values, shape and
    identity but is laid out W^T (in, out) contiguous, so that ``F.linear`` hands MKL a contiguous W^T, which
    it streams faster for one row than row-major W (``python benchmarks/bench_weight_layout.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tinyformer.components import quant_kernels

if TYPE_CHECKING:
    from tinyformer.config import ModelConfig

__all__ = ["FewRowsLinear", "load_for_decoding", "prepare_for_decoding", "store_input_major"]


class FewRowsLinear(nn.Linear):
    """``nn.Linear`` (y = x W^T + b, W (out, in) row-major) whose product for up to 8 rows of x is
    ``quant_kernels.f32_linear`` (module docstring); ``F.linear`` where autograd needs it (the op has no
    backward) and past 8 rows (inside the op). Made by :func:`prepare_for_decoding` from a float32
    ``nn.Linear``, in place: parameters, hooks and state-dict keys are the layer's own."""

    uses_cpu_kernels = True  # quant_kernels.uses_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.is_grad_enabled() and self.weight.requires_grad) or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        return quant_kernels.f32_linear(x, self.weight, self.bias)


# float32 linear weights from which a model decodes through the kernels: below it, weights that stay in the
# CPU's caches gain little (docs/benchmarks/decode.md: stories15m within noise of either layout), and a small
# model (the default `tinyformer train` run's) should not wait on the kernels' first build (about a minute)
KERNEL_MIN_BYTES = 32 * 2**20


def prepare_for_decoding(model: nn.Module, min_bytes: int = KERNEL_MIN_BYTES) -> None:
    """Lay ``model``'s float32 ``nn.Linear`` layers on a CPU out for decoding, in place (module docstring):
    :class:`FewRowsLinear` where their weights total ``min_bytes`` or more and the CPU kernels are built, else
    input-major (:func:`store_input_major`). Idempotent; other layers (quantized, LoRA, bfloat16) are left as
    they are."""
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.dtype == torch.float32
               and m.weight.device.type == "cpu" and m.weight.is_contiguous()]
    if not linears:
        return
    weight_bytes = sum(m.weight.nbytes for m in {id(m.weight): m for m in linears}.values())
    if weight_bytes < min_bytes or not quant_kernels.available():
        store_input_major(model)
        return
    for m in linears:
        m.__class__ = FewRowsLinear  # same object: a tied head keeps sharing the token table's weight


def store_input_major(model: nn.Module) -> None:
    """Store every ``nn.Linear`` weight W (out, in) of ``model`` input-major, in place.

    The parameter keeps its values, shape (out, in) and identity; only its memory layout changes to
    W^T (in, out) contiguous, i.e. strides (1, out). ``F.linear(x, W) = x W^T`` then hands the BLAS a
    contiguous W^T. Only float32 weights are moved: for bfloat16 the input-major products were 14-38%
    slower on the reference machine (``python benchmarks/bench_weight_layout.py --dtype bfloat16``). A head
    tied to the token table moves too, and the table with it: the head's product is the largest of a step
    (SmolLM2-135M's 49152 x 576 took 9.1 ms row-major against 4.9 ms input-major for one row at one thread
    on the AMD EPYC, 21.5 against 9.5 ms for two), while the lookup of a token's row, now strided, stays in
    the microseconds (512 tokens: 2.8 ms against 0.4 ms). Meant for a model used for inference; state dicts
    and checkpoints are unaffected (they are written contiguous).
    """
    for m in model.modules():
        if isinstance(m, nn.Linear) and m.weight.dtype == torch.float32 and m.weight.is_contiguous():
            # in the mode the weight was made in, whatever mode the caller is in (a decode step's first call
            # runs in inference mode): a weight for training and torch.export must not become an inference
            # tensor, and one loaded in inference mode must stay one
            with torch.inference_mode(m.weight.is_inference()), torch.no_grad():
                m.weight.data = m.weight.data.t().contiguous().t()


def load_for_decoding(run_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                      verify: bool = True, cfg: ModelConfig | None = None, prepare: bool = True) -> nn.Module:
    """``run_folder.load_model`` for decoding. On a CPU the weights are read into the process's own memory
    rather than mapped (they may be re-laid out: input-major, or packed by the int8/int4 kernels, and a map's
    touched pages would stay resident beside the copies), and with ``prepare`` the linear layers are laid
    out for decoding (:func:`prepare_for_decoding`)."""
    from tinyformer.run_folder import load_model

    cpu = torch.device(device).type == "cpu"
    model = load_model(run_dir, device=device, dtype=dtype, cfg=cfg, verify=verify, mapped=not cpu)
    if cpu and prepare:
        prepare_for_decoding(model)
    return model
