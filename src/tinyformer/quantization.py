"""Quantized run folders: write one from a float run (`tinyformer quantize`); ``run_folder.load_model`` loads one.

A quantized run folder is a run folder whose config.json carries ``extra["quantization"]`` (a
:class:`~tinyformer.components.quantized.QuantSpec`: type, group_size, kernel) and whose safetensors
hold, for every quantized linear layer ``NAME``, the portable form of its weight instead of ``NAME.weight``:

    NAME.qweight   int8 (out, in), or for int4 uint8 (out, in / 2), two 4-bit values per byte
    NAME.scales    float32 (out, in / G)
    NAME.zeros     float32 (out, in / G), int4 only
    NAME.bias      float, as before (when the layer has one)

Every ``nn.Linear`` of the model is quantized, the LM head included. A head tied to the token table is
stored once, as ``lm_head.*``, and the token table reads its rows (``QuantizedEmbedding``); an untied token
table stays float (a lookup reads one row per token, not the whole table). Norms and biases stay float.
Quantizing is weight-only and needs no calibration data.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from tinyformer.components.quantized import QuantSpec, dequantize_weight, quantize_weight, resolve_kernel
from tinyformer.errors import ConfigError
from tinyformer.run_folder import (
    QUANT_KEY,
    linear_names,
    load_config,
    load_model,
    quant_spec,
    save_tensors,
    side_files,
    state_dict_for_saving,
    tensor_bytes,
    tied_head,
)

# ------------------------------------------------------------------ quantize a float model


@dataclass
class LayerError:
    """Quantization error of one weight: max |W - dequant(W)|, and ||W - dequant(W)||_F / ||W||_F."""

    name: str
    shape: tuple[int, int]
    max_abs: float
    relative: float


@dataclass
class QuantizeReport:
    out: Path
    spec: QuantSpec
    float_bytes: int
    quantized_bytes: int
    files: list[str]
    layers: list[LayerError] = field(default_factory=list)


def quantized_tensors(model: nn.Module, spec: QuantSpec,
                      errors: list[LayerError] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of the quantized run's safetensors, one layer at a time, from a float model."""
    linears = set(linear_names(model))
    sd = state_dict_for_saving(model)
    if tied_head(model):  # stored once, under the head's name
        sd["lm_head.weight"] = sd.pop("tok_emb.weight")
    for key, tensor in sd.items():
        prefix, _, leaf = key.rpartition(".")
        if prefix in linears and leaf == "weight":
            parts = quantize_weight(tensor, spec)
            if errors is not None:
                diff = tensor.float() - dequantize_weight(parts, spec.type)
                norm = float(tensor.float().norm())
                errors.append(LayerError(prefix, tuple(tensor.shape), float(diff.abs().max()),
                                         float(diff.norm()) / norm if norm > 0 else 0.0))
            for part, value in parts.items():
                yield f"{prefix}.{part}", value
        else:
            yield key, tensor


def quantize_run(model_dir: str | Path, out: str | Path, spec: QuantSpec, *, force: bool = False,
                 layer_errors: bool = False) -> QuantizeReport:
    """Float run folder -> quantized run folder (config.json with the spec, quantized safetensors, and every
    other top-level file of the run, such as the tokenizer, copied). Nothing is written on error."""
    from tinyformer.interop.convert_pipeline import staged_output

    src = Path(model_dir)
    cfg = load_config(src)
    if quant_spec(cfg) is not None:
        raise ConfigError(f"{src} is already quantized ({quant_spec(cfg).type}); quantize the float run it came from")
    model = load_model(src, dtype=torch.float32)
    for name in linear_names(model):  # every layer must fit the group size (and an explicit kernel) first
        layer = model.get_submodule(name)
        try:
            spec.groups(layer.in_features)
            if spec.kernel != "auto":
                resolve_kernel(spec, layer.out_features, layer.in_features, torch.device("cpu"))
        except ConfigError as exc:
            raise ConfigError(f"layer {name}: {exc}") from None
    float_bytes = tensor_bytes(src, verify=False)  # load_model checked the files
    errors: list[LayerError] = []
    copied = side_files(src)
    # --force replaces an earlier quantize of this run: it holds the same copied side files
    with staged_output(out, force, (src,), also_written=frozenset(p.name for p in copied)) as staging:
        save_tensors(staging, quantized_tensors(model, spec, errors if layer_errors else None))
        for item in copied:
            shutil.copy2(item, staging / item.name)
        cfg.replace(extra={**cfg.extra, QUANT_KEY: spec.to_dict()}).save(staging / "config.json")
        quantized_bytes = tensor_bytes(staging, verify=False)
        files = sorted(p.name for p in staging.iterdir())
    return QuantizeReport(Path(out), spec, float_bytes, quantized_bytes, files, errors)
