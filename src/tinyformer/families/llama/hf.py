"""The Llama layout, shared by the llama, qwen and phi3 families (and, for its names, gemma), and the llama family's
Hugging Face model types: Llama 1/2/3, Mistral and the mixture of experts Mixtral.

RoPE convention: both sides use the half-split pairing (dimension i rotates with i + d_head/2), so q/k rows are
copied unpermuted (GGUF files pair adjacent dimensions: see ``families/llama/gguf.py``).

Name mapping, per layer i (HF  ->  tinyformer):
  model.embed_tokens.weight                        tok_emb.weight
  model.layers.i.input_layernorm.weight            blocks.i.attn_norm.weight
  model.layers.i.self_attn.{q,k,v}_proj.weight     blocks.i.attn.qkv.weight   (rows: q, then k, then v)
  model.layers.i.self_attn.{q,k,v}_proj.bias       blocks.i.attn.qkv.bias     (Qwen2; Llama attention_bias)
  model.layers.i.self_attn.o_proj.{weight,bias}    blocks.i.attn.out.{weight,bias}
  model.layers.i.self_attn.{q,k}_norm.weight       blocks.i.attn.{q,k}_norm.weight (Qwen3: qk_norm)
  model.layers.i.post_attention_layernorm.weight   blocks.i.ffn_norm.weight
  model.layers.i.mlp.{gate,up}_proj.weight         blocks.i.ffn.gate_up.weight (rows: gate, then up)
  model.layers.i.mlp.down_proj.weight              blocks.i.ffn.down.weight
  model.norm.weight                                norm.weight
  lm_head.weight                                   lm_head.weight (absent when tied)
Mixtral's MoE layers (ffn="moe"; E experts stacked along the first dimension; Qwen3-MoE's names: ``qwen/hf.py``):
  model.layers.i.block_sparse_moe.gate.weight                blocks.i.ffn.router.weight
  model.layers.i.block_sparse_moe.experts.e.{w1,w3}.weight   blocks.i.ffn.gate_up[e] (rows: w1, then w3)
  model.layers.i.block_sparse_moe.experts.e.w2.weight        blocks.i.ffn.down[e]
Phi-3 stores q/k/v and gate/up fused already (``phi3/hf.py``).

Llama has ``attention_bias`` (q, k, v *and* o) and ``mlp_bias``; Mistral has no biases and slides in every layer
when ``sliding_window`` is set; Mixtral is Mistral with routed experts (softmax, top k, renormalised). The context
stays ``max_position_embeddings``.

Each Hugging Face model type of the layout is a ``LayoutType``; a family's ``Layout`` is its types in
export-preference order (the registry, ``families/__init__.py``, chooses among the families).

An imported config remembers the Hugging Face ``config.json`` it came from (``extra["hf_config"]``).
Exporting a model whose shape still equals that config writes the original back unchanged, so an
import/export round trip gives identical config fields; a changed model gets a freshly built config.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from tinyformer.config import ROPE_SCALING_KEYS, ModelConfig
from tinyformer.errors import ConfigError
from tinyformer.families.adapter import (
    Adapter,
    checkpoint_tensor,
    fixed_field_problem,
    hf_pad_token_id,
    imported_hf_config,
)

MoENames = tuple[str, str, str, str, str]  # (router, expert prefix, gate, up, down) under model.layers.i.


@dataclass(frozen=True)
class LayoutType:
    """One Hugging Face model type of the Llama layout.

    biases: "config" (``attention_bias`` for q/k/v and o, the missing ones written as zeros; ``mlp_bias``), "qkv"
    (q/k/v always, nothing else), "none". window: "none" (never slides), "always" (every layer slides when
    ``sliding_window`` is set), "flag" (every layer, only with ``use_sliding_window``), "flag_per_layer" (with
    ``use_sliding_window``, the layers ``layer_types`` / ``max_window_layers`` mark). ``hf_keys``: the config.json
    keys of this type, in order, after the ones every type spells alike. ``writes(cfg, imported_as)``: whether a
    model that the layout can express is written as this type (``imported_as``: the model_type it was imported from,
    or None)."""

    model_type: str
    architecture: str
    gguf_arch: str
    biases: str
    window: str
    writes: Callable[[ModelConfig, str | None], bool]
    hf_keys: tuple[Callable[[ModelConfig], dict[str, Any]], ...] = ()
    qk_norm: bool = False
    moe: MoENames | None = None
    router_always_renormalises: bool = False
    check_hf: Callable[[Mapping[str, Any]], None] | None = None
    fused: bool = False
    d_ff_key: str = "intermediate_size"


def hf_layer_types(hf_types: list[str]) -> list[str]:
    """HF ``layer_types`` as tinyformer's: "sliding_attention" -> "sliding", "full_attention" -> "full"."""
    unknown = sorted(set(hf_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ConfigError(f"layer_types {', '.join(unknown)} are not supported")
    return [t.removesuffix("_attention") for t in hf_types]


def window_from_hf(hf: Mapping[str, Any], kind: LayoutType) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) from a HF config, as transformers' config classes decide (``kind.window``)."""
    window = hf.get("sliding_window")
    if kind.window == "none" or window is None or (kind.window != "always" and not hf.get("use_sliding_window")):
        return None, None
    n = int(hf["num_hidden_layers"])
    hf_types = hf.get("layer_types")
    if kind.window != "flag_per_layer":
        types = ["sliding"] * n
    elif hf_types:
        types = hf_layer_types(hf_types)
    else:
        first = int(hf.get("max_window_layers", n))
        types = ["sliding" if i >= first else "full" for i in range(n)]
    if "sliding" not in types:
        return None, None
    return int(window), None if set(types) == {"sliding"} else types


def rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from HF's ``rope_parameters`` (transformers 5) or ``rope_scaling``/``rope_theta``
    (transformers 4)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters must be a mapping, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ConfigError("per-layer-type rope_parameters are not supported")
    params = dict(params)
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    partial = params.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor") or 1.0
    if partial != 1.0:
        raise ConfigError(f"partial_rotary_factor={partial} (RoPE on part of each head) is not supported")
    kind = params.pop("rope_type", params.pop("type", "default"))
    kind = {"su": "longrope"}.get(kind, kind)  # Phi-3's first name for LongRoPE
    if kind == "default":
        return float(theta), None
    if kind not in ROPE_SCALING_KEYS:
        raise ConfigError(f"rope_type {kind!r} is not supported (supported: default, {', '.join(ROPE_SCALING_KEYS)})")
    if kind == "dynamic":
        # transformers' dynamic NTK always scales from max_position_embeddings (it ignores any
        # original_max_position_embeddings), and so does tinyformer when the key is absent
        params.pop("original_max_position_embeddings", None)
    if kind in ("yarn", "llama3", "longrope"):
        params.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings")
                          or hf["max_position_embeddings"])
    unknown = sorted(set(params) - set(ROPE_SCALING_KEYS[kind]))
    if unknown:
        raise ConfigError(f"rope_parameters key(s) {', '.join(unknown)} are not supported for rope_type {kind!r}")
    return float(theta), {"rope_type": kind, **params}


def imported_as(cfg: ModelConfig) -> str | None:
    """The Hugging Face model_type ``cfg`` was imported from, or None."""
    return (imported_hf_config(cfg) or {}).get("model_type")


def layout_problem(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` cannot be written in the Llama layout by any of its model types, or None when it can."""
    wanted = {"arch": "decoder", "norm": "rmsnorm", "norm_placement": "pre", "pos": "rope",
              "final_norm": True, "embed_scale": False, "type_vocab_size": 0, "norm_gain_offset": 0.0,
              "attn_scale": None, "attn_logit_softcap": None, "final_logit_softcap": None, "rope_local_theta": None}
    if problem := fixed_field_problem(cfg, wanted, "Llama/Qwen2"):
        return problem
    if cfg.ffn not in ("swiglu", "moe"):
        return f"ffn={cfg.ffn!r} cannot be exported as Llama/Qwen2 (needs 'swiglu' or 'moe')"
    if cfg.ffn == "moe":
        if cfg.shared_expert_d_ff:
            return "a shared expert (shared_expert_d_ff) has no Mixtral / Qwen3-MoE equivalent"
        if cfg.layer_types is not None:
            return "Mixtral and Qwen3-MoE slide in every layer or none, not per layer (layer_types)"
        if not cfg.qk_norm and (cfg.attn_bias or cfg.attn_out_bias
                                or (cfg.router_order == "softmax_topk" and not cfg.router_norm_topk)):
            return ("a MoE without qk_norm is written as Mixtral, which has no attention biases and renormalises "
                    "the top-k router weights")
        return None
    if cfg.mlp_bias and (cfg.qk_norm or cfg.sliding_window is not None):
        return "mlp_bias with qk_norm or sliding_window: only Llama has MLP biases, and it has neither"
    if cfg.sliding_window is not None and not cfg.qk_norm and (cfg.attn_out_bias or (
            cfg.layer_types is not None and not cfg.attn_bias)):
        return ("sliding_window needs Mistral (no biases, every layer sliding) or Qwen2 (q/k/v biases only); "
                "this model has other biases or a per-layer pattern without q/k/v biases")
    return None


def original_if_unchanged(cfg: ModelConfig, from_hf: Any) -> dict[str, Any] | None:
    """The imported HF config (``extra["hf_config"]``) when ``from_hf`` of it still gives ``cfg``'s fields, so that
    an import/export round trip writes the original back; None otherwise."""
    original = imported_hf_config(cfg)
    if original is None:
        return None
    try:  # every field but extra
        if {**from_hf(original).to_dict(), "extra": None} != {**cfg.to_dict(), "extra": None}:
            return None
    except ConfigError:
        return None
    return dict(original)


def shape_to_hf(cfg: ModelConfig, model_type: str, architecture: str) -> dict[str, Any]:
    """The config.json keys every Llama-layout family spells alike: sizes, RoPE (``rope_parameters``: theta and
    scaling), norm epsilon, tying, and the special-token ids (those of an imported model are kept)."""
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    max_positions = cfg.max_seq_len
    if cfg.rope_scaling:
        rope_parameters = {k: v for k, v in cfg.rope_scaling.items() if k != "type"}
        rope_parameters["rope_type"] = cfg.rope_type
        rope_parameters["rope_theta"] = cfg.rope_theta
        if cfg.rope_type == "dynamic":
            # transformers scales dynamic NTK from max_position_embeddings: make that the original length
            max_positions = int(rope_parameters.pop("original_max_position_embeddings", None) or cfg.max_seq_len)
    hf: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": cfg.attn_dropout,
    }
    if (original := imported_hf_config(cfg)) is not None:
        for key in ("bos_token_id", "eos_token_id"):
            if key in original:
                hf[key] = original[key]
    if cfg.pad_token_id is not None:
        hf["pad_token_id"] = cfg.pad_token_id
    return hf


def moe_from_hf(hf: Mapping[str, Any], kind: LayoutType) -> dict[str, Any]:
    """The FFN fields: dense SwiGLU, or routed experts (Mixtral: softmax, top k, renormalised; Qwen3-MoE:
    renormalised only with norm_topk_prob)."""
    if kind.moe is None:
        return {"ffn": "swiglu"}
    if kind.check_hf is not None:
        kind.check_hf(hf)
    n_experts = hf.get("num_local_experts") or hf.get("num_experts")
    if not n_experts:
        raise ConfigError("config.json lacks num_local_experts / num_experts")
    return {"ffn": "moe", "n_experts": int(n_experts), "experts_per_token": int(hf.get("num_experts_per_tok", 2)),
            "router_order": "softmax_topk",
            "router_norm_topk": kind.router_always_renormalises or bool(hf.get("norm_topk_prob", False)),
            "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001))}


# config.json keys some types write, each a small function of the config (LayoutType.hf_keys)
def attention_bias_key(cfg: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": cfg.attn_bias or cfg.attn_out_bias}


def window_keys(cfg: ModelConfig) -> dict[str, Any]:
    return {"sliding_window": cfg.sliding_window, "use_sliding_window": cfg.sliding_window is not None}


def expert_keys(cfg: ModelConfig) -> dict[str, Any]:
    return {"num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
            "router_aux_loss_coef": cfg.router_aux_loss_coef}


def per_layer_window_keys(cfg: ModelConfig) -> dict[str, Any]:
    types = [("sliding_attention" if cfg.layer_window(i) else "full_attention") for i in range(cfg.n_layer)]
    return {"layer_types": types,
            "max_window_layers": types.index("sliding_attention") if "sliding_attention" in types else cfg.n_layer}


class Layout:
    """The Llama layout restricted to a family's model types (in export-preference order)."""

    def __init__(self, name: str, types: tuple[LayoutType, ...], unclaimed: str) -> None:
        self.name, self.types, self.unclaimed = name, {t.model_type: t for t in types}, unclaimed

    def config_from_hf(self, hf: Mapping[str, Any]) -> ModelConfig:
        """A tinyformer ModelConfig from a Hugging Face ``config.json`` dict of one of the layout's types.

        Raises ConfigError naming the option that tinyformer cannot represent exactly."""
        model_type = hf.get("model_type", "llama")
        kind = self.types.get(model_type)
        arch = (hf.get("architectures") or [kind.architecture if kind else "?"])[0]
        if kind is None:
            raise ConfigError(f"model_type {model_type!r} ({arch}) is not supported by the Llama adapter")
        if not str(arch).endswith("ForCausalLM") and arch != "LlamaModel":
            raise ConfigError(f"architecture {arch!r} is not supported (only *ForCausalLM language models)")
        if hf.get("quantization_config"):
            method = hf["quantization_config"].get("quant_method", "?")
            raise ConfigError(f"quantization_config (quant_method {method!r}): pre-quantized checkpoints are not "
                              "supported; convert the unquantized model")
        act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (Llama/Mistral/Qwen2 use 'silu')")
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               kind.d_ff_key, "max_position_embeddings") if k not in hf]
        if missing:
            raise ConfigError(f"config.json lacks {', '.join(missing)}")
        theta, rope_scaling = rope_from_hf(hf)
        window, layer_types = window_from_hf(hf, kind)
        n_head = hf["num_attention_heads"]
        if kind.biases == "config":
            qkv_bias = out_bias = bool(hf.get("attention_bias", False))
            mlp_bias = bool(hf.get("mlp_bias", False))
        else:
            qkv_bias, out_bias, mlp_bias = kind.biases == "qkv", False, False
        return ModelConfig(
            arch="decoder",
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layer=hf["num_hidden_layers"],
            n_head=n_head,
            n_kv_head=hf.get("num_key_value_heads") or n_head,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_head,
            d_ff=hf[kind.d_ff_key],
            max_seq_len=int(hf["max_position_embeddings"]),
            norm="rmsnorm",
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            pos="rope",
            rope_theta=theta,
            rope_scaling=rope_scaling,
            attn_bias=qkv_bias,
            attn_out_bias=out_bias,
            mlp_bias=mlp_bias,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attn_dropout=float(hf.get("attention_dropout", 0.0) or 0.0),
            qk_norm=kind.qk_norm,
            **moe_from_hf(hf, kind),
            sliding_window=window,
            layer_types=layer_types,
            pad_token_id=hf_pad_token_id(hf),
            extra={"source": model_type, "hf_config": dict(hf)},
        )

    def written_type(self, cfg: ModelConfig) -> LayoutType | None:
        """The first of the layout's types that writes ``cfg`` (None: none of them does)."""
        if layout_problem(cfg) is not None:
            return None
        wanted = imported_as(cfg)
        return next((t for t in self.types.values() if t.writes(cfg, wanted)), None)

    def tensor_type(self, cfg: ModelConfig) -> LayoutType:
        """The type whose tensor names ``cfg``'s are: the written one, else the one it was imported from."""
        kind = self.written_type(cfg) or self.types.get(imported_as(cfg) or "")
        if kind is None:
            raise ConfigError(self.export_problem(cfg) or f"no {self.name} model type writes this model")
        return kind

    def export_problem(self, cfg: ModelConfig) -> str | None:
        """Why ``cfg`` cannot be written as one of the layout's types, or None when it can."""
        return layout_problem(cfg) or (None if self.written_type(cfg) else self.unclaimed)

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        """A Hugging Face config dict: the imported original when the model is unchanged, else a fresh one for
        the type ``written_type`` picks."""
        if problem := self.export_problem(cfg):
            raise ConfigError(problem)
        kept = original_if_unchanged(cfg, self.config_from_hf)
        if kept is not None:
            return kept
        kind = self.tensor_type(cfg)
        hf = shape_to_hf(cfg, kind.model_type, kind.architecture)
        hf.update({"hidden_act": "silu", "rope_theta": cfg.rope_theta})
        if cfg.rope_scaling:
            hf["rope_scaling"] = dict(hf["rope_parameters"])  # the transformers 4 spelling, for older readers
        for keys in kind.hf_keys:
            hf.update(keys(cfg))
        return hf

    def hf_to_tinyformer(self, cfg: ModelConfig, hf_sd: Mapping[str, torch.Tensor]
                         ) -> Iterator[tuple[str, torch.Tensor]]:
        kind = self.tensor_type(cfg)
        return hf_to_tinyformer(cfg, hf_sd, fused=kind.fused, moe=kind.moe)

    def tinyformer_to_hf(self, cfg: ModelConfig, sd: Mapping[str, torch.Tensor]
                         ) -> Iterator[tuple[str, torch.Tensor]]:
        kind = self.tensor_type(cfg)
        return tinyformer_to_hf(cfg, sd, fused=kind.fused, moe=kind.moe, all_four_biases=kind.biases == "config")

    def adapter(self) -> Adapter:
        return Adapter(name=self.name, model_types=tuple(self.types), config_from_hf=self.config_from_hf,
                       config_to_hf=self.config_to_hf, hf_to_tinyformer=self.hf_to_tinyformer,
                       tinyformer_to_hf=self.tinyformer_to_hf, export_problem=self.export_problem,
                       ignorable_hf_tensor=ignorable_hf_tensor)

    def gguf_arch_for(self, cfg: ModelConfig) -> str:
        """llama.cpp's architecture of the type ``cfg`` is written as."""
        return self.tensor_type(cfg).gguf_arch


def tensor_names(cfg: ModelConfig, *, fused: bool = False, zero_biases: bool = False
                 ) -> Iterator[tuple[str, list[str] | None]]:
    """(tinyformer name, the HF tensors whose rows it stacks, in order) of every tensor, in checkpoint order; a
    mixture of experts' layer gives (``blocks.i.ffn``, None) where its router and experts go.
    ``fused``: q/k/v and gate/up stored as one matrix each (Phi-3); ``zero_biases``: q/k/v and o biases listed
    when the model has either (the export writes those it lacks as zeros). Sandwich norms (Gemma): the norm before
    the FFN is pre_feedforward_layernorm, and the norms after attention and after the FFN come last."""
    sandwich = cfg.norm_placement == "sandwich"
    ffn_norm = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
    attn_bias = cfg.attn_bias or (zero_biases and cfg.attn_out_bias)
    out_bias = cfg.attn_out_bias or (zero_biases and cfg.attn_bias)
    yield "tok_emb.weight", ["model.embed_tokens.weight"]
    for i in range(cfg.n_layer):
        p, a = f"model.layers.{i}.", f"blocks.{i}."
        yield a + "attn_norm.weight", [p + "input_layernorm.weight"]
        qkv = ["qkv_proj"] if fused else ["q_proj", "k_proj", "v_proj"]
        yield a + "attn.qkv.weight", [f"{p}self_attn.{x}.weight" for x in qkv]
        if attn_bias:
            yield a + "attn.qkv.bias", [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
        yield a + "attn.out.weight", [p + "self_attn.o_proj.weight"]
        if out_bias:
            yield a + "attn.out.bias", [p + "self_attn.o_proj.bias"]
        if cfg.qk_norm:
            yield a + "attn.q_norm.weight", [p + "self_attn.q_norm.weight"]
            yield a + "attn.k_norm.weight", [p + "self_attn.k_norm.weight"]
        yield a + "ffn_norm.weight", [p + ffn_norm + ".weight"]
        if cfg.ffn == "moe":
            yield a + "ffn", None
            continue
        gate_up = ["gate_up_proj"] if fused else ["gate_proj", "up_proj"]
        yield a + "ffn.gate_up.weight", [f"{p}mlp.{x}.weight" for x in gate_up]
        if cfg.mlp_bias:
            yield a + "ffn.gate_up.bias", [p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"]
        yield a + "ffn.down.weight", [p + "mlp.down_proj.weight"]
        if cfg.mlp_bias:
            yield a + "ffn.down.bias", [p + "mlp.down_proj.bias"]
    yield "norm.weight", ["model.norm.weight"]
    if not cfg.tie_embeddings:
        yield "lm_head.weight", ["lm_head.weight"]
    for i in range(cfg.n_layer if sandwich else 0):
        yield f"blocks.{i}.attn_post_norm.weight", [f"model.layers.{i}.post_attention_layernorm.weight"]
        yield f"blocks.{i}.ffn_post_norm.weight", [f"model.layers.{i}.post_feedforward_layernorm.weight"]


def hf_to_tinyformer(cfg: ModelConfig, hf_sd: Mapping[str, torch.Tensor], *, fused: bool = False,
                     moe: MoENames | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (tinyformer name, tensor), one tensor at a time, from a HF state dict (or lazy mapping).
    ``fused`` as in ``tensor_names``; ``moe``: the experts' names.

    Raises ConfigError naming a missing tensor. Callers check that every HF tensor was consumed.
    At most one layer's q/k/v (or gate/up) tensors exist twice at any time (the concatenation)."""

    get = partial(checkpoint_tensor, hf_sd)
    for ours, names in tensor_names(cfg, fused=fused):
        if names is not None:
            yield ours, get(names[0]) if len(names) == 1 else torch.cat([get(n) for n in names])
            continue
        assert moe is not None, "a mixture of experts needs its tensor names"
        router, experts, gate, up, down = moe
        p = ours.replace("blocks.", "model.layers.").removesuffix("ffn")
        yield ours + ".router.weight", get(p + router + ".weight")
        yield ours + ".gate_up", torch.stack([torch.cat([get(f"{p}{experts}.{e}.{gate}.weight"),
                                                         get(f"{p}{experts}.{e}.{up}.weight")])
                                              for e in range(cfg.n_experts)])
        yield ours + ".down", torch.stack([get(f"{p}{experts}.{e}.{down}.weight") for e in range(cfg.n_experts)])


def tinyformer_to_hf(cfg: ModelConfig, sd: Mapping[str, torch.Tensor], *, fused: bool = False,
                     moe: MoENames | None = None, all_four_biases: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) from a tinyformer state dict; the inverse of ``hf_to_tinyformer``.

    With ``all_four_biases`` (Llama's ``attention_bias``: q, k, v and o biases, or none), a model with only some of
    them gets the others as zeros (adding zero changes nothing)."""
    q, kv, f = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.d_ff
    for ours, names in tensor_names(cfg, fused=fused, zero_biases=all_four_biases):
        if names is None:
            assert moe is not None, "a mixture of experts needs its tensor names"
            router, experts, gate_name, up_name, down_name = moe
            p = ours.replace("blocks.", "model.layers.").removesuffix("ffn")
            yield p + router + ".weight", sd[ours + ".router.weight"]
            for e, (expert_gate_up, expert_down) in enumerate(zip(sd[ours + ".gate_up"], sd[ours + ".down"])):
                expert_gate, expert_up = expert_gate_up.split((f, f))
                yield f"{p}{experts}.{e}.{gate_name}.weight", expert_gate.contiguous()
                yield f"{p}{experts}.{e}.{up_name}.weight", expert_up.contiguous()
                yield f"{p}{experts}.{e}.{down_name}.weight", expert_down.contiguous()
            continue
        if ours in sd:
            tensor = sd[ours]
        else:  # a bias the model lacks (zero_biases): one zero per row of its weight
            weight = sd[ours.removesuffix(".bias") + ".weight"]
            tensor = torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device)
        if len(names) == 1:
            yield names[0], tensor
        else:
            for name, part in zip(names, tensor.split((q, kv, kv) if len(names) == 3 else (f, f))):
                yield name, part.contiguous()


def ignorable_hf_tensor(cfg: ModelConfig, name: str) -> bool:
    """Tensors a checkpoint may carry that are not weights of the model: RoPE tables saved by old
    transformers versions, and a copy of the embedding saved as lm_head of a tied model."""
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight")



# ------------------------------------------------------------------ the llama family's types


def _writes_mistral(cfg: ModelConfig, imported: str | None) -> bool:
    """A window without q/k/v biases (Llama has no window), or a model imported from Mistral without biases."""
    if cfg.ffn == "moe" or cfg.qk_norm:
        return False
    if cfg.sliding_window is not None:
        return not cfg.attn_bias
    return imported == "mistral" and not (cfg.attn_bias or cfg.attn_out_bias or cfg.mlp_bias)


def _writes_llama(cfg: ModelConfig, imported: str | None) -> bool:
    """Every dense model without q/k norms or a window. A new model with q/k/v biases is written as Llama with
    ``attention_bias`` (and an all-zero o_proj bias, which changes nothing) rather than as Qwen2, because
    transformers 5 ignores the tokenizer.json pre-tokenizer of any model whose model_type is qwen2."""
    return cfg.ffn != "moe" and not cfg.qk_norm and cfg.sliding_window is None


def _llama_keys(cfg: ModelConfig) -> dict[str, Any]:
    return {**attention_bias_key(cfg), "mlp_bias": cfg.mlp_bias}


MIXTRAL_MOE: MoENames = ("block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2")
MIXTRAL = LayoutType("mixtral", "MixtralForCausalLM", "llama", biases="none", window="always",
                     writes=lambda cfg, imported: cfg.ffn == "moe" and not cfg.qk_norm,
                     hf_keys=(window_keys, expert_keys), moe=MIXTRAL_MOE,
                     router_always_renormalises=True)
MISTRAL = LayoutType("mistral", "MistralForCausalLM", "llama", biases="none", window="always",
                     writes=_writes_mistral, hf_keys=(window_keys,))
LLAMA = LayoutType("llama", "LlamaForCausalLM", "llama", biases="config", window="none", writes=_writes_llama,
                   hf_keys=(_llama_keys,))
LAYOUT = Layout("llama", (MIXTRAL, MISTRAL, LLAMA),
                unclaimed="Llama, Mistral and Mixtral have no q/k norms (qk_norm) and no sliding window with q/k/v "
                          "biases (Qwen2/Qwen3 have)")
ADAPTER = LAYOUT.adapter()
