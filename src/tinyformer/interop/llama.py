"""Weight adapter: Hugging Face Llama (and Mistral / Qwen2, which share its layout) <-> tinyformer.

RoPE convention: both sides use the half-split pairing (dimension i rotates with i + d_head/2),
so q/k rows are copied unpermuted. (Meta's original checkpoints and GGUF files pair adjacent
dimensions; their importers permute W_q and W_k rows before calling this adapter.)

Name mapping, per layer i (HF  ->  tinyformer):
  model.embed_tokens.weight                        tok_emb.weight
  model.layers.i.input_layernorm.weight            blocks.i.attn_norm.weight
  model.layers.i.self_attn.{q,k,v}_proj.weight     blocks.i.attn.qkv.weight   (rows: q, then k, then v)
  model.layers.i.self_attn.{q,k,v}_proj.bias       blocks.i.attn.qkv.bias     (Qwen2)
  model.layers.i.self_attn.o_proj.weight           blocks.i.attn.out.weight
  model.layers.i.post_attention_layernorm.weight   blocks.i.ffn_norm.weight
  model.layers.i.mlp.{gate,up}_proj.weight         blocks.i.ffn.gate_up.weight (rows: gate, then up)
  model.layers.i.mlp.down_proj.weight              blocks.i.ffn.down.weight
  model.norm.weight                                norm.weight
  lm_head.weight                                   lm_head.weight (absent when tied)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """A tinyformer ModelConfig from a Hugging Face Llama/Mistral/Qwen2 ``config.json`` dict."""
    arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    model_type = hf.get("model_type", "llama")
    if model_type not in ("llama", "mistral", "qwen2"):
        raise ConfigError(f"model_type {model_type!r} ({arch}) is not supported by the Llama adapter")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {hf.get('hidden_act')!r} is not supported (Llama uses 'silu')")
    rope_params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope_params.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
    rope_params.pop("partial_rotary_factor", None)
    kind = rope_params.get("rope_type", rope_params.get("type", "default"))
    if "type" in rope_params:
        rope_params["rope_type"] = rope_params.pop("type")
    rope_scaling = None if kind == "default" else rope_params
    if rope_scaling is not None and kind == "dynamic":
        # HF's dynamic NTK scales from max_position_embeddings
        rope_scaling.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
    if rope_scaling is not None and kind in ("yarn", "llama3"):
        rope_scaling.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
    if hf.get("sliding_window") and hf.get("use_sliding_window", model_type == "mistral"):
        if hf["sliding_window"] < hf["max_position_embeddings"]:
            raise ConfigError(f"sliding_window={hf['sliding_window']} attention is not supported")
    n_head = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_head
    qkv_bias = bool(hf.get("attention_bias", model_type == "qwen2"))
    return ModelConfig(
        arch="decoder",
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layer=hf["num_hidden_layers"],
        n_head=n_head,
        n_kv_head=hf.get("num_key_value_heads") or n_head,
        head_dim=head_dim,
        d_ff=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"],
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        pos="rope",
        rope_theta=float(theta),
        rope_scaling=rope_scaling,
        ffn="swiglu",
        attn_bias=qkv_bias,
        attn_out_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def check_llama_compatible(cfg: ModelConfig) -> None:
    """Raise ConfigError naming the first option Hugging Face's Llama/Qwen2 cannot express."""
    wanted = {"arch": "decoder", "norm": "rmsnorm", "norm_placement": "pre", "pos": "rope", "ffn": "swiglu",
              "final_norm": True, "embed_scale": False, "type_vocab_size": 0}
    for key, value in wanted.items():
        if getattr(cfg, key) != value:
            raise ConfigError(f"{key}={getattr(cfg, key)!r} cannot be exported as Llama/Qwen2 (needs {value!r})")
    if cfg.attn_out_bias and not cfg.attn_bias:
        raise ConfigError("attn_out_bias without attn_bias cannot be exported as Llama/Qwen2")


def config_to_hf(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, Any]:
    """A Hugging Face config dict: Qwen2 when only q/k/v carry biases, Llama otherwise."""
    check_llama_compatible(cfg)
    qwen2 = cfg.attn_bias and not cfg.attn_out_bias
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope_parameters = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
        rope_parameters["rope_type"] = cfg.rope_type
        rope_parameters.pop("type", None)
    hf: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu",
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": torch_dtype,
        "dtype": torch_dtype,
    }
    if cfg.rope_scaling:
        hf["rope_scaling"] = dict(rope_parameters)
    if not qwen2:
        hf["attention_bias"] = cfg.attn_bias
        hf["mlp_bias"] = cfg.mlp_bias
    return hf


def hf_to_tinyformer(cfg: ModelConfig, hf_sd: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (tinyformer name, tensor), one tensor at a time, from a HF state dict (or lazy mapping).

    Raises ConfigError naming a missing tensor. Callers check that every HF tensor was consumed."""

    def get(name: str) -> torch.Tensor:
        if name not in hf_sd:
            raise ConfigError(f"tensor {name!r} is missing from the checkpoint")
        return hf_sd[name]

    yield "tok_emb.weight", get("model.embed_tokens.weight")
    for i in range(cfg.n_layer):
        p, a = f"model.layers.{i}.", f"blocks.{i}."
        yield a + "attn_norm.weight", get(p + "input_layernorm.weight")
        yield a + "attn.qkv.weight", torch.cat([get(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        if cfg.attn_bias:
            yield a + "attn.qkv.bias", torch.cat([get(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
        yield a + "attn.out.weight", get(p + "self_attn.o_proj.weight")
        if cfg.attn_out_bias:
            yield a + "attn.out.bias", get(p + "self_attn.o_proj.bias")
        yield a + "ffn_norm.weight", get(p + "post_attention_layernorm.weight")
        yield a + "ffn.gate_up.weight", torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        if cfg.mlp_bias:
            yield a + "ffn.gate_up.bias", torch.cat([get(p + "mlp.gate_proj.bias"), get(p + "mlp.up_proj.bias")])
        yield a + "ffn.down.weight", get(p + "mlp.down_proj.weight")
        if cfg.mlp_bias:
            yield a + "ffn.down.bias", get(p + "mlp.down_proj.bias")
    yield "norm.weight", get("model.norm.weight")
    if not cfg.tie_embeddings:
        yield "lm_head.weight", get("lm_head.weight")


def tinyformer_to_hf(cfg: ModelConfig, sd: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) from a tinyformer state dict; the inverse of ``hf_to_tinyformer``."""
    q, kv, f = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.d_ff
    yield "model.embed_tokens.weight", sd["tok_emb.weight"]
    for i in range(cfg.n_layer):
        p, a = f"model.layers.{i}.", f"blocks.{i}."
        yield p + "input_layernorm.weight", sd[a + "attn_norm.weight"]
        for name, part in zip("qkv", sd[a + "attn.qkv.weight"].split((q, kv, kv))):
            yield p + f"self_attn.{name}_proj.weight", part.contiguous()
        if cfg.attn_bias:
            for name, part in zip("qkv", sd[a + "attn.qkv.bias"].split((q, kv, kv))):
                yield p + f"self_attn.{name}_proj.bias", part.contiguous()
        yield p + "self_attn.o_proj.weight", sd[a + "attn.out.weight"]
        if cfg.attn_out_bias:
            yield p + "self_attn.o_proj.bias", sd[a + "attn.out.bias"]
        yield p + "post_attention_layernorm.weight", sd[a + "ffn_norm.weight"]
        gate, up = sd[a + "ffn.gate_up.weight"].split((f, f))
        yield p + "mlp.gate_proj.weight", gate.contiguous()
        yield p + "mlp.up_proj.weight", up.contiguous()
        if cfg.mlp_bias:
            gate_b, up_b = sd[a + "ffn.gate_up.bias"].split((f, f))
            yield p + "mlp.gate_proj.bias", gate_b.contiguous()
            yield p + "mlp.up_proj.bias", up_b.contiguous()
        yield p + "mlp.down_proj.weight", sd[a + "ffn.down.weight"]
        if cfg.mlp_bias:
            yield p + "mlp.down_proj.bias", sd[a + "ffn.down.bias"]
    yield "model.norm.weight", sd["norm.weight"]
    if not cfg.tie_embeddings:
        yield "lm_head.weight", sd["lm_head.weight"]
