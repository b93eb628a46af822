"""The gemma family's llama.cpp architectures ``gemma2`` and ``gemma3``.

Files store every norm gain as 1 + g (ggml's RMSNorm multiplies by the stored gain), which the reader turns back
into Gemma's g and the writer forward (``norm_plus_one``); a layer's four norms are ``attn_norm``,
``post_attention_norm``, ``ffn_norm`` and ``post_ffw_norm``. llama.cpp fixes Gemma 3's layer pattern (every 6th layer
global), the local layers' RoPE base (10000) and the score scale (head_dim^-1/2), so the import does too; ``gemma2``
files are stored alike, with the soft-caps as ``attn_logit_softcapping`` / ``final_logit_softcapping`` and every 2nd
layer global. Where the file states them, ``attention.scale`` (the score scale s, read as query_pre_attn_scalar =
s^-2), ``attention.sliding_window_pattern`` (every n-th layer global, or one flag per layer) and
``rope.freq_base_swa`` (the local layers' base) override those fixed values. Written files must match llama.cpp's
fixed choices (``gemma_problem``): no biases, the fixed layer pattern, scores scaled by head_dim^-1/2, Gemma 2 tied
and soft-capped (llama.cpp caps at 50 / 30 otherwise), Gemma 3 uncapped with its local layers at RoPE base 10000.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError
from tinyformer.families.family import GGUFArch
from tinyformer.families.gemma.hf import TYPES
from tinyformer.families.llama.gguf import BLOCK, f32, layout_config

GEMMA3_LOCAL_THETA = 10000.0  # llama.cpp's fixed RoPE base of Gemma 3's sliding-window layers
GGUF_TYPES = {t.gguf_arch: t for t in TYPES.values()}  # GGUF architecture -> its HF type (global_every: the pattern)
# Gemma's four norms per layer
GEMMA_BLOCK = {**BLOCK, "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"}


def gemma_from_gguf(g: Any, every: int, hf: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's Gemma 2 / 3: GELU-tanh; scores scaled by attention.scale, else head_dim^-1/2; every n-th layer
    global (2 / 6, or attention.sliding_window_pattern); Gemma 2's soft-caps; Gemma 3's local RoPE base
    (rope.freq_base_swa, else 10000)."""
    hf.pop("hidden_act")  # Gemma's is hidden_activation
    scale = g.key("attention.scale")
    scalar: float | int = hf["head_dim"]
    if scale:
        scalar = 1.0 / f32(scale) ** 2
        scalar = round(scalar) if abs(scalar - round(scalar)) < 1e-4 * scalar else scalar
    out: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
                           "sliding_window": int(g.key("attention.sliding_window") or 0) or None}
    pattern = g.key("attention.sliding_window_pattern", every)
    if isinstance(pattern, list):  # one flag per layer: true = sliding
        if len(pattern) != hf["num_hidden_layers"]:
            raise ConfigError(f"{g.path}: attention.sliding_window_pattern has {len(pattern)} entries for "
                              f"{hf['num_hidden_layers']} layers")
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        out["sliding_window_pattern"] = int(pattern)
    return out


def _gemma2_keys(g: Any, hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's soft-caps."""
    return {name: f32(g.key(name)) if g.key(name) else None for name in ("attn_logit_softcapping",
                                                                         "final_logit_softcapping")}


def _gemma3_keys(g: Any, hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's RoPE per layer type: the local layers' base is rope.freq_base_swa, else llama.cpp's 10000."""
    local = {"rope_type": "default", "rope_theta": f32(g.key("rope.freq_base_swa", GEMMA3_LOCAL_THETA))}
    return {"rope_parameters": {"full_attention": hf["rope_parameters"], "sliding_attention": local}}


def _gemma_config(arch: str, own_keys: Callable[[Any, dict[str, Any]], dict[str, Any]], g: Any) -> dict[str, Any]:
    hf = layout_config(g, ARCHS[arch], GGUF_TYPES[arch], lambda g, window: {})
    hf.update(gemma_from_gguf(g, GGUF_TYPES[arch].global_every, hf))
    hf.update(own_keys(g, hf))
    return hf


def gemma_problem(cfg: Any, arch: str) -> str | None:
    """Why llama.cpp's ``arch`` (gemma2 / gemma3) would compute something else than ``cfg``, or None: what both
    fix (each architecture's own choices are checked next, by ``_gemma2_problem`` / ``_gemma3_problem``)."""
    every = GGUF_TYPES[arch].global_every
    if cfg.attn_bias or cfg.attn_out_bias:
        return "llama.cpp's Gemma has no attention biases"
    if cfg.sliding_window is None or [cfg.layer_window(i) is None for i in range(cfg.n_layer)] != [
            (i + 1) % every == 0 for i in range(cfg.n_layer)]:
        return f"llama.cpp's {arch} needs a sliding window with every {every}th layer global (layer_types)"
    if abs((cfg.attn_scale or cfg.head_dim ** -0.5) - cfg.head_dim ** -0.5) > 1e-9:
        return f"llama.cpp's {arch} scales scores by head_dim^-1/2; attn_scale={cfg.attn_scale}"
    return None


def _gemma2_problem(cfg: ModelConfig) -> str | None:
    problem = gemma_problem(cfg, "gemma2")
    if problem is None and (None in (cfg.attn_logit_softcap, cfg.final_logit_softcap) or not cfg.tie_embeddings):
        return "llama.cpp's gemma2 soft-caps scores and logits (both caps must be set) and ties the output head"
    return problem


def _gemma3_problem(cfg: ModelConfig) -> str | None:
    problem = gemma_problem(cfg, "gemma3")
    if problem is None and ((cfg.attn_logit_softcap, cfg.final_logit_softcap) != (None, None)
                            or cfg.rope_local_theta not in (None, GEMMA3_LOCAL_THETA)
                            or (cfg.rope_local_theta is None and cfg.rope_theta != GEMMA3_LOCAL_THETA)):
        return "llama.cpp's gemma3 has no soft-caps and its local layers' RoPE base is 10000"
    return problem


def _arch(name: str, own_keys: Callable[[Any, dict[str, Any]], dict[str, Any]],
          problem: Callable[[ModelConfig], str | None]) -> GGUFArch:
    return GGUFArch(name, partial(_gemma_config, name, own_keys), GEMMA_BLOCK, norm_plus_one=True,
                    sliding_window=True, export_problem=problem)


ARCHS = {"gemma2": _arch("gemma2", _gemma2_keys, _gemma2_problem),
         "gemma3": _arch("gemma3", _gemma3_keys, _gemma3_problem)}
