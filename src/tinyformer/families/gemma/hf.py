"""The gemma family's Hugging Face adapter: Gemma 2 and Gemma 3 (text) <-> tinyformer.

Gemma is a Llama-layout decoder with these options (each a ModelConfig field):
  RMSNorm gain (1 + g)                           norm_gain_offset = 1
  FFN down(gelu_tanh(gate x) * up x)             ffn = "geglu_tanh"
  embeddings times sqrt(d_model)                 embed_scale = True
  a norm before and after each sub-block          norm_placement = "sandwich"
  scores scaled by query_pre_attn_scalar^-1/2    attn_scale
  alternating local (sliding) and global layers  sliding_window, layer_types
  Gemma 3: q/k RMSNorm; the local layers' own RoPE base (rope_parameters["sliding_attention"])
                                                 qk_norm, rope_local_theta
  Gemma 2: scores c tanh(s/c), logits c tanh(l/c) attn_logit_softcap, final_logit_softcap

Names are the Llama ones (see ``families/llama/hf.py``) except the norms of a layer i:
  model.layers.i.input_layernorm            blocks.i.attn_norm        (before attention)
  model.layers.i.post_attention_layernorm   blocks.i.attn_post_norm   (after attention: not Llama's meaning)
  model.layers.i.pre_feedforward_layernorm  blocks.i.ffn_norm
  model.layers.i.post_feedforward_layernorm blocks.i.ffn_post_norm
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError
from tinyformer.families.adapter import Adapter, fixed_field_problem, hf_pad_token_id
from tinyformer.families.llama import hf as llama


@dataclass(frozen=True)
class GemmaType:
    """One Gemma model type: ``global_every``, the default local/global pattern when layer_types is absent (every
    n-th layer is global, as llama.cpp fixes it); ``gemma3`` Gemma 3's q/k norms and RoPE per layer type (the local
    layers' own base); ``gguf_arch`` llama.cpp's architecture."""

    model_type: str
    architecture: str
    gguf_arch: str
    global_every: int
    gemma3: bool


TYPES = {t.model_type: t for t in (GemmaType("gemma2", "Gemma2ForCausalLM", "gemma2", 2, gemma3=False),
                                   GemmaType("gemma3_text", "Gemma3ForCausalLM", "gemma3", 6, gemma3=True))}
MODEL_TYPES = tuple(TYPES)


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """A ModelConfig from a Gemma 2 / Gemma 3 text ``config.json`` dict; ConfigError names what does not fit."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not supported by the Gemma adapter "
                          f"(supported: {', '.join(MODEL_TYPES)}; for Gemma 3 use the text model, gemma3_text)")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"hidden_activation {act!r} is not supported (Gemma uses 'gelu_pytorch_tanh')")
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention (an encoder Gemma) is not supported")
    if hf.get("quantization_config"):
        raise ConfigError("pre-quantized checkpoints (quantization_config) are not supported")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size", "max_position_embeddings") if k not in hf]
    if missing:
        raise ConfigError(f"config.json lacks {', '.join(missing)}")
    params = hf.get("rope_parameters") or {}
    local_theta = None
    if "full_attention" in params:  # Gemma 3: a RoPE per layer type
        full, local = dict(params["full_attention"] or {}), dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"RoPE scaling of the sliding layers ({local.get('rope_type')!r}) is not supported")
        theta, rope_scaling = llama.rope_from_hf({"rope_parameters": full,
                                                   "max_position_embeddings": hf["max_position_embeddings"]})
        local_theta = float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))
    else:
        theta, rope_scaling = llama.rope_from_hf(hf)
    hf_types = hf.get("layer_types")
    if not hf_types:  # every n-th layer global
        every = int(hf.get("sliding_window_pattern") or TYPES[model_type].global_every)
        hf_types = ["sliding_attention" if (i + 1) % every else "full_attention"
                    for i in range(int(hf["num_hidden_layers"]))]
    types = llama.hf_layer_types(hf_types)
    window = hf.get("sliding_window") if "sliding" in types else None
    if window is None:
        types, local_theta = ["full"] * len(types), None
    n_head = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // n_head)
    scalar = hf.get("query_pre_attn_scalar") or head_dim
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        arch="decoder",
        vocab_size=int(hf["vocab_size"]),
        d_model=int(hf["hidden_size"]),
        n_layer=int(hf["num_hidden_layers"]),
        n_head=n_head,
        n_kv_head=int(hf.get("num_key_value_heads") or n_head),
        head_dim=head_dim,
        d_ff=int(hf["intermediate_size"]),
        max_seq_len=int(hf["max_position_embeddings"]),
        norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        norm_gain_offset=1.0,
        norm_placement="sandwich",
        pos="rope",
        rope_theta=theta,
        rope_scaling=rope_scaling,
        rope_local_theta=local_theta,
        ffn="geglu_tanh",
        attn_bias=bias,
        attn_out_bias=bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        embed_scale=True,
        attn_dropout=float(hf.get("attention_dropout", 0.0) or 0.0),
        qk_norm=TYPES[model_type].gemma3,
        attn_scale=float(scalar) ** -0.5,
        attn_logit_softcap=hf.get("attn_logit_softcapping"),
        final_logit_softcap=hf.get("final_logit_softcapping"),
        sliding_window=int(window) if window is not None else None,
        layer_types=None if window is None or set(types) == {"sliding"} else types,
        pad_token_id=hf_pad_token_id(hf),
        extra={"source": model_type, "hf_config": dict(hf)},
    )


def export_model_type(cfg: ModelConfig) -> str:
    """Gemma 3 when the model has q/k norms or a local RoPE base, Gemma 2 otherwise."""
    return "gemma3_text" if cfg.qk_norm or cfg.rope_local_theta is not None else "gemma2"


def export_problem(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` cannot be written as Gemma 2/3, or None when it can."""
    wanted = {"arch": "decoder", "norm": "rmsnorm", "norm_gain_offset": 1.0, "norm_placement": "sandwich",
              "pos": "rope", "ffn": "geglu_tanh", "final_norm": True, "embed_scale": True, "mlp_bias": False}
    if problem := fixed_field_problem(cfg, wanted, "Gemma"):
        return problem
    if cfg.attn_bias != cfg.attn_out_bias:
        return "Gemma has all four attention biases or none"
    if cfg.qk_norm and not TYPES[export_model_type(cfg)].gemma3:
        return "qk_norm needs Gemma 3"
    return None


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The imported config when the model is unchanged, else a fresh Gemma 2 / Gemma 3 text config."""
    if problem := export_problem(cfg):
        raise ConfigError(problem)
    kept = llama.original_if_unchanged(cfg, config_from_hf)
    if kept is not None:
        return kept
    model_type = export_model_type(cfg)
    hf = llama.shape_to_hf(cfg, model_type, TYPES[model_type].architecture)
    if TYPES[model_type].gemma3:  # a RoPE per layer type
        local = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
        hf["rope_parameters"] = {"full_attention": hf["rope_parameters"],
                                 "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    scalar = (cfg.attn_scale or cfg.head_dim**-0.5) ** -2
    hf.update({
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": cfg.attn_bias,
        "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
        "sliding_window": cfg.sliding_window,
        "layer_types": ["sliding_attention" if cfg.layer_window(i) else "full_attention" for i in range(cfg.n_layer)],
        "attn_logit_softcapping": cfg.attn_logit_softcap,
        "final_logit_softcapping": cfg.final_logit_softcap,
    })
    return hf


# the Llama names, with the sandwich norms (llama.tensor_names)
ADAPTER = Adapter(name="gemma", model_types=MODEL_TYPES, config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                  hf_to_tinyformer=llama.hf_to_tinyformer, tinyformer_to_hf=llama.tinyformer_to_hf,
                  export_problem=export_problem, ignorable_hf_tensor=llama.ignorable_hf_tensor)
