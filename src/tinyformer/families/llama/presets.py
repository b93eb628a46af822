"""Named shapes of the llama family (Touvron et al. 2023a/b; Meta Llama 3): field values, never a code path.

  llama-7b / llama2-*: vocab 32000, SwiGLU 2/3*4d rounded to 256; llama2-70b GQA with 8 KV heads
  llama3-8b: vocab 128256, GQA 8 KV heads, theta 500000; llama3.1-8b adds its RoPE scaling and 128k context
"""

from __future__ import annotations

from typing import Any

LLAMA: dict[str, Any] = dict(
    norm="rmsnorm", norm_placement="pre", pos="rope", ffn="swiglu", tie_embeddings=False, vocab_size=32000
)

PRESETS: dict[str, dict[str, Any]] = {
    "llama-7b": dict(LLAMA, d_model=4096, n_layer=32, n_head=32, max_seq_len=2048, norm_eps=1e-6),
    "llama2-7b": dict(LLAMA, d_model=4096, n_layer=32, n_head=32, max_seq_len=4096),
    "llama2-13b": dict(LLAMA, d_model=5120, n_layer=40, n_head=40, max_seq_len=4096),
    "llama2-70b": dict(
        LLAMA, d_model=8192, n_layer=80, n_head=64, n_kv_head=8, ffn_dim_multiplier=1.3,
        ffn_multiple_of=4096, max_seq_len=4096,
    ),
    "llama3-8b": dict(
        LLAMA, vocab_size=128256, d_model=4096, n_layer=32, n_head=32, n_kv_head=8, d_ff=14336,
        rope_theta=500000.0, max_seq_len=8192,
    ),
    "llama3.1-8b": dict(
        LLAMA, vocab_size=128256, d_model=4096, n_layer=32, n_head=32, n_kv_head=8, d_ff=14336,
        rope_theta=500000.0, max_seq_len=131072,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
}
