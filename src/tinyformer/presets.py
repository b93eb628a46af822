"""Named model shapes: each preset is a set of ModelConfig values, never a code path.

The shapes of a model family's published checkpoints live in its folder (``families/<family>/presets.py``:
llama-7b, llama2-*, llama3-*, gpt2-124m/350m, bert-base/tiny) and come here through the family registry. This
module holds the shapes no imported family owns, the papers' and the project's own:
  gpt3-175b: Brown et al. 2020, table 2.1 (d 12288, 96 layers, 96 heads, context 2048; GPT-2's layout)
  transformer-base / transformer-tiny: the 2017 encoder-decoder (Vaswani et al.) and a small one for `--task`
  stories15m / llama-110m: the llama2.c `stories15M` shape and a ~110M LLaMA, used by the benchmarks
  tiny: the CPU default that `tinyformer train` starts from.
  moe: a small mixture of experts (8 experts, 2 per token) that trains on a CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError
from tinyformer.families import family_presets
from tinyformer.families.gpt2.presets import GPT2
from tinyformer.families.llama.presets import LLAMA

_VASWANI: dict[str, Any] = dict(arch="encoder_decoder", norm="layernorm", norm_eps=1e-6, norm_placement="post",
                                final_norm=False, pos="sinusoidal", embed_scale=True, ffn="relu", attn_bias=True,
                                attn_out_bias=True, mlp_bias=True, tie_embeddings=True, share_src_tgt_embeddings=True)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(norm="rmsnorm", pos="rope", ffn="swiglu", vocab_size=4096, d_model=256, n_layer=4, n_head=8,
                 n_kv_head=4, d_ff=704, max_seq_len=256, tie_embeddings=True),
    # A small mixture of experts that trains on a CPU: 8 SwiGLU experts of width 256, 2 per token (Mixtral's
    # routing), so each token runs the FFN compute of a 512-wide dense model with 4x its FFN parameters.
    "moe": dict(norm="rmsnorm", pos="rope", ffn="moe", n_experts=8, experts_per_token=2, vocab_size=4096,
                d_model=256, n_layer=4, n_head=8, n_kv_head=4, d_ff=256, max_seq_len=256, tie_embeddings=True),
    "stories15m": dict(LLAMA, d_model=288, n_layer=6, n_head=6, d_ff=768, max_seq_len=256),
    "llama-110m": dict(LLAMA, d_model=768, n_layer=12, n_head=12, d_ff=2048, max_seq_len=1024),
    "gpt3-175b": dict(GPT2, vocab_size=50257, d_model=12288, n_layer=96, n_head=96, max_seq_len=2048),
    # The 2017 Transformer base model (Vaswani et al., table 3): 6+6 Post-Norm layers, d 512, 8 heads, ReLU
    # d_ff 2048, sinusoidal positions, embeddings * sqrt(d), one 37000-token table shared by source, target and
    # softmax. 63,082,496 parameters by exact count (the paper rounds to 65M). Dropout 0.1 was a training choice.
    "transformer-base": dict(_VASWANI, vocab_size=37000, d_model=512, n_layer=6, n_encoder_layer=6, n_head=8,
                             d_ff=2048, max_seq_len=512),
    # A small 2017-style encoder-decoder for the synthetic tasks of `tinyformer train --task` on a CPU.
    "transformer-tiny": dict(_VASWANI, vocab_size=64, d_model=128, n_layer=2, n_encoder_layer=2, n_head=4,
                             d_ff=512, max_seq_len=64),
    **family_presets(),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The ModelConfig of a named preset, with optional field overrides."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}")
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)})
    if unknown:
        raise ConfigError(f"unknown model field(s): {', '.join(unknown)}")
    return ModelConfig(**{**PRESETS[name], **overrides})
