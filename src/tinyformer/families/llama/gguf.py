"""The llama.cpp (GGUF) side of the Llama layout: the tensor names every GGUF architecture here shares, the metadata
keys they spell alike, and the llama family's architecture ``llama`` (Llama 1/2/3, Mistral; with ``expert_count`` a
Mixtral).

Names (GGUF -> Hugging Face, layer i):
  token_embd.weight, output_norm.weight, output.weight     model.embed_tokens, model.norm, lm_head
  blk.i.attn_norm / attn_{q,k,v,output}                    model.layers.i.input_layernorm / self_attn.{q,k,v,o}_proj
  blk.i.attn_{q,k}_norm                                    model.layers.i.self_attn.{q,k}_norm
  blk.i.ffn_norm / ffn_{gate,up,down}                      model.layers.i.post_attention_layernorm / mlp.*_proj
  blk.i.ffn_gate_inp                                       the router of a mixture of experts
  blk.i.ffn_{gate,up,down}_exps (E, rows, cols)            the experts stacked (older files: ffn_{gate,up,down}.e)

RoPE. llama.cpp rotates adjacent pairs (2i, 2i+1) for the ``llama`` architecture, tinyformer and Hugging Face the
half-split pairs (i, i + d_head/2); so llama.cpp's converter permutes each head's rows of W_q and W_k (and their
biases), ``gguf = hf.reshape(n_head, 2, d_head / 2, d_in).swapaxes(1, 2).reshape(rows, d_in)``. The conversion stays
at the file boundary (``rope_interleaved=True`` below; ``interop/gguf.py`` undoes it on read,
``interop/gguf_export.py`` applies it on write); every other architecture here rotates half-split in llama.cpp too.

Metadata. ``<arch>.context_length``, ``embedding_length``, ``block_count``, ``feed_forward_length``,
``attention.head_count[_kv]``, ``attention.key_length``, ``attention.layer_norm_rms_epsilon``, ``rope.freq_base``,
``rope.scaling.*`` (linear, yarn) become the config.json keys of the Llama layout; Llama 3.1 RoPE scaling is stored as
a ``rope_freqs`` tensor of per-frequency divisors, turned back into ``rope_scaling = {"rope_type": "llama3", ...}``
and checked to reproduce the tensor. Mixtures of experts: ``expert_count`` / ``expert_used_count`` give n_experts and
k; a ``llama`` file with experts is a Mixtral (softmax, top k, renormalised). Shared experts and other gating
functions are refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy is needed only when a GGUF file is read: presets import this module
    import numpy as np

from tinyformer.errors import ConfigError
from tinyformer.families.family import GGUFArch
from tinyformer.families.llama.hf import LLAMA, MIXTRAL, MIXTRAL_MOE, MoENames

TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}
BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
EXPORT_TOP = {v: k for k, v in TOP.items()}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_EXPERTS_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")  # (E, rows, cols), all experts
_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")  # one expert (older files)


def hf_name(gguf_name: str, arch: GGUFArch, moe: MoENames | None = None) -> str:
    """HF name of a GGUF tensor (unknown names are returned unchanged, to be reported as unknown).

    ``moe`` (the HF names of a mixture of experts, when the file has experts) names the router and per-expert
    tensors; a stacked ``ffn_*_exps`` tensor has no single HF name (``expert_names`` gives one per expert)."""
    if gguf_name in TOP:
        return TOP[gguf_name]
    m = _EXPERT_RE.fullmatch(gguf_name)
    if m and moe:
        return _expert_name(moe, m.group(1), int(m.group(3)), m.group(2))
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and moe and m.group(2) == "ffn_gate_inp":
        return f"model.layers.{m.group(1)}.{moe[0]}.{m.group(3)}"
    if m and m.group(2) in arch.block_names:
        return f"model.layers.{m.group(1)}.{arch.block_names[m.group(2)]}.{m.group(3)}"
    return gguf_name


def expert_names(gguf_name: str, n_experts: int, moe: MoENames | None) -> list[str]:
    """The HF names of the experts stacked in ``blk.i.ffn_{gate,up,down}_exps.weight``, in stacking order."""
    m = _EXPERTS_RE.fullmatch(gguf_name)
    if m is None or moe is None:
        return []
    return [_expert_name(moe, m.group(1), e, m.group(2)) for e in range(n_experts)]


def _expert_name(moe: MoENames, layer: str, expert: int, which: str) -> str:
    """HF name of expert ``expert``'s gate, up or down matrix (``which``) in layer ``layer``."""
    _, experts, gate, up, down = moe
    return f"model.layers.{layer}.{experts}.{expert}.{dict(gate=gate, up=up, down=down)[which]}.weight"


def gguf_name(name: str, arch: GGUFArch) -> str:
    """llama.cpp's name of a Hugging Face tensor; the inverse of ``hf_name``."""
    if name in EXPORT_TOP:
        return EXPORT_TOP[name]
    rest = name.removeprefix("model.layers.")
    layer, rest = rest.split(".", 1)
    module, kind = rest.rsplit(".", 1)
    names = {hf: ours for ours, hf in arch.block_names.items()}
    if arch.moe is not None:
        names[arch.moe[0]] = "ffn_gate_inp"
    return f"blk.{layer}.{names[module]}.{kind}"


def f32(value: float) -> float:
    """GGUF stores float32: 1e-6 arrives as 9.99999997e-07; the shortest decimal with the same float32."""
    import numpy as np

    return float(str(np.float32(value)))


def llama3_scaling(factors: np.ndarray, head_dim: int, theta: float, path: Any) -> dict[str, Any]:
    """The llama3 ``rope_scaling`` reproducing llama.cpp's ``rope_freqs`` divisors.

    llama.cpp writes, per frequency theta_i with wavelength w_i = 2 pi / theta_i: 1 when w_i < L0/high,
    ``factor`` when w_i > L0/low, else 1 / ((1 - s)/factor + s) with s = (L0/w_i - low)/(high - low).
    Only L0/low and L0/high matter, so L0 = 8192 (Llama 3.1's) is kept and low/high are fitted to the
    in-between frequencies when Meta's 1 and 4 do not reproduce them; the result is checked."""
    import numpy as np

    from tinyformer.components.rope import default_inv_freq

    factors = np.asarray(factors, dtype=np.float64)
    wavelen = (2 * math.pi / default_inv_freq(head_dim, theta).double()).numpy()
    factor = float(factors.max())
    l0 = 8192
    candidates = [(1.0, 4.0)]
    medium = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    if medium.sum() >= 2 and factor > 1:
        s = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(l0 / wavelen[medium], s, 1)
        low = -intercept / slope
        candidates.append((float(low), float(low + 1 / slope)))

    def divisors(low: float, high: float) -> np.ndarray:
        smooth = (l0 / wavelen - low) / (high - low)
        mid = 1 / ((1 - smooth) / factor + smooth)
        return np.where(wavelen < l0 / high, 1.0, np.where(wavelen > l0 / low, factor, mid))

    for low, high in candidates:
        if 0 < low < high and np.allclose(divisors(low, high), factors, rtol=1e-4, atol=1e-5):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": round(low, 6),
                    "high_freq_factor": round(high, 6), "original_max_position_embeddings": l0}
    raise ConfigError(f"{path}: the rope_freqs tensor matches no llama3 RoPE scaling; other per-frequency "
                      "scalings are not supported")


def layout_config(g: Any, arch: GGUFArch, kind: Any, type_keys: Callable[[Any, int | None], Mapping[str, Any]]
                  ) -> dict[str, Any]:
    """The HF config.json dict of the metadata every Llama-layout architecture spells alike: widths, heads, context,
    norm epsilon, tying, token ids and RoPE (with its scaling; LongRoPE factor tensors by ``arch.longrope``, refused
    without). ``kind`` is the Hugging Face type written (its ``model_type`` and ``architecture``); ``type_keys(g,
    window)`` adds that type's keys (biases, window flags), in config.json order."""
    key = g.key
    n_head = key("attention.head_count", required=True)
    n_kv = key("attention.head_count_kv", n_head)
    if isinstance(n_kv, list):
        if len(set(n_kv)) != 1:
            raise ConfigError(f"{g.path}: a per-layer key/value head count ({sorted(set(n_kv))}) is not supported")
        n_kv = n_kv[0]
    hidden = key("embedding_length", required=True)
    head_dim = key("attention.key_length") or hidden // n_head
    if key("attention.value_length", head_dim) != head_dim:
        raise ConfigError(f"{g.path}: attention.value_length != key_length is not supported")
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ConfigError(f"{g.path}: rope.dimension_count={key('rope.dimension_count')} < head dim {head_dim} "
                          "(partial rotary embedding) is not supported")
    window = key("attention.sliding_window") or None  # Phi-3's converter writes 0 for none
    if window and not arch.sliding_window:
        raise ConfigError(f"{g.path}: attention.sliding_window is not supported for GGUF architecture {arch.name!r}")
    tokens = g.reader.fields.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None and "token_embd.weight" in g.tensors:
        vocab = int(g.tensors["token_embd.weight"].shape[-1])
    ctx = key("context_length", required=True)
    theta = f32(key("rope.freq_base", 10000.0))
    hf: dict[str, Any] = {
        "architectures": [kind.architecture],
        "model_type": kind.model_type,
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "intermediate_size": int(key("feed_forward_length") or key("expert_feed_forward_length", required=True)),
        "num_hidden_layers": int(key("block_count", required=True)),
        "num_attention_heads": int(n_head),
        "num_key_value_heads": int(n_kv),
        "head_dim": int(head_dim),
        "max_position_embeddings": int(ctx),
        "rms_norm_eps": f32(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
    }
    hf.update(type_keys(g, window))
    for name, k in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                    ("pad_token_id", "padding_token_id")):
        value = g.get(f"tokenizer.ggml.{k}")
        if value is not None:
            hf[name] = int(value)
    scaling = key("rope.scaling.type")
    if scaling in (None, "none"):
        if "rope_freqs.weight" in g.tensors:
            factors = g.read("rope_freqs.weight").reshape(-1)
            hf["rope_parameters"] = {**llama3_scaling(factors, head_dim, theta, g.path), "rope_theta": theta}
    elif scaling == "linear":
        hf["rope_parameters"] = {"rope_type": "linear", "factor": f32(key("rope.scaling.factor", required=True)),
                                 "rope_theta": theta}
    elif scaling == "yarn":
        for unsupported in ("rope.scaling.yarn_log_multiplier", "rope.scaling.attn_factor",
                            "rope.scaling.yarn_attn_factor"):
            value = key(unsupported)
            if value not in (None, 0.0, 1.0) or (unsupported.endswith("log_multiplier") and value):
                raise ConfigError(f"{g.path}: {arch.name}.{unsupported}={value} is not supported")
        params: dict[str, Any] = {"rope_type": "yarn", "factor": f32(key("rope.scaling.factor", required=True)),
                                  "original_max_position_embeddings": int(key("rope.scaling.original_context_length",
                                                                              ctx)),
                                  "rope_theta": theta}
        for gguf_key, hf_key in (("rope.scaling.yarn_beta_fast", "beta_fast"),
                                 ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if key(gguf_key) is not None:
                params[hf_key] = f32(key(gguf_key))
        hf["rope_parameters"] = params
    else:
        raise ConfigError(f"{g.path}: RoPE scaling type {scaling!r} is not supported (supported: none, linear, yarn, "
                          "and llama3 as a rope_freqs tensor)")
    if {"rope_factors_long.weight", "rope_factors_short.weight"} & set(g.tensors):
        if arch.longrope is None or scaling not in (None, "none"):
            raise ConfigError(f"{g.path}: rope_factors_long/short (LongRoPE) are supported in 'phi3' files without "
                              "another RoPE scaling type")
        hf["rope_parameters"] = arch.longrope(g, theta, int(ctx), head_dim)
    return hf


def experts_from_gguf(g: Any) -> tuple[int, bool, int]:
    """(experts per token, renormalised, expert width) of a mixture: llama.cpp's llama (Mixtral) and qwen3moe route
    by softmax, then top k."""
    key = g.key
    func = key("expert_gating_func")
    if func not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ConfigError(f"{g.path}: expert_gating_func={func} is not supported (only 1, softmax)")
    shared = [n for n in g.tensors if "_shexp" in n]
    if key("expert_shared_count") or shared:
        raise ConfigError(f"{g.path}: shared experts ({shared[0] if shared else 'expert_shared_count'}) are not "
                          "supported")
    if key("expert_weights_scale") not in (None, 1.0):
        raise ConfigError(f"{g.path}: expert_weights_scale={key('expert_weights_scale')} is not supported")
    used = int(key("expert_used_count", required=True))
    renormalise = bool(key("expert_weights_norm", True))  # llama.cpp renormalises the top-k weights of both
    width = int(key("expert_feed_forward_length") or key("feed_forward_length", required=True))
    return used, renormalise, width


def has_attention_bias(g: Any) -> dict[str, Any]:
    return {"attention_bias": "blk.0.attn_q.bias" in g.tensors}


def _llama_keys(g: Any, window: int | None) -> dict[str, Any]:
    return {**has_attention_bias(g), "mlp_bias": "blk.0.ffn_down.bias" in g.tensors}


def window_key(g: Any, window: int | None) -> dict[str, Any]:
    """``sliding_window`` of every layer (Mixtral, Phi-3)."""
    return {"sliding_window": int(window) if window else None}


def config_from_gguf(g: Any) -> dict[str, Any]:
    """A ``llama`` file's config.json: Llama, or Mixtral when it has experts."""
    n_experts = int(g.key("expert_count", 0) or 0)
    hf = layout_config(g, ARCH, MIXTRAL if n_experts else LLAMA, window_key if n_experts else _llama_keys)
    if n_experts:
        used, renormalise, width = experts_from_gguf(g)
        if not renormalise:
            raise ConfigError(f"{g.path}: expert_weights_norm=false is not supported in a 'llama' (Mixtral) file")
        hf.update({"num_local_experts": n_experts, "num_experts_per_tok": used, "intermediate_size": width})
    return hf


ARCH = GGUFArch("llama", config_from_gguf, BLOCK, moe=MIXTRAL_MOE, rope_interleaved=True)
