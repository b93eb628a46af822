"""Model arithmetic: parameters, training FLOPs, KV-cache and attention memory.

Everything here is computed from the config by formula (no model is built), and the tests check
each parameter count against ``sum(p.numel())`` of the real model built on the ``meta`` device.

The per-layer parameter formulas (attention, FFN, norms) and the ``ParamCount`` breakdown are in
``sizing/params.py``; an encoder's other parts and the encoder-decoder stack are counted in ``sizing/classic.py``.
Training FLOPs per token (Kaplan et al. 2020; PaLM appendix B):
  6 N_matmul + 12 n_layer H d_h T
where N_matmul counts the weights that take part in matrix multiplies (every matrix, the LM head
included even when tied, but not the embedding lookups; for MoE only the k experts a token runs) and the
second term is QK^T and AV for a context of T tokens (min(T, W) in a sliding-window layer), forward (x1)
plus backward (x2).
"""

from __future__ import annotations

import os

from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError
from tinyformer.sizing.classic import count_params_classic, encoder_extra
from tinyformer.sizing.params import ParamCount, attention_params, ffn_params, norm_params

DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "int8": 1, "fp8": 1}


def count_params(cfg: ModelConfig) -> ParamCount:
    """Exact parameter count of the model ``cfg`` describes, component by component."""
    if cfg.arch == "encoder_decoder":
        return count_params_classic(cfg)
    d = cfg.d_model
    return ParamCount(
        embedding=cfg.vocab_size * d + cfg.type_vocab_size * d,
        positions=cfg.max_seq_len * d if cfg.pos == "learned" else 0,
        attention_per_layer=attention_params(cfg),
        ffn_per_layer=ffn_params(cfg),
        norms_per_layer=(4 if cfg.norm_placement == "sandwich" else 2) * norm_params(cfg),
        n_layer=cfg.n_layer,
        final_norm=norm_params(cfg) if cfg.final_norm else 0,
        head=0 if cfg.tie_embeddings or (cfg.arch == "encoder" and not cfg.mlm_head) else cfg.vocab_size * d,
        extra=encoder_extra(cfg) if cfg.arch == "encoder" else {},
        ffn_active_per_layer=ffn_params(cfg, active=True) if cfg.ffn == "moe" else None,
    )


def matmul_params(cfg: ModelConfig, counts: ParamCount) -> int:
    """Weights that take part in a matmul per token: all layer matrices a token uses plus the LM head."""
    return counts.non_embedding - counts.inactive - counts.head + cfg.vocab_size * cfg.d_model


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    counts = count_params(cfg)
    if cfg.arch == "decoder":  # a sliding-window layer attends to at most W keys
        spans = sum(min(seq_len, cfg.layer_window(i) or seq_len) for i in range(cfg.n_layer))
    else:
        spans = (cfg.n_layer + (cfg.n_encoder_layer or 0 if cfg.arch == "encoder_decoder" else 0)) * seq_len
    return 6 * matmul_params(cfg, counts) + 12 * cfg.n_head * cfg.head_dim * spans


def kv_cache_bytes_per_token(cfg: ModelConfig, bytes_per_elem: int) -> int:
    """2 (K and V) * n_layer * H_kv * d_h * bytes."""
    return 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * bytes_per_elem


def sizing_report(cfg: ModelConfig, seq_len: int | None = None, batch: int = 1, dtype: str = "bfloat16") -> dict:
    """Everything `tinyformer count` prints, as one JSON-able dict."""
    T = seq_len or cfg.max_seq_len
    if T <= 0 or batch <= 0:
        raise ConfigError("--seq-len and --batch must be positive")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    b = DTYPE_BYTES[dtype]
    c = count_params(cfg)
    kv_tok = kv_cache_bytes_per_token(cfg, b)
    kv_tok_mha = 2 * cfg.n_layer * cfg.n_head * cfg.head_dim * b
    naive_layer = batch * cfg.n_head * T * T * b
    return {
        "total_params": c.total,
        "active_params": c.active,  # per token: differs from the total for MoE
        "non_embedding_params": c.non_embedding,
        "params": {
            "embedding": c.embedding,
            "positions": c.positions,
            "attention_per_layer": c.attention_per_layer,
            "ffn_per_layer": c.ffn_per_layer,
            "norms_per_layer": c.norms_per_layer,
            "per_layer": c.per_layer,
            "n_layer": c.n_layer,
            "all_layers": c.per_layer * c.n_layer,
            "final_norm": c.final_norm,
            "head": c.head,
            **c.extra,
        },
        "attention_to_ffn_ratio": c.attention_per_layer / c.ffn_per_layer,
        "seq_len": T,
        "batch": batch,
        "dtype": dtype,
        "weights_bytes": c.total * b,
        "training_flops_per_token": training_flops_per_token(cfg, T),
        "training_flops_per_token_6n": 6 * matmul_params(cfg, c),
        "kv_cache": {
            "bytes_per_token": kv_tok,
            "bytes_per_token_if_mha": kv_tok_mha,
            # a sliding-window layer keeps only its last W positions (a rolling cache)
            "bytes_total": kv_tok // cfg.n_layer * batch * sum(
                min(T, (cfg.layer_window(i) if cfg.arch == "decoder" else None) or T) for i in range(cfg.n_layer)),
        },
        "attention_memory": {
            # one layer's T x T score matrix for the batch, as a naive implementation builds it
            "naive_scores_bytes_per_layer": naive_layer,
            # training keeps every layer's probabilities for the backward pass
            "naive_scores_bytes_all_layers": naive_layer * cfg.n_layer,
            # flash-style SDPA keeps only a (B, H, T) float32 log-sum-exp per layer
            "sdpa_bytes_per_layer": batch * cfg.n_head * T * 4,
        },
    }


def machine_memory_bytes() -> int | None:
    """Physical RAM plus the memory of every visible CUDA device (None when the OS does not say)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    import torch

    if torch.cuda.is_available():
        ram += sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return ram


def check_buildable(cfg: ModelConfig, bytes_per_elem: int = 4) -> None:
    """Refuse, before any allocation, a config whose parameters and position tables (at ``bytes_per_elem``
    bytes each) exceed all the memory of this machine (RAM + GPUs): e.g. ``--set model.max_seq_len=10**12``
    would otherwise end in an allocator traceback (or the OOM killer). The message says what would be
    allocated. It is a sanity bound, not a fit test: activations and the optimizer state come on top."""
    params = count_params(cfg).total * bytes_per_elem
    # tables precomputed per position: RoPE's cos and sin (2 max_seq_len head_dim), sinusoidal (max_seq_len d_model)
    tables = {"rope": 2 * cfg.max_seq_len * cfg.head_dim, "sinusoidal": cfg.max_seq_len * cfg.d_model}.get(cfg.pos, 0)
    tables *= bytes_per_elem
    available = machine_memory_bytes()
    if available is None or params + tables <= available:
        return
    raise ConfigError(
        f"this model would allocate {_human_bytes(params + tables)} at {bytes_per_elem} bytes per number "
        f"({_human_bytes(params)} of parameters + {_human_bytes(tables)} of position tables for "
        f"max_seq_len={cfg.max_seq_len:,}, d_model={cfg.d_model:,}, n_layer={cfg.n_layer:,}, "
        f"vocab_size={cfg.vocab_size:,}), more than this machine's {_human_bytes(available)} of memory; "
        "check the sizes in the model config"
    )


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"
