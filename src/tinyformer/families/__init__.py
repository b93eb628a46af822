"""Model families: one folder per family, and the registry that finds them.

    llama/    Llama 1/2/3, Mistral, Mixtral (the Llama layout the next three build on)
    qwen/     Qwen2, Qwen3, Qwen3-MoE
    phi3/     Phi-3
    gemma/    Gemma 2, Gemma 3 (text)
    gpt2/     GPT-2
    bert/     BERT, sentence-transformers
    adapter.py, family.py   the interfaces: ``Adapter`` (HF config + tensor names), ``GGUFArch``, ``Family``

Each family folder holds its Hugging Face config translation and tensor-name map (``hf.py``, an ``Adapter``), its
llama.cpp architectures (``gguf.py``, ``GGUFArch`` entries: metadata keys, tensor names, RoPE convention) and its
presets (``presets.py``), and states in its ``__init__.py`` the ``FAMILY`` the registry lists. Adding an architecture
is one folder and one line in ``FAMILIES`` below. The registry is keyed by Hugging Face ``model_type`` (``ADAPTERS``)
and by GGUF ``general.architecture`` (``GGUF_ARCHS``); ``interop/`` finds the families here, and no family imports
``interop/``.

Export picks the family a model was imported with when it can still write it, else the first family in
``FAMILIES`` order whose adapter can (the families' model types exclude each other but for that preference).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError
from tinyformer.families import bert, gemma, gpt2, llama, phi3, qwen
from tinyformer.families.adapter import Adapter, imported_hf_config
from tinyformer.families.family import Family, GGUFArch

FAMILIES: tuple[Family, ...] = (llama.FAMILY, qwen.FAMILY, phi3.FAMILY, gemma.FAMILY, gpt2.FAMILY, bert.FAMILY)

# model_type -> Adapter (several model types share one adapter); register_adapter adds more
ADAPTERS: dict[str, Adapter] = {t: f.adapter for f in FAMILIES for t in f.adapter.model_types}
# GGUF general.architecture -> its entry
GGUF_ARCHS: dict[str, GGUFArch] = {a.name: a for f in FAMILIES for a in f.gguf}


def register_adapter(adapter: Adapter) -> None:
    """Make ``adapter`` handle each of its ``model_types`` (a later registration replaces an earlier one)."""
    for model_type in adapter.model_types:
        ADAPTERS[model_type] = adapter


def adapters() -> list[Adapter]:
    """Registered adapters, each once, in registration order."""
    seen: dict[str, Adapter] = {}
    for adapter in ADAPTERS.values():
        seen.setdefault(adapter.name, adapter)
    return list(seen.values())


def adapter_for_hf(hf_config: Mapping[str, Any]) -> Adapter:
    """The adapter for a Hugging Face config.json, or ConfigError naming the unsupported architecture."""
    model_type = hf_config.get("model_type")
    if model_type in ADAPTERS:
        return ADAPTERS[model_type]
    archs = ", ".join(hf_config.get("architectures") or []) or "no architectures listed"
    raise ConfigError(f"model_type {model_type!r} ({archs}) is not supported; supported model types: "
                      f"{', '.join(sorted(ADAPTERS))}")


def _pick(cfg: ModelConfig, candidates: list[Adapter], what: str) -> Adapter:
    """The adapter ``cfg`` was imported with when it still writes ``cfg``, else the first candidate that does;
    ConfigError listing each candidate's reason (candidates with one reason named together) otherwise."""
    adapter = ADAPTERS.get((imported_hf_config(cfg) or {}).get("model_type"))
    if adapter in candidates and adapter.export_problem(cfg) is None:
        return adapter
    reasons: dict[str, list[str]] = {}
    for adapter in candidates:
        problem = adapter.export_problem(cfg)
        if problem is None:
            return adapter
        reasons.setdefault(problem, []).append(adapter.name)
    raise ConfigError(f"no {what} can express this model ("
                      + "; ".join(f"{', '.join(names)}: {problem}" for problem, names in reasons.items()) + ")")


def adapter_for_model(cfg: ModelConfig) -> Adapter:
    """The adapter that can export ``cfg``: the one it was imported with when that still fits, else the
    first registered one that can express it; ConfigError listing every adapter's reason otherwise."""
    return _pick(cfg, adapters(), "Hugging Face architecture")


def gguf_family_for(cfg: ModelConfig) -> Family:
    """The family whose llama.cpp architectures write ``cfg`` (chosen as ``adapter_for_model`` chooses, among the
    families with GGUF entries); ConfigError naming why the Llama layout cannot express it otherwise."""
    with_gguf = [f for f in FAMILIES if f.gguf]
    candidates = [f.adapter for f in with_gguf]
    try:
        adapter = _pick(cfg, candidates, "GGUF architecture")
    except ConfigError:
        raise ConfigError(candidates[0].export_problem(cfg) or "no GGUF architecture can express this model") from None
    return next(f for f in with_gguf if f.adapter is adapter)


def family_presets() -> dict[str, dict[str, Any]]:
    """Every family's named shapes (preset name -> ModelConfig field values, a copy)."""
    return {name: dict(values) for f in FAMILIES for name, values in f.presets.items()}


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config.json of ``cfg``, written by the family ``adapter_for_model`` picks."""
    return adapter_for_model(cfg).config_to_hf(cfg)


def tinyformer_to_hf(cfg: ModelConfig, sd: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) of a tinyformer state dict, named by the family ``adapter_for_model`` picks."""
    return adapter_for_model(cfg).tinyformer_to_hf(cfg, sd)
