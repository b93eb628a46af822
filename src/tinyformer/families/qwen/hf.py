"""The qwen family's Hugging Face model types on the Llama layout (``families/llama/hf.py``): Qwen2, Qwen3 and the
mixture of experts Qwen3-MoE.

Qwen2 always has q/k/v biases and nothing else. Qwen3 adds a per-head RMSNorm of q and k (``qk_norm``:
``model.layers.i.self_attn.{q,k}_norm.weight``), states ``head_dim`` and has ``attention_bias`` (q, k, v and o).
Qwen2/3 slide only with ``use_sliding_window``, in the layers ``layer_types`` marks "sliding_attention" (by default
those from ``max_window_layers`` on); Qwen3-MoE then slides in every layer. Qwen3-MoE is Qwen3 with routed experts of
width ``moe_intermediate_size`` in every layer, renormalised when ``norm_topk_prob``:
  model.layers.i.mlp.gate.weight                         blocks.i.ffn.router.weight
  model.layers.i.mlp.experts.e.{gate,up}_proj.weight     blocks.i.ffn.gate_up[e] (rows: gate, then up)
  model.layers.i.mlp.experts.e.down_proj.weight          blocks.i.ffn.down[e]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError
from tinyformer.families.llama.hf import (
    Layout,
    LayoutType,
    MoENames,
    attention_bias_key,
    expert_keys,
    per_layer_window_keys,
    window_keys,
)


def _writes_qwen2(cfg: ModelConfig, imported: str | None) -> bool:
    """A window with q/k/v biases (Mistral has none), or a model imported from Qwen2 with q/k/v biases only."""
    if cfg.ffn == "moe" or cfg.qk_norm:
        return False
    if cfg.sliding_window is not None:
        return cfg.attn_bias
    return imported == "qwen2" and cfg.attn_bias and not cfg.attn_out_bias and not cfg.mlp_bias


def _check_qwen3_moe(hf: Mapping[str, Any]) -> None:
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
        raise ConfigError("Qwen3-MoE with dense layers (mlp_only_layers, decoder_sparse_step != 1) is not "
                          "supported: every layer must be a MoE layer")
    if hf.get("shared_expert_intermediate_size"):
        raise ConfigError("shared_expert_intermediate_size (a gated shared expert) is not supported")


def _qwen3_moe_keys(cfg: ModelConfig) -> dict[str, Any]:
    return {"num_experts": cfg.n_experts, "moe_intermediate_size": cfg.d_ff, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "norm_topk_prob": cfg.router_norm_topk or cfg.router_order == "topk_softmax"}


QWEN3_MOE_NAMES: MoENames = ("mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj")
QWEN3_MOE = LayoutType("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3moe", biases="config", window="flag",
                       writes=lambda cfg, imported: cfg.ffn == "moe" and cfg.qk_norm,
                       hf_keys=(attention_bias_key, window_keys, expert_keys, _qwen3_moe_keys), qk_norm=True,
                       moe=QWEN3_MOE_NAMES, check_hf=_check_qwen3_moe, d_ff_key="moe_intermediate_size")
QWEN3 = LayoutType("qwen3", "Qwen3ForCausalLM", "qwen3", biases="config", window="flag_per_layer",
                   writes=lambda cfg, imported: cfg.ffn != "moe" and cfg.qk_norm,
                   hf_keys=(attention_bias_key, window_keys, per_layer_window_keys),
                   qk_norm=True)
QWEN2 = LayoutType("qwen2", "Qwen2ForCausalLM", "qwen2", biases="qkv", window="flag_per_layer",
                   writes=_writes_qwen2, hf_keys=(window_keys, per_layer_window_keys))
LAYOUT = Layout("qwen", (QWEN3_MOE, QWEN3, QWEN2),
                unclaimed="Qwen is written for q/k norms (Qwen3), a sliding window with q/k/v biases, or a model "
                          "imported from Qwen2 with q/k/v biases only (Qwen2)")
ADAPTER = LAYOUT.adapter()
