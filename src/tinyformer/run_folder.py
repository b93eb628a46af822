"""The run folder: what `train` and `convert` write and every other command reads.

    RUN/
      config.json              ModelConfig (tinyformer's schema, with format_version)
      model.safetensors        weights; large models: model-0000i-of-0000n.safetensors + model.safetensors.index.json
      tokenizer.json           Hugging Face `tokenizers` format (char tokenizers too)
      tokenizer_config.json    optional: chat template, special tokens
      manifest.json            size and CRC-32 of each weight file, checked on load (integrity.py)
      (a quantized run, from `tinyformer quantize` (quantization.py), stores int8/int4 weights and scales
      instead: ``NAME.qweight``, ``NAME.scales`` (``NAME.zeros``); load_model swaps in QuantizedLinear layers)
      train.yaml, state/, metrics.jsonl, loss.png, samples.txt   (training runs only)

A LoRA run (``train --lora-rank``) stores its adapter instead of the weights, and names its base run:

    RUN/
      config.json, tokenizer.json, ...   as above (the base model's config)
      adapter.safetensors      the LoRA A/B matrices only (components/lora.py names)
      adapter_config.json      rank, alpha, dropout, targets, and the base run folder's path

``load_model`` (which every command uses) loads the base run, adds the adapter and merges it: a LoRA run
is used like any other.

Weights are read with safetensors only (never unpickled). Every file is written atomically
(temporary file, fsync, rename), so a crash never leaves a half-written file in place of a good one.
A tied LM head is stored once, as ``tok_emb.weight``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from tinyformer import safetensors_io
from tinyformer.config import ModelConfig
from tinyformer.errors import CheckpointError
from tinyformer.integrity import MANIFEST, checked_shard_names, verify_files, write_manifest
from tinyformer.safetensors_io import DEFAULT_SHARD_BYTES, INDEX, WEIGHTS
from tinyformer.utils.io import atomic_path, atomic_write_text

if TYPE_CHECKING:
    from tinyformer.components.quantized import QuantSpec

ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def state_dict_for_saving(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with tied tensors stored once (safetensors refuses shared storage)."""
    sd = model.state_dict()
    cfg = getattr(model, "cfg", None)
    if cfg is not None and cfg.tie_embeddings and "lm_head.weight" in sd and "tok_emb.weight" in sd:
        sd.pop("lm_head.weight")
    return {k: v.detach().contiguous() for k, v in sd.items()}


def save_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` as one safetensors file, written atomically (``utils.io.atomic_path``)."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})


def load_safetensors(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """All the tensors of a safetensors file; a CheckpointError for a file that is not one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device=device)
    except SafetensorError as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from None


def side_files(run_dir: str | Path) -> list[Path]:
    """The top-level files of a run folder other than its weights (shards, index, manifest) and config.json:
    the tokenizer and training files that a rewrite of the weights (quantize, ``--keep-quant``) carries over.
    The manifest stays behind because it describes the old weights; the new ones get their own."""
    return [p for p in sorted(Path(run_dir).iterdir()) if p.is_file() and p.suffix != ".safetensors"
            and p.name not in (INDEX, MANIFEST, "config.json")]


def save_tensors(run_dir: str | Path, tensors: Iterable[tuple[str, torch.Tensor]],
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Write (name, tensor) pairs as one safetensors file, or shards plus an index when larger than
    ``max_shard_bytes``. Tensors are consumed one by one: only one shard is held in memory."""
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    written: list[tuple[str, list[str]]] = []  # (temporary name, tensor names) per shard
    total = 0
    pairs = ((key, tensor.detach().contiguous()) for key, tensor in tensors)
    for shard in safetensors_io.split_shards(pairs, lambda pair: pair[1].nbytes, max_shard_bytes):
        name = f"shard-{len(written):05d}.tmp.safetensors"
        save_safetensors(run / name, dict(shard))
        written.append((name, [key for key, _ in shard]))
        total += sum(tensor.nbytes for _, tensor in shard)
    # rename the shards into place only once all of them are complete
    if len(written) == 1:
        (run / written[0][0]).replace(run / WEIGHTS)
        (run / INDEX).unlink(missing_ok=True)
        write_manifest(run, [WEIGHTS])
        return [WEIGHTS]
    names = safetensors_io.shard_names(len(written))
    weight_map: dict[str, str] = {}
    for (tmp, keys), final in zip(written, names):
        (run / tmp).replace(run / final)
        weight_map.update({k: final for k in keys})
    safetensors_io.write_index(run, weight_map, total)
    (run / WEIGHTS).unlink(missing_ok=True)
    write_manifest(run, [*names, INDEX])
    return names


def checked_weight_files(run_dir: str | Path, verify: bool = True) -> list[Path]:
    """The run's weight files (the index's shards, else model.safetensors), each present and (with ``verify``)
    matching its manifest entry; the index file, when there is one, is checked too."""
    run = Path(run_dir)
    index = run / INDEX
    if index.is_file():
        try:
            files = checked_shard_names(index, json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from None
        paths = [run / f for f in files]
    elif (run / WEIGHTS).is_file():
        paths = [run / WEIGHTS]
    else:
        raise CheckpointError(f"no {WEIGHTS} (or {INDEX}) in {run}")
    for path in paths:
        if not path.is_file():
            raise CheckpointError(f"weight file {path} is missing")
    if verify:
        verify_files(run_dir, [*paths, index] if index.is_file() else paths)
    return paths


def tensor_bytes(run_dir: str | Path, verify: bool = True) -> int:
    """Bytes of the tensors in the run's safetensors file(s), summed from their headers (no tensor is read;
    with ``verify`` the files are checked against the manifest first)."""
    total = 0
    for path in checked_weight_files(run_dir, verify):
        f = safetensors_io.SafetensorsFile(path)
        total += sum(f.spec(name).nbytes for name in f.keys())
    return total


def iter_tensors(run_dir: str | Path, device: str = "cpu", verify: bool = True,
                 mapped: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from the run's safetensors file(s), one at a time; the files are checked against
    the run's manifest first unless ``verify`` is False.

    ``mapped``: the tensors are views of a memory map of the file (no copy; pages read when first touched).
    Every page of the map that was touched stays resident while any one tensor of the file is alive, so a
    caller that keeps few of the tensors as they are (it packs or transposes the rest) reads them with
    ``mapped=False`` instead: each into its own memory, freed with the tensor."""
    from safetensors import SafetensorError, safe_open

    for path in checked_weight_files(run_dir, verify):
        if not mapped:
            file = safetensors_io.SafetensorsFile(path)
            for key in file.keys():
                yield key, file.read(key).to(device)
            continue
        try:
            with safe_open(str(path), framework="pt", device=device) as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        except SafetensorError as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from None


def save_model(run_dir: str | Path, model: nn.Module, cfg: ModelConfig | None = None,
               max_shard_bytes: int = DEFAULT_SHARD_BYTES, dtype: torch.dtype | None = None) -> None:
    """Write config.json and the weights of ``model`` into ``run_dir``."""
    cfg = cfg or model.cfg  # before any file is written: a model without a config fails here
    save_tensors(run_dir, cast_floats(state_dict_for_saving(model).items(), dtype), max_shard_bytes)
    cfg.save(Path(run_dir) / "config.json")


def cast_floats(tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs, contiguous, with the floating-point ones cast to ``dtype`` (None: as they are)."""
    for name, t in tensors:
        yield name, (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()


def load_config(run_dir: str | Path) -> ModelConfig:
    run = Path(run_dir)
    if not run.exists():
        raise CheckpointError(f"run folder {run} does not exist")
    if not (run / "config.json").is_file():
        raise CheckpointError(f"{run} has no config.json: is it a tinyformer run folder?")
    return ModelConfig.load(run / "config.json")


def rebuild_buffers(model: nn.Module, device: torch.device | str) -> None:
    """Recompute non-persistent buffers (RoPE and sinusoidal tables) after a meta-device or uninitialised
    build, the way every loader has (the frequencies on the CPU, then moved), so a device gets the same values."""
    from tinyformer.components.positions import SinusoidalPositions
    from tinyformer.components.rope import RotaryEmbedding

    for module in model.modules():
        if isinstance(module, (RotaryEmbedding, SinusoidalPositions)):
            module.reset_buffers(device)


def load_state_into(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Load named tensors into ``model`` strictly: shape mismatches, missing and unknown names are errors."""
    own = model.state_dict()
    cfg = getattr(model, "cfg", None)
    tied = cfg is not None and getattr(cfg, "tie_embeddings", False) and "lm_head.weight" in own
    expected = set(own) - ({"lm_head.weight"} if tied else set())
    loaded: dict[str, torch.Tensor] = {}
    for key, tensor in tensors:
        if key not in expected:
            raise CheckpointError(f"{source}: unexpected tensor {key!r} (not part of this model's config)")
        if tuple(tensor.shape) != tuple(own[key].shape):
            raise CheckpointError(f"{source}: tensor {key!r} has shape {tuple(tensor.shape)}, the config needs "
                                  f"{tuple(own[key].shape)}")
        loaded[key] = tensor
    missing = sorted(expected - set(loaded))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{source}: missing tensor(s) {', '.join(missing[:5])}{more}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.tok_emb.weight


def load_model(run_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               cfg: ModelConfig | None = None, verify: bool = True, mapped: bool = True) -> nn.Module:
    """Build the model of ``run_dir`` without a random init (:func:`~tinyformer.models.empty_model`) and
    load its weights (checked against the run's manifest first unless ``verify`` is False); for a LoRA run,
    the base run's model with the adapter merged in (:func:`load_adapter_run`). ``mapped``: as in
    :func:`iter_tensors`; a caller that re-lays the weights out after loading (decoding on a CPU: packed
    quantized kernels, input-major float weights) passes False."""
    from tinyformer.models import empty_model
    from tinyformer.sizing import check_buildable

    if is_adapter_run(run_dir):
        return load_adapter_run(run_dir, device, dtype, verify=verify, mapped=mapped)
    cfg = cfg or load_config(run_dir)
    # the weights' own dtype is only known once read: bound with the smallest float a run folder stores
    check_buildable(cfg, torch.empty(0, dtype=dtype).element_size() if dtype is not None else 2)
    spec = quant_spec(cfg)
    model = empty_model(cfg, device)
    tensors = ((k, v.to(device)) for k, v in iter_tensors(run_dir, verify=verify, mapped=mapped))
    if spec is not None:  # quantized layers first (their scales stay float32 until the layer casts them)
        stored = dict(tensors)
        load_quantized(model, spec, stored, str(run_dir), dtype or torch.float32)
        tensors = iter(stored.items())
    load_state_into(model, cast_floats(tensors, dtype), str(run_dir))
    rebuild_buffers(model, device)
    return model.eval()


def load_tokenizer(run_dir: str | Path):  # -> tinyformer.data.tokenizer.Tokenizer
    from tinyformer.data.tokenizer import Tokenizer

    path = Path(run_dir) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{run_dir} has no tokenizer.json")
    return Tokenizer.load(path)


# ---------------------------------------------------------------------------- LoRA runs


def is_adapter_run(run_dir: str | Path) -> bool:
    return (Path(run_dir) / ADAPTER_CONFIG).is_file()


def write_adapter_config(run_dir: str | Path, lora: dict, base_run: str | Path) -> None:
    """adapter_config.json: the LoRA settings and the base run, by its path relative to ``run_dir`` (found
    when both folders move together) and absolute (found when only the LoRA run moves)."""
    run, base = Path(run_dir), Path(base_run).resolve()
    data = {"format_version": 1, "kind": "lora", **lora, "base_run": os.path.relpath(base, run.resolve()),
            "base_run_absolute": str(base)}
    atomic_write_text(run / ADAPTER_CONFIG, json.dumps(data, indent=2) + "\n")


def read_adapter_config(run_dir: str | Path):  # -> tuple[LoRAConfig, Path]
    """(LoRAConfig, base run folder) of a LoRA run; a CheckpointError names what is wrong."""
    from tinyformer.components.lora import LoRAConfig
    from tinyformer.errors import ConfigError

    run = Path(run_dir)
    path = run / ADAPTER_CONFIG
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        lora = LoRAConfig(rank=data["rank"], alpha=data["alpha"], dropout=data["dropout"],
                          targets=tuple(data["targets"]))
        candidates = [run / data["base_run"], Path(data["base_run_absolute"])]
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as exc:
        raise CheckpointError(f"{path} is not a valid LoRA adapter config: {exc}") from None
    for base in candidates:
        if (base / "config.json").is_file():
            return lora, Path(os.path.normpath(base))
    raise CheckpointError(f"the base run of LoRA run {run} is missing (looked for {candidates[0]} and "
                          f"{candidates[1]}); put the base run folder back there")


def save_adapter_run(run_dir: str | Path, model: nn.Module, base_run: str | Path) -> None:
    """Write a LoRA run folder for ``model`` (which carries adapters) on ``base_run``: config.json,
    adapter.safetensors, adapter_config.json and the base run's tokenizer files."""
    import shutil

    from tinyformer.components.lora import adapter_state_dict

    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    save_safetensors(run / ADAPTER_WEIGHTS, {k: v.detach().contiguous() for k, v in adapter_state_dict(model).items()})
    write_adapter_config(run, model.lora_config.to_dict(), base_run)
    model.cfg.save(run / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(base_run) / name).is_file():
            shutil.copyfile(Path(base_run) / name, run / name)


def load_adapter_run(run_dir: str | Path, device: str | torch.device = "cpu",
                     dtype: torch.dtype | None = None, verify: bool = True, mapped: bool = True) -> nn.Module:
    """The base run's model with the LoRA run's adapter merged in (W + (alpha/r) B A), as a plain model
    (``mapped``: the base's weights, as in :func:`load_model`)."""
    from tinyformer.components.lora import adapter_state_dict, apply_lora, merge_lora

    lora, base = read_adapter_config(run_dir)
    path = Path(run_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"LoRA run {run_dir} has no {ADAPTER_WEIGHTS} yet (it writes one at each checkpoint)")
    tensors = load_safetensors(path, str(device))
    model = load_model(base, device=device, dtype=dtype, verify=verify, mapped=mapped)
    with torch.random.fork_rng(devices=[]):  # the adapters' random init is overwritten: leave the RNG alone
        apply_lora(model, lora)
    own = adapter_state_dict(model)
    if set(own) != set(tensors) or any(tuple(tensors[k].shape) != tuple(v.shape) for k, v in own.items()):
        raise CheckpointError(f"{path} does not match the adapter that {ADAPTER_CONFIG} and the base run "
                              f"{base} describe")
    with torch.no_grad():
        for key, value in own.items():
            value.copy_(tensors[key])
    merge_lora(model)
    return model.eval()


def model_tensors(run_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a run's model as a plain run folder stores it; a LoRA run's are merged."""
    if is_adapter_run(run_dir):
        yield from state_dict_for_saving(load_adapter_run(run_dir)).items()
    else:
        yield from iter_tensors(run_dir)


# ---------------------------------------------------------------------------- quantized runs

QUANT_KEY = "quantization"
PORTABLE_PARTS = ("qweight", "scales", "zeros")


def quant_spec(cfg: ModelConfig) -> QuantSpec | None:
    """The run's quantization, or None for a float run (ConfigError for a malformed entry)."""
    from tinyformer.components.quantized import QuantSpec

    data = cfg.extra.get(QUANT_KEY) if isinstance(cfg.extra, dict) else None
    return None if data is None else QuantSpec.from_dict(data)


def linear_names(model: nn.Module) -> list[str]:
    """Names of the model's ``nn.Linear`` modules: the layers a quantized run stores quantized."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def tied_head(model: nn.Module) -> bool:
    head, emb = getattr(model, "lm_head", None), getattr(model, "tok_emb", None)
    return isinstance(head, nn.Linear) and isinstance(emb, nn.Embedding) and head.weight is emb.weight


def load_quantized(model: nn.Module, spec: QuantSpec, tensors: dict[str, torch.Tensor], source: str,
                   dtype: torch.dtype) -> None:
    """Swap the (meta-device) ``nn.Linear`` s of ``model`` whose portable tensors are in ``tensors`` for
    ``QuantizedLinear`` s, in place, and take those tensors out of ``tensors``; the float rest stays for the
    strict state-dict load. A tied token table becomes a ``QuantizedEmbedding`` over the head's tensors."""
    from tinyformer.components.quantized import QuantizedEmbedding, QuantizedLinear

    tied = tied_head(model)
    names = linear_names(model)
    if not any(f"{n}.qweight" in tensors for n in names):
        raise CheckpointError(f"{source}: config.json says the run is quantized but no *.qweight tensor is stored")
    for name in names:
        if f"{name}.qweight" not in tensors:
            continue
        layer = model.get_submodule(name)
        needed = PORTABLE_PARTS if spec.type == "int4" else PORTABLE_PARTS[:2]
        missing = [p for p in needed if f"{name}.{p}" not in tensors]
        if missing:
            raise CheckpointError(f"{source}: quantized layer {name} lacks {', '.join(missing)}")
        portable = {p: tensors.pop(f"{name}.{p}") for p in needed}
        width = layer.in_features // (2 if spec.type == "int4" else 1)
        if tuple(portable["qweight"].shape) != (layer.out_features, width):
            raise CheckpointError(f"{source}: {name}.qweight has shape {tuple(portable['qweight'].shape)}, the "
                                  f"config needs {(layer.out_features, width)}")
        bias = tensors.get(f"{name}.bias") if layer.bias is not None else None  # left for the strict load
        if layer.bias is not None and bias is None:
            raise CheckpointError(f"{source}: missing tensor {name}.bias")
        quantized = QuantizedLinear(portable, spec, layer.in_features, bias, dtype)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, quantized)
        if tied and name == "lm_head":
            model.tok_emb = QuantizedEmbedding(portable, spec.type, dtype, head=quantized)
