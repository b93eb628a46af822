"""Named model shapes: each preset is a set of ModelConfig values, never a code path.

Shapes are the ones the papers and official configs give:
  llama-7b / llama2-*: Touvron et al. 2023a/b (vocab 32000, SwiGLU 2/3*4d rounded to 256)
  llama3-8b: Meta Llama 3 (vocab 128256, GQA 8 KV heads, theta 500000)
  gpt2-124m: Radford et al. 2019 (LayerNorm, learned positions, GELU 4d MLP, biases, tied head)
  gpt3-175b: Brown et al. 2020, table 2.1 (d 12288, 96 layers, 96 heads, context 2048)
  stories15m / llama-110m: the llama2.c `stories15M` shape and a ~110M LLaMA, used by the benchmarks
  tiny: the CPU default that `tinyformer train` starts from.
  moe: a small mixture of experts (8 experts, 2 per token) that trains on a CPU.
"""

from __future__ import annotations

from typing import Any

from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError

_LLAMA: dict[str, Any] = dict(
    norm="rmsnorm", norm_placement="pre", pos="rope", ffn="swiglu", tie_embeddings=False, vocab_size=32000
)
_GPT2: dict[str, Any] = dict(
    norm="layernorm", norm_eps=1e-5, norm_placement="pre", pos="learned", ffn="gelu_tanh",
    attn_bias=True, attn_out_bias=True, mlp_bias=True, tie_embeddings=True,
)
_BERT: dict[str, Any] = dict(
    arch="encoder", norm="layernorm", norm_eps=1e-12, norm_placement="post", final_norm=False, pos="learned",
    ffn="gelu", attn_bias=True, attn_out_bias=True, mlp_bias=True, tie_embeddings=True, type_vocab_size=2,
    embed_norm=True, pooler=True, pad_token_id=0,
)
_VASWANI: dict[str, Any] = dict(
    arch="encoder_decoder", norm="layernorm", norm_eps=1e-6, norm_placement="post", final_norm=False,
    pos="sinusoidal", embed_scale=True, ffn="relu", attn_bias=True, attn_out_bias=True, mlp_bias=True,
    tie_embeddings=True, share_src_tgt_embeddings=True,
)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        norm="rmsnorm", pos="rope", ffn="swiglu", vocab_size=4096, d_model=256, n_layer=4, n_head=8,
        n_kv_head=4, d_ff=704, max_seq_len=256, tie_embeddings=True,
    ),
    # A small mixture of experts that trains on a CPU: 8 SwiGLU experts of width 256, 2 per token (Mixtral's
    # routing), so each token runs the FFN compute of a 512-wide dense model with 4x its FFN parameters.
    "moe": dict(
        norm="rmsnorm", pos="rope", ffn="moe", n_experts=8, experts_per_token=2, vocab_size=4096, d_model=256,
        n_layer=4, n_head=8, n_kv_head=4, d_ff=256, max_seq_len=256, tie_embeddings=True,
    ),
    "stories15m": dict(_LLAMA, d_model=288, n_layer=6, n_head=6, d_ff=768, max_seq_len=256),
    "llama-110m": dict(_LLAMA, d_model=768, n_layer=12, n_head=12, d_ff=2048, max_seq_len=1024),
    "llama-7b": dict(_LLAMA, d_model=4096, n_layer=32, n_head=32, max_seq_len=2048, norm_eps=1e-6),
    "llama2-7b": dict(_LLAMA, d_model=4096, n_layer=32, n_head=32, max_seq_len=4096),
    "llama2-13b": dict(_LLAMA, d_model=5120, n_layer=40, n_head=40, max_seq_len=4096),
    "llama2-70b": dict(
        _LLAMA, d_model=8192, n_layer=80, n_head=64, n_kv_head=8, ffn_dim_multiplier=1.3,
        ffn_multiple_of=4096, max_seq_len=4096,
    ),
    "llama3-8b": dict(
        _LLAMA, vocab_size=128256, d_model=4096, n_layer=32, n_head=32, n_kv_head=8, d_ff=14336,
        rope_theta=500000.0, max_seq_len=8192,
    ),
    "llama3.1-8b": dict(
        _LLAMA, vocab_size=128256, d_model=4096, n_layer=32, n_head=32, n_kv_head=8, d_ff=14336,
        rope_theta=500000.0, max_seq_len=131072,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "gpt2-124m": dict(_GPT2, vocab_size=50257, d_model=768, n_layer=12, n_head=12, max_seq_len=1024),
    "gpt2-350m": dict(_GPT2, vocab_size=50257, d_model=1024, n_layer=24, n_head=16, max_seq_len=1024),
    "gpt3-175b": dict(_GPT2, vocab_size=50257, d_model=12288, n_layer=96, n_head=96, max_seq_len=2048),
    # BERT (Devlin et al. 2019): Post-Norm encoder, LayerNorm eps 1e-12 after the summed embeddings, learned
    # positions, 2 token types, GELU. bert-base counts as transformers.BertModel with its pooler: 109,482,240.
    "bert-base": dict(_BERT, vocab_size=30522, d_model=768, n_layer=12, n_head=12, d_ff=3072, max_seq_len=512),
    # BERT-Tiny's shape (Turc et al. 2019), with the masked-LM head: the CPU default of `--objective mlm`.
    "bert-tiny": dict(_BERT, vocab_size=30522, d_model=128, n_layer=2, n_head=2, d_ff=512, max_seq_len=512,
                      mlm_head=True),
    # The 2017 Transformer base model (Vaswani et al., table 3): 6+6 Post-Norm layers, d 512, 8 heads, ReLU
    # d_ff 2048, sinusoidal positions, embeddings * sqrt(d), one 37000-token table shared by source, target and
    # softmax. 63,082,496 parameters by exact count (the paper rounds to 65M). Dropout 0.1 was a training choice.
    "transformer-base": dict(_VASWANI, vocab_size=37000, d_model=512, n_layer=6, n_encoder_layer=6, n_head=8,
                             d_ff=2048, max_seq_len=512),
    # A small 2017-style encoder-decoder for the synthetic tasks of `tinyformer train --task` on a CPU.
    "transformer-tiny": dict(_VASWANI, vocab_size=64, d_model=128, n_layer=2, n_encoder_layer=2, n_head=4,
                             d_ff=512, max_seq_len=64),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The ModelConfig of a named preset, with optional field overrides."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(preset_names())}")
    return ModelConfig(**{**PRESETS[name], **overrides})
