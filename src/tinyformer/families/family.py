"""What a model family folder gives the registry: its Hugging Face adapter, its llama.cpp (GGUF) architectures and
its presets.

    Family(name, adapter, gguf=(GGUFArch, ...), gguf_arch_for=cfg -> arch name, presets={name: field values})

A ``GGUFArch`` is one llama.cpp ``general.architecture`` as data and small functions; the generic reader
(``interop/gguf.py``) and writer (``interop/gguf_export.py``) do the rest:

    config_from_gguf(g) -> dict      the Hugging Face config.json dict the file's metadata states (``g`` is an
                                     ``interop.gguf.GGUFFile``: ``key`` (its architecture's metadata), ``get``,
                                     ``require``, ``tensors``, ``read``, ``path``)
    block_names                      llama.cpp's name of a layer tensor -> its HF module under model.layers.i.
                                     (its inverse, with the router's ``moe[0]``, names them for writing)
    moe                              (router, experts, gate, up, down): the HF names of a mixture's tensors
    rope_interleaved                 llama.cpp rotates adjacent pairs (2i, 2i+1) for this architecture, so W_q and
                                     W_k rows are permuted on the way in and out (tinyformer rotates half-split)
    norm_plus_one                    norm gains are stored as 1 + g (Gemma)
    sliding_window                   llama.cpp's writer of this architecture sets ``attention.sliding_window``
    longrope(g, theta, ctx, head_dim)  the rope_parameters of LongRoPE factor tensors, the only RoPE scaling
                                       such files have (Phi-3; None: refused)
    split_qkv_bias                   q/k/v biases without an output bias are allowed (Qwen2)
    export_problem(cfg)              why llama.cpp's fixed choices for this architecture differ from ``cfg``
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tinyformer.config import ModelConfig
from tinyformer.families.adapter import Adapter


@dataclass(frozen=True)
class GGUFArch:
    """One llama.cpp architecture of a family (see the module docstring)."""

    name: str
    config_from_gguf: Callable[[Any], dict[str, Any]]
    block_names: Mapping[str, str]
    moe: tuple[str, str, str, str, str] | None = None
    rope_interleaved: bool = False
    norm_plus_one: bool = False
    sliding_window: bool = False
    longrope: Callable[..., dict[str, Any]] | None = None
    split_qkv_bias: bool = False
    export_problem: Callable[[ModelConfig], str | None] = lambda cfg: None


@dataclass(frozen=True)
class Family:
    """One model family: a Hugging Face adapter, the GGUF architectures it reads and writes, and named shapes.

    ``gguf_arch_for(cfg)`` names the GGUF architecture a model this family's adapter writes is written as."""

    name: str
    adapter: Adapter
    gguf: tuple[GGUFArch, ...] = ()
    gguf_arch_for: Callable[[ModelConfig], str] | None = None
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
