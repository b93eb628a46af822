"""The qwen family's llama.cpp architectures: ``qwen2``, ``qwen3`` (q/k norms ``attn_q_norm`` / ``attn_k_norm``) and
``qwen3moe`` (Qwen3 with experts of width ``expert_feed_forward_length``, renormalised unless ``expert_weights_norm``
is false). The names and shared keys are the Llama layout's (``families/llama/gguf.py``). llama.cpp has no sliding
window for them.
"""

from __future__ import annotations

from typing import Any

from tinyformer.errors import ConfigError
from tinyformer.families.family import GGUFArch
from tinyformer.families.llama.gguf import BLOCK, experts_from_gguf, has_attention_bias, layout_config
from tinyformer.families.qwen.hf import QWEN2, QWEN3, QWEN3_MOE, QWEN3_MOE_NAMES


def _qwen2_keys(g: Any, window: int | None) -> dict[str, Any]:
    return {"use_sliding_window": False}


def _qwen3_keys(g: Any, window: int | None) -> dict[str, Any]:
    return {**has_attention_bias(g), "use_sliding_window": False}


def _qwen3moe_config(g: Any) -> dict[str, Any]:
    n_experts = int(g.key("expert_count", 0) or 0)
    if not n_experts:
        raise ConfigError(f"{g.path}: metadata key 'qwen3moe.expert_count' is missing")
    hf = layout_config(g, QWEN3MOE_ARCH, QWEN3_MOE, _qwen3_keys)
    used, renormalise, width = experts_from_gguf(g)
    hf.update({"num_experts": n_experts, "num_experts_per_tok": used, "moe_intermediate_size": width,
               "norm_topk_prob": renormalise, "decoder_sparse_step": 1, "mlp_only_layers": []})
    return hf


QWEN2_ARCH = GGUFArch("qwen2", lambda g: layout_config(g, QWEN2_ARCH, QWEN2, _qwen2_keys), BLOCK, split_qkv_bias=True)
QWEN3_ARCH = GGUFArch("qwen3", lambda g: layout_config(g, QWEN3_ARCH, QWEN3, _qwen3_keys), BLOCK)
QWEN3MOE_ARCH = GGUFArch("qwen3moe", _qwen3moe_config, BLOCK, moe=QWEN3_MOE_NAMES)
