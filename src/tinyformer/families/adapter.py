"""The weight-adapter interface: how one family's Hugging Face config and tensor names map onto tinyformer
(torchtitan calls it a state-dict adapter).

An adapter is four pure functions plus two predicates; it knows names and layouts, never files:

    config_from_hf(hf_config: dict) -> ModelConfig          raises ConfigError naming what it cannot express
    config_to_hf(cfg: ModelConfig) -> dict                  the config.json to write (its dtype: the export's)
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

A family folder builds its adapter (e.g. ``families/gpt2/hf.py``)::

    ADAPTER = Adapter(name="gpt2", model_types=("gpt2",), config_from_hf=..., ...)

and the registry (``families/__init__.py``) looks it up by ``model_type``; ``register_adapter`` there adds one
from your own code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError

TensorMap = Mapping[str, torch.Tensor]
TensorStream = Iterator[tuple[str, torch.Tensor]]


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
    ignorable_hf_tensor: Callable[[ModelConfig, str], bool] = lambda cfg, name: False
    align_config: Callable[[Mapping[str, Any], Iterable[str]], dict[str, Any]] = lambda hf, names: dict(hf)


def imported_hf_config(cfg: ModelConfig) -> dict[str, Any] | None:
    """The Hugging Face config ``cfg`` was imported from (``extra["hf_config"]``), or None."""
    original = cfg.extra.get("hf_config") if isinstance(cfg.extra, dict) else None
    return original if isinstance(original, dict) else None


def hf_pad_token_id(hf: Mapping[str, Any]) -> int | None:
    """The config's ``pad_token_id`` when it names a token of the vocabulary; None otherwise (HF configs
    carry null, -1 or an id past the vocabulary for "no padding")."""
    pad = hf.get("pad_token_id")
    return pad if isinstance(pad, int) and 0 <= pad < hf["vocab_size"] else None


def checkpoint_tensor(hf_sd: TensorMap, name: str, why: str = "") -> torch.Tensor:
    """``hf_sd[name]``, or a ConfigError naming the missing tensor (``why``: what makes it needed)."""
    if name not in hf_sd:
        raise ConfigError(f"tensor {name!r} is missing from the checkpoint{f' ({why})' if why else ''}")
    return hf_sd[name]


def updated_hf_config(cfg: ModelConfig, export_problem: Callable[[ModelConfig], str | None],
                      keys: Mapping[str, Any]) -> dict[str, Any]:
    """The imported HF config (or a new one) updated with ``keys``, tying and the padding id; ConfigError naming
    ``export_problem(cfg)`` when there is one."""
    if problem := export_problem(cfg):
        raise ConfigError(problem)
    hf = dict(imported_hf_config(cfg) or {})
    hf.update({**keys, "tie_word_embeddings": cfg.tie_embeddings})
    if cfg.pad_token_id is not None:
        hf["pad_token_id"] = cfg.pad_token_id
    return hf


def fixed_field_problem(cfg: ModelConfig, wanted: Mapping[str, Any], target: str) -> str | None:
    """The first config field that differs from the value a format fixes (a tuple: the values it allows), as a
    message naming both (``target`` is the format, e.g. "GPT-2"); None when every field matches."""
    for key, value in wanted.items():
        have = getattr(cfg, key)
        if have not in value if isinstance(value, tuple) else have != value:
            needs = f"one of {', '.join(value)}" if isinstance(value, tuple) else repr(value)
            return f"{key}={have!r} cannot be exported as {target} (needs {needs})"
    return None

