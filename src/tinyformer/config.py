"""ModelConfig: every architectural choice of a tinyformer model as an explicit, validated field.

A GPT-2, a LLaMA-3 or a BERT is not a code path but a set of values (see ``presets.py``).
The model code reads these fields and never branches on a model's name.

RoPE scaling uses Hugging Face's ``rope_parameters`` vocabulary so that checkpoints agree:
``{"rope_type": "linear" | "dynamic" | "yarn" | "llama3" | "longrope", "factor": ..., ...}``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinyformer.errors import ConfigError

CONFIG_FORMAT_VERSION = 1

ARCHS = ("decoder", "encoder", "encoder_decoder")
NORMS = ("rmsnorm", "layernorm")
NORM_PLACEMENTS = ("pre", "post", "sandwich")
POSITIONS = ("rope", "learned", "sinusoidal", "none")
FFNS = ("swiglu", "geglu_tanh", "gelu", "gelu_tanh", "relu", "moe")
ROUTER_ORDERS = ("softmax_topk", "topk_softmax")
ATTN_IMPLS = ("sdpa", "reference")
LAYER_TYPES = ("full", "sliding")  # per-layer attention span: every earlier key, or the last sliding_window keys

# Allowed keys of `rope_scaling` per type (besides "rope_type"), with HF's names and meaning.
ROPE_SCALING_KEYS: dict[str, dict[str, bool]] = {
    # key -> required?
    "linear": {"factor": True},
    "dynamic": {"factor": True, "original_max_position_embeddings": False},
    "yarn": {"factor": True, "original_max_position_embeddings": False, "attention_factor": False, "beta_fast": False,
             "beta_slow": False, "mscale": False, "mscale_all_dim": False, "truncate": False},
    "llama3": {"factor": True, "low_freq_factor": True, "high_freq_factor": True,
               "original_max_position_embeddings": True},
    # LongRoPE (Phi-3's "su"): per-frequency divisors, short_factor up to the original context, long_factor beyond
    "longrope": {"short_factor": True, "long_factor": True, "original_max_position_embeddings": True, "factor": False,
                 "attention_factor": False},
}


def llama_ffn_hidden(d_model: int, multiplier: float | None, multiple_of: int) -> int:
    """LLaMA's SwiGLU width rule: 2/3 of 4d, times an optional multiplier, rounded up to a multiple.

    hidden = multiple_of * ceil(int(multiplier * int(2 * 4d / 3)) / multiple_of); 4096 -> 11008.
    The 2/3 keeps the three SwiGLU matrices at the parameter count of a 4d two-matrix MLP.
    """
    hidden = int(2 * 4 * d_model / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass
class ModelConfig:
    """All shape and option choices of a model. Validates itself on construction.

    Sizes: ``d_model`` = width, ``n_head`` query heads of ``head_dim`` each (default d_model / n_head),
    ``n_kv_head`` key/value heads (MHA when equal to n_head, GQA when a divisor, MQA when 1).
    ``d_ff`` is the FFN width; when None it follows LLaMA's rule for SwiGLU
    (``ffn_dim_multiplier``, ``ffn_multiple_of``) and 4 * d_model otherwise.
    """

    arch: str = "decoder"
    vocab_size: int = 4096
    d_model: int = 256
    n_layer: int = 4
    n_head: int = 8
    n_kv_head: int | None = None
    head_dim: int | None = None
    d_ff: int | None = None
    ffn_dim_multiplier: float | None = None
    ffn_multiple_of: int = 256
    max_seq_len: int = 256
    # normalisation
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    norm_bias: bool = True  # LayerNorm only: with or without the additive bias beta
    norm_placement: str = "pre"  # "sandwich": a norm before and after each sub-block (Gemma 2/3)
    # RMSNorm gain: y = x / rms(x) * (norm_gain_offset + g); Gemma stores g around 0 and uses offset 1
    norm_gain_offset: float = 0.0
    final_norm: bool = True  # a norm before the head (Pre-Norm stacks need it; Post-Norm ones do not)
    # positions
    pos: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    # RoPE base of the sliding-window layers, unscaled (Gemma 3: 10000 local, rope_theta 1e6 global); None: theirs
    # is rope_theta and rope_scaling, like every other layer
    rope_local_theta: float | None = None
    # feed-forward
    ffn: str = "swiglu"
    # mixture of experts (ffn="moe", components/moe.py): n_experts SwiGLU experts of width d_ff, experts_per_token
    # = k of them per token, MoE(x) = sum_k g_k Expert_k(x) (+ a shared SwiGLU expert of width shared_expert_d_ff).
    # router_order: "softmax_topk" (g = top-k of softmax(r), divided by their sum if router_norm_topk) or
    # "topk_softmax" (g = softmax of the top-k logits). Training adds router_aux_loss_coef * E sum_e f_e P_e
    # (Switch load balancing) and router_z_loss_coef * mean (logsumexp r)^2 (ST-MoE z-loss).
    n_experts: int = 0
    experts_per_token: int = 2
    shared_expert_d_ff: int = 0
    router_order: str = "softmax_topk"
    router_norm_topk: bool = True
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.0
    # biases
    attn_bias: bool = False  # q, k, v projections
    attn_out_bias: bool = False  # output projection
    qk_norm: bool = False  # per-head norm (the config's norm, over head_dim) of q and k before RoPE (Qwen3)
    attn_scale: float | None = None  # the score scale s in softmax(s q.k + M); None: 1/sqrt(head_dim)
    attn_logit_softcap: float | None = None  # scores -> c tanh(scores / c) before the mask (Gemma 2)
    final_logit_softcap: float | None = None  # logits -> c tanh(logits / c) (Gemma 2)
    mlp_bias: bool = False
    # embeddings and head
    tie_embeddings: bool = True
    embed_scale: bool = False  # multiply token embeddings by sqrt(d_model) (the 2017 Transformer)
    type_vocab_size: int = 0  # token-type (segment) embeddings, BERT
    embed_norm: bool = False  # a norm over the summed embeddings (BERT); encoder and encoder_decoder only
    pooler: bool = False  # encoder: dense + tanh over the first token ([CLS]), BERT's pooler
    mlm_head: bool = False  # encoder: masked-LM head (dense, GELU, norm, decoder tied to the token table, bias)
    share_src_tgt_embeddings: bool = True  # encoder_decoder: source and target read one token table
    # regularisation
    dropout: float = 0.0  # residual branches
    attn_dropout: float = 0.0
    embd_dropout: float = 0.0
    # computation
    attn_impl: str = "sdpa"
    init_std: float = 0.02
    # sliding-window attention (Mistral, Qwen2/3 use_sliding_window, Gemma's local layers): query i sees keys
    # j with i - sliding_window < j <= i. ``layer_types[l]`` is "sliding" or "full" per layer; None means
    # every layer slides when sliding_window is set. A sliding layer's KV cache keeps only W positions.
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    # encoder-decoder: layers of the encoder stack (n_layer is the decoder's)
    n_encoder_layer: int | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes (e.g. where an import came from)

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.head_dim is None and isinstance(self.d_model, int) and isinstance(self.n_head, int):
            if self.n_head > 0 and self.d_model % self.n_head != 0:
                raise ConfigError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head}), "
                                  "or set head_dim explicitly")
            self.head_dim = self.d_model // self.n_head if self.n_head > 0 else 0
        if self.d_ff is None and isinstance(self.d_model, int):
            if self.ffn in ("swiglu", "geglu_tanh", "moe"):  # gated FFNs (MoE experts are SwiGLU)
                self.d_ff = llama_ffn_hidden(self.d_model, self.ffn_dim_multiplier, self.ffn_multiple_of)
            else:
                self.d_ff = 4 * self.d_model
        if self.arch == "encoder_decoder" and self.n_encoder_layer is None:
            self.n_encoder_layer = self.n_layer
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ConfigError (a ValueError) naming the first invalid field."""
        choices = {"arch": ARCHS, "norm": NORMS, "norm_placement": NORM_PLACEMENTS, "pos": POSITIONS, "ffn": FFNS,
                   "attn_impl": ATTN_IMPLS, "router_order": ROUTER_ORDERS}
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"{name}={value!r} is not one of {', '.join(allowed)}")
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "head_dim", "d_ff", "max_seq_len",
                     "ffn_multiple_of"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.n_head % self.n_kv_head != 0:
            raise ConfigError(f"n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head}): "
                              "each key/value head serves a whole group of query heads")
        if self.pos == "rope" and self.head_dim % 2 != 0:
            raise ConfigError(f"head_dim ({self.head_dim}) must be even for pos='rope'")
        if self.pos == "sinusoidal" and self.d_model % 2 != 0:
            raise ConfigError(f"d_model ({self.d_model}) must be even for pos='sinusoidal'")
        if not (isinstance(self.norm_eps, (int, float)) and self.norm_eps > 0 and math.isfinite(self.norm_eps)):
            raise ConfigError(f"norm_eps must be a positive number, got {self.norm_eps!r}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 1):
            raise ConfigError(f"rope_theta must be a number > 1, got {self.rope_theta!r}")
        if not (isinstance(self.init_std, (int, float)) and self.init_std > 0):
            raise ConfigError(f"init_std must be positive, got {self.init_std!r}")
        for name in ("dropout", "attn_dropout", "embd_dropout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
                raise ConfigError(f"{name} must be in [0, 1), got {value!r}")
        if self.ffn_dim_multiplier is not None and not self.ffn_dim_multiplier > 0:
            raise ConfigError(f"ffn_dim_multiplier must be positive, got {self.ffn_dim_multiplier!r}")
        if isinstance(self.type_vocab_size, bool) or not isinstance(self.type_vocab_size, int) \
                or self.type_vocab_size < 0:
            raise ConfigError(f"type_vocab_size must be a non-negative integer, got {self.type_vocab_size!r}")
        for name in ("embed_norm", "pooler", "mlm_head", "share_src_tgt_embeddings", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        # options that only one kind of stack implements
        if self.type_vocab_size and self.arch != "encoder":
            raise ConfigError(f"type_vocab_size (token-type embeddings) applies to arch 'encoder' only, "
                              f"not {self.arch!r}; set it to 0")
        if self.embed_norm and self.arch == "decoder":
            raise ConfigError("embed_norm is implemented for arch 'encoder' and 'encoder_decoder', not 'decoder'")
        for name in ("pooler", "mlm_head"):
            if getattr(self, name) and self.arch != "encoder":
                raise ConfigError(f"{name} applies to arch 'encoder' only, not {self.arch!r}")
        if not self.share_src_tgt_embeddings and self.arch != "encoder_decoder":
            raise ConfigError("share_src_tgt_embeddings=false applies to arch 'encoder_decoder' only")
        if self.arch == "encoder_decoder":
            n = self.n_encoder_layer
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ConfigError(f"n_encoder_layer must be a positive integer, got {n!r}")
        self._validate_sliding_window()
        self._validate_moe()
        for name in ("attn_scale", "attn_logit_softcap", "final_logit_softcap", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number or null, got {value!r}")
        if not (isinstance(self.norm_gain_offset, (int, float)) and math.isfinite(self.norm_gain_offset)):
            raise ConfigError(f"norm_gain_offset must be a number, got {self.norm_gain_offset!r}")
        if self.norm_gain_offset and self.norm != "rmsnorm":
            raise ConfigError("norm_gain_offset applies to norm 'rmsnorm' only")
        if self.rope_local_theta is not None and (self.pos != "rope" or self.sliding_window is None):
            raise ConfigError("rope_local_theta needs pos='rope' and sliding_window (it is the sliding layers' base)")
        if self.norm_placement == "sandwich" and self.arch != "decoder":
            raise ConfigError(f"norm_placement 'sandwich' is implemented for arch 'decoder' only, not {self.arch!r}")
        if self.pad_token_id is not None and not (0 <= self.pad_token_id < self.vocab_size):
            raise ConfigError(f"pad_token_id ({self.pad_token_id}) must be in [0, vocab_size)")
        self._validate_rope_scaling()

    def _validate_moe(self) -> None:
        for name in ("n_experts", "experts_per_token", "shared_expert_d_ff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a non-negative number, got {value!r}")
        if not isinstance(self.router_norm_topk, bool):
            raise ConfigError(f"router_norm_topk must be true or false, got {self.router_norm_topk!r}")
        if self.ffn != "moe":
            if self.n_experts or self.shared_expert_d_ff:
                raise ConfigError("n_experts / shared_expert_d_ff are set but ffn is not 'moe'")
            return
        if self.arch != "decoder":
            raise ConfigError(f"ffn='moe' is implemented for arch 'decoder' only, not {self.arch!r}")
        if self.mlp_bias:
            raise ConfigError("mlp_bias is not implemented for ffn='moe' (experts have no biases)")
        if self.n_experts < 1:
            raise ConfigError("ffn='moe' needs n_experts >= 1")
        if not 1 <= self.experts_per_token <= self.n_experts:
            raise ConfigError(f"experts_per_token must be in [1, n_experts={self.n_experts}], "
                              f"got {self.experts_per_token}")

    def _validate_sliding_window(self) -> None:
        w, types = self.sliding_window, self.layer_types
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
            raise ConfigError(f"sliding_window must be a positive integer or null, got {w!r}")
        if w is not None and self.arch != "decoder":
            raise ConfigError(f"sliding_window is implemented for arch 'decoder' only, not {self.arch!r}")
        if types is None:
            return
        if not isinstance(types, list) or len(types) != self.n_layer:
            raise ConfigError(f"layer_types must be a list of {self.n_layer} entries (one per layer), got {types!r}")
        bad = [t for t in types if t not in LAYER_TYPES]
        if bad:
            raise ConfigError(f"layer_types entry {bad[0]!r} is not one of {', '.join(LAYER_TYPES)}")
        if "sliding" in types and w is None:
            raise ConfigError("layer_types has 'sliding' layers but sliding_window is not set")

    def _validate_rope_scaling(self) -> None:
        rs = self.rope_scaling
        if rs is None:
            return
        if not isinstance(rs, dict):
            raise ConfigError(f"rope_scaling must be a mapping or null, got {type(rs).__name__}")
        if self.pos != "rope":
            raise ConfigError(f"rope_scaling is set but pos={self.pos!r}; it only applies to pos='rope'")
        kind = rs.get("rope_type", rs.get("type"))
        if kind in (None, "default") and set(rs) <= {"rope_type", "type"}:
            return
        if kind not in ROPE_SCALING_KEYS:
            raise ConfigError(f"rope_scaling.rope_type={kind!r} is not one of {', '.join(ROPE_SCALING_KEYS)}")
        allowed = ROPE_SCALING_KEYS[kind]
        for key in rs:
            if key not in allowed and key not in ("rope_type", "type"):
                raise ConfigError(f"rope_scaling.{key} is not a parameter of rope_type {kind!r} "
                                  f"(allowed: {', '.join(allowed)})")
        for key, required in allowed.items():
            if required and rs.get(key) is None:
                raise ConfigError(f"rope_scaling.{key} is required for rope_type {kind!r}")
        factor = rs.get("factor")
        if not (isinstance(factor, (int, float)) and factor > 0) and (factor is not None or allowed["factor"]):
            raise ConfigError(f"rope_scaling.factor must be a positive number, got {factor!r}")
        if kind == "longrope":
            for key in ("short_factor", "long_factor"):
                value = rs[key]
                if not (isinstance(value, list) and len(value) == self.head_dim // 2
                        and all(isinstance(v, (int, float)) and v > 0 for v in value)):
                    raise ConfigError(f"rope_scaling.{key} must be a list of head_dim/2 = {self.head_dim // 2} "
                                      "positive numbers")
        if kind == "llama3":
            low, high = rs["low_freq_factor"], rs["high_freq_factor"]
            if not (0 < low < high):
                raise ConfigError(f"rope_scaling needs 0 < low_freq_factor < high_freq_factor, got {low!r}, {high!r}")
        omp = rs.get("original_max_position_embeddings")
        if omp is not None and (not isinstance(omp, int) or omp <= 0):
            raise ConfigError(f"rope_scaling.original_max_position_embeddings must be a positive int, got {omp!r}")

    # ------------------------------------------------------------------ derived values
    def layer_window(self, layer: int) -> int | None:
        """The attention window W of layer ``layer`` (keys j with i - W < j <= i), or None for full causal."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding":
            return None
        return self.sliding_window

    @property
    def rope_type(self) -> str:
        """The RoPE scaling type: 'default' when there is no scaling."""
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["format_version"] = CONFIG_FORMAT_VERSION
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        version = data.pop("format_version", CONFIG_FORMAT_VERSION)
        if version != CONFIG_FORMAT_VERSION:
            raise ConfigError(f"config format_version {version} is not supported (expected {CONFIG_FORMAT_VERSION})")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError("config JSON must be an object")
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        from tinyformer.utils.io import atomic_write_text

        atomic_write_text(Path(path), self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        from tinyformer.utils.io import read_utf8

        try:
            return cls.from_json(read_utf8(p, ConfigError, "model config"))
        except ConfigError as exc:
            message = str(exc)
            raise ConfigError(message if str(p) in message else f"{p}: {message}") from None

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        d = self.to_dict()
        d.pop("format_version")
        # derived defaults must be recomputed when their inputs change
        if ("d_model" in changes or "n_head" in changes) and "head_dim" not in changes:
            d["head_dim"] = None
        if ({"d_model", "ffn", "ffn_dim_multiplier", "ffn_multiple_of"} & set(changes)) and "d_ff" not in changes:
            d["d_ff"] = None
        if "n_head" in changes and "n_kv_head" not in changes and d["n_kv_head"] == self.n_head:
            d["n_kv_head"] = None
        d.update(changes)
        return ModelConfig.from_dict(d)
