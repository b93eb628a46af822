"""The weight-adapter interface and its registry, keyed by Hugging Face ``model_type``.

An adapter is four pure functions plus two predicates; it knows names and layouts, never files:

    config_from_hf(hf_config: dict) -> ModelConfig          raises ConfigError naming what it cannot express
    config_to_hf(cfg: ModelConfig) -> dict                  the config.json to write
    hf_to_tinyformer(cfg, hf_tensors: Mapping) -> Iterator[(tinyformer name, tensor)]
    tinyformer_to_hf(cfg, tensors: Mapping) -> Iterator[(HF name, tensor)]
    export_problem(cfg) -> str | None                       why cfg cannot be written in this format (None: it can)
    ignorable_hf_tensor(cfg, hf_name) -> bool               checkpoint entries that are not weights (e.g. RoPE tables)
    align_config(hf_config, hf_names) -> dict               optional: the config adjusted to the tensor names
                                                            actually stored (e.g. with or without a name prefix)

The tensor mappings are lazy (a tensor is read when indexed) and the iterators are consumed one item at
a time, so an adapter should index a tensor only when it is about to yield what it builds from it. The
conversion runs each adapter twice: once on meta tensors (to plan, validate shapes and find unknown
or missing names before anything is written) and once on real ones; so adapters must only use torch
operations that work on the meta device (cat, split, reshape, transpose, ...).

Registering a new architecture (e.g. in ``interop/gpt2.py``)::

    ADAPTER = Adapter(name="gpt2", model_types=("gpt2",), config_from_hf=..., ...)

and list the module in ``BUILTIN_ADAPTER_MODULES`` below, or call ``register_adapter(ADAPTER)`` from your own code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError

TensorMap = Mapping[str, torch.Tensor]
TensorStream = Iterator[tuple[str, torch.Tensor]]


def _never(cfg: ModelConfig, name: str) -> bool:
    return False


def _as_is(hf_config: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    return dict(hf_config)


@dataclass(frozen=True)
class Adapter:
    """How one family of Hugging Face architectures maps onto tinyformer (see the module docstring)."""

    name: str
    model_types: tuple[str, ...]
    config_from_hf: Callable[[Mapping[str, Any]], ModelConfig]
    config_to_hf: Callable[[ModelConfig], dict[str, Any]]
    hf_to_tinyformer: Callable[[ModelConfig, TensorMap], TensorStream]
    tinyformer_to_hf: Callable[[ModelConfig, TensorMap], TensorStream]
    export_problem: Callable[[ModelConfig], str | None]
    ignorable_hf_tensor: Callable[[ModelConfig, str], bool] = field(default=_never)
    align_config: Callable[[Mapping[str, Any], Iterable[str]], dict[str, Any]] = field(default=_as_is)


# model_type -> Adapter (several model types may share one adapter)
ADAPTERS: dict[str, Adapter] = {}
# modules whose ADAPTER is registered on first use, in export-preference order
BUILTIN_ADAPTER_MODULES = ("tinyformer.interop.llama", "tinyformer.interop.gpt2", "tinyformer.interop.bert",
                           "tinyformer.interop.gemma")
_loaded = False


def register_adapter(adapter: Adapter) -> None:
    """Make ``adapter`` handle each of its ``model_types`` (a later registration replaces an earlier one)."""
    for model_type in adapter.model_types:
        ADAPTERS[model_type] = adapter


def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module_name in BUILTIN_ADAPTER_MODULES:
        module = importlib.import_module(module_name)
        adapter = getattr(module, "ADAPTER", None)
        if isinstance(adapter, Adapter):
            for model_type in adapter.model_types:
                ADAPTERS.setdefault(model_type, adapter)


def adapters() -> list[Adapter]:
    """Registered adapters, each once, in registration order."""
    _load_builtins()
    seen: dict[str, Adapter] = {}
    for adapter in ADAPTERS.values():
        seen.setdefault(adapter.name, adapter)
    return list(seen.values())


def adapter_for_hf(hf_config: Mapping[str, Any]) -> Adapter:
    """The adapter for a Hugging Face config.json, or ConfigError naming the unsupported architecture."""
    _load_builtins()
    model_type = hf_config.get("model_type")
    if model_type in ADAPTERS:
        return ADAPTERS[model_type]
    archs = ", ".join(hf_config.get("architectures") or []) or "no architectures listed"
    raise ConfigError(f"model_type {model_type!r} ({archs}) is not supported; supported model types: "
                      f"{', '.join(sorted(ADAPTERS))}")


def adapter_for_model(cfg: ModelConfig) -> Adapter:
    """The adapter that can export ``cfg``: the one it was imported with when that still fits, else the
    first registered one that can express it; ConfigError listing every adapter's reason otherwise."""
    _load_builtins()
    original = cfg.extra.get("hf_config") if isinstance(cfg.extra, dict) else None
    if isinstance(original, dict) and original.get("model_type") in ADAPTERS:
        adapter = ADAPTERS[original["model_type"]]
        if adapter.export_problem(cfg) is None:
            return adapter
    reasons = []
    for adapter in adapters():
        problem = adapter.export_problem(cfg)
        if problem is None:
            return adapter
        reasons.append(f"{adapter.name}: {problem}")
    raise ConfigError("no Hugging Face architecture can express this model (" + "; ".join(reasons) + ")")
