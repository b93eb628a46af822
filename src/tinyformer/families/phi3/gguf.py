"""The phi3 family's llama.cpp architecture ``phi3``.

Q, K, V are one matrix ``attn_qkv`` and ``ffn_up`` holds gate and up stacked (rows: gate, then up): the same fused
layouts as Hugging Face's ``qkv_proj`` / ``gate_up_proj`` and tinyformer's own. LongRoPE is stored as two tensors
of per-frequency divisors, ``rope_factors_short`` / ``rope_factors_long``, with ``rope.scaling.original_context_length``
(L0) and ``rope.scaling.attn_factor`` (the cos/sin scale): they become ``rope_scaling = {"rope_type": "longrope",
...}`` (attention_factor only when it differs from sqrt(1 + ln(f) / ln(L0)), f = context / L0, the value Hugging
Face derives). ``attention.sliding_window`` (0 = none) gives every layer the window, as Hugging Face's Phi-3 does
(llama.cpp currently ignores it for Phi-3).
"""

from __future__ import annotations

import math
from typing import Any

from tinyformer.errors import CheckpointError
from tinyformer.families.family import GGUFArch
from tinyformer.families.llama.gguf import BLOCK, f32, layout_config, window_key
from tinyformer.families.phi3.hf import PHI3

# q, k, v fused as attn_qkv; ffn_up holds gate and up stacked (Hugging Face's gate_up_proj)
PHI3_BLOCK = {**BLOCK, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}


def longrope_from_gguf(g: Any, theta: float, ctx: int, head_dim: int) -> dict[str, Any]:
    """Phi-3's LongRoPE: the divisor tensors, L0, and the attention factor when it is not the derived one."""
    factors = {}
    for which in ("short", "long"):
        name = f"rope_factors_{which}.weight"
        if name not in g.tensors:
            raise CheckpointError(f"{g.path}: LongRoPE needs both rope_factors_short and rope_factors_long; "
                                  f"{name} is missing")
        values = g.read(name).reshape(-1)
        if values.size != head_dim // 2:
            raise CheckpointError(f"{g.path}: {name} has {values.size} factors, not head_dim / 2 = {head_dim // 2}")
        factors[which] = [float(v) for v in values]
    l0 = int(g.key("rope.scaling.original_context_length", required=True))
    params: dict[str, Any] = {"rope_type": "longrope", "rope_theta": theta, "short_factor": factors["short"],
                              "long_factor": factors["long"], "original_max_position_embeddings": l0}
    stored = g.key("rope.scaling.attn_factor")
    f = ctx / l0
    derived = math.sqrt(1 + math.log(f) / math.log(l0)) if f > 1 else 1.0
    if stored is not None and abs(stored - derived) > 1e-6 * derived:
        params["attention_factor"] = f32(stored)
    return params


ARCH = GGUFArch("phi3", lambda g: layout_config(g, ARCH, PHI3, window_key), PHI3_BLOCK, sliding_window=True,
                longrope=longrope_from_gguf)
