"""The phi3 family's Hugging Face model type on the Llama layout (``families/llama/hf.py``): Phi-3.

Phi-3 stores q/k/v and gate/up fused already, in tinyformer's row order:
  model.layers.i.self_attn.qkv_proj.weight         blocks.i.attn.qkv.weight
  model.layers.i.mlp.gate_up_proj.weight           blocks.i.ffn.gate_up.weight
every other name as Llama. LongRoPE (``rope_type`` "longrope", first called "su") maps to ``rope_scaling``. Every
layer slides when ``sliding_window`` is set.

A model is written as Phi-3 only when it was imported from Phi-3 and has none of what Phi-3 lacks (biases, q/k norms,
a per-layer window pattern); any other Phi-3-shaped model is written as Llama or Mistral, which load everywhere.
"""

from __future__ import annotations

from tinyformer.config import ModelConfig
from tinyformer.families.llama.hf import Layout, LayoutType, window_keys


def _writes_phi3(cfg: ModelConfig, imported: str | None) -> bool:
    return cfg.ffn != "moe" and imported == "phi3" and not (
        cfg.qk_norm or cfg.attn_bias or cfg.attn_out_bias or cfg.mlp_bias or cfg.layer_types is not None)


PHI3 = LayoutType("phi3", "Phi3ForCausalLM", "phi3", biases="config", window="always", writes=_writes_phi3,
                  hf_keys=(window_keys,), fused=True)
LAYOUT = Layout("phi3", (PHI3,),
                unclaimed="only a model imported from Phi-3, without biases, q/k norms or a per-layer window "
                          "pattern, is written as Phi-3")
ADAPTER = LAYOUT.adapter()
