"""Weight layout for decoding on CPU: linear weights stored input-major.

``nn.Linear`` keeps W (out, in) row-major and computes y = x W^T. A decode step multiplies one vector
per sequence, so each weight matrix is read once per token and the step is as fast as the BLAS streams
W from memory. MKL streams the same bytes at different rates depending on the layout: on the reference
machine (2 threads, float32), with W^T (in, out) contiguous llama-110m decodes 7-9% faster (its weights
come from DRAM) and stories15m, whose weights fit in the cache, within noise of row-major
(``python benchmarks/bench_weight_layout.py``; docs/benchmarks/decode.md). Prefill is no slower: the
time to first token stays equal to Hugging Face's (``benchmarks/bench_decode.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from tinyformer.config import ModelConfig

__all__ = ["load_for_decoding", "store_input_major"]


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
                      verify: bool = True, cfg: ModelConfig | None = None, input_major: bool = True) -> nn.Module:
    """``run_folder.load_model`` for decoding. On a CPU the weights are read into the process's own memory
    rather than mapped (they are re-laid out: input-major here, packed by the int8/int4 kernels, and a map's
    touched pages would stay resident beside the copies), and with ``input_major`` the linear weights are
    stored input-major (:func:`store_input_major`)."""
    from tinyformer.run_folder import load_model

    cpu = torch.device(device).type == "cpu"
    model = load_model(run_dir, device=device, dtype=dtype, cfg=cfg, verify=verify, mapped=not cpu)
    if cpu and input_major:
        store_input_major(model)
    return model
