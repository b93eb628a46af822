"""Named shapes of the gpt2 family (Radford et al. 2019): LayerNorm, learned positions, GELU 4d MLP, biases, tied
head. Field values, never a code path."""

from __future__ import annotations

from typing import Any

GPT2: dict[str, Any] = dict(
    norm="layernorm", norm_eps=1e-5, norm_placement="pre", pos="learned", ffn="gelu_tanh",
    attn_bias=True, attn_out_bias=True, mlp_bias=True, tie_embeddings=True,
)

PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-124m": dict(GPT2, vocab_size=50257, d_model=768, n_layer=12, n_head=12, max_seq_len=1024),
    "gpt2-350m": dict(GPT2, vocab_size=50257, d_model=1024, n_layer=24, n_head=16, max_seq_len=1024),
}
