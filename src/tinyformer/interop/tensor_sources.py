"""Named tensors of a checkpoint on disk, read one at a time when asked for.

    TensorSource        names(), meta(name) (shape and dtype, no data), read(name)
      SafetensorsSource   one or several safetensors files (shards) seen as one set of names
      DictSource          tensors held by name
        TorchBinSource    pytorch_model.bin files, torch.load(weights_only=True), memory-mapped
        MetaStateDict     the state dict a config implies, on the meta device (what a checkpoint must hold)
    TensorView          a source seen as a Mapping of meta tensors (planning) or real ones (writing)
    open_hf_weights     the weights of a Hugging Face folder: model.safetensors[.index.json] or
                        pytorch_model.bin[.index.json]

The conversion that reads them is ``interop/convert_pipeline.py``; GGUF files are another source
(``interop/gguf.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from tinyformer.config import ModelConfig
from tinyformer.devices import DTYPE_NAMES
from tinyformer.errors import CheckpointError
from tinyformer.integrity import checked_shard_names
from tinyformer.safetensors_io import SafetensorsFile


class TensorSource:
    """Named tensors of a checkpoint on disk, read one at a time when asked for."""

    description = "checkpoint"

    def names(self) -> list[str]:
        raise NotImplementedError

    def meta(self, name: str) -> torch.Tensor:
        """A meta-device tensor with the shape and dtype ``read`` will return."""
        raise NotImplementedError

    def read(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def main_float_dtype(self) -> torch.dtype:
        """The floating dtype holding most of the parameters (the default output dtype)."""
        counts: dict[torch.dtype, int] = {}
        for name in self.names():
            t = self.meta(name)
            if t.is_floating_point():
                counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
        best = max(counts, key=counts.__getitem__) if counts else torch.float32
        return best if best in DTYPE_NAMES else torch.float32


class SafetensorsSource(TensorSource):
    """One or several safetensors files (shards) seen as one set of names."""

    def __init__(self, files: list[Path], description: str) -> None:
        self.description = description
        self._where: dict[str, SafetensorsFile] = {}
        for path in files:
            st = SafetensorsFile(path)
            for name in st.keys():
                if name in self._where:
                    raise CheckpointError(f"{description}: tensor {name!r} is stored twice "
                                          f"({self._where[name].path.name} and {path.name})")
                self._where[name] = st

    def names(self) -> list[str]:
        return list(self._where)

    def meta(self, name: str) -> torch.Tensor:
        return self._where[name].meta(name)

    def read(self, name: str) -> torch.Tensor:
        return self._where[name].read(name)


class DictSource(TensorSource):
    """Tensors held by name: meta ones (what a conversion plans), or a loaded checkpoint's."""

    def __init__(self, sd: Mapping[str, torch.Tensor] | Iterator[tuple[str, torch.Tensor]]) -> None:
        self.sd = dict(sd)

    def names(self) -> list[str]:
        return list(self.sd)

    def meta(self, name: str) -> torch.Tensor:
        return self.sd[name]


class TorchBinSource(DictSource):
    """``pytorch_model.bin`` files, loaded with ``torch.load(weights_only=True)`` (no arbitrary unpickling),
    memory-mapped when the file is in the zip format."""

    def __init__(self, files: list[Path], description: str) -> None:
        self.description = description
        self.sd: dict[str, torch.Tensor] = {}
        for path in files:  # open_hf_weights has checked that each exists
            try:
                try:
                    sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError as exc:
                    if "mmap" not in str(exc):
                        raise
                    sd = torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
            except Exception as exc:  # UnpicklingError, zip errors, EOFError for truncated files
                raise CheckpointError(f"{path} cannot be loaded with torch.load(weights_only=True): "
                                      f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
            if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
                raise CheckpointError(f"{path} does not hold a state dict of tensors")
            for name, tensor in sd.items():
                if name in self.sd:
                    raise CheckpointError(f"{description}: tensor {name!r} is stored twice")
                self.sd[name] = tensor

    def meta(self, name: str) -> torch.Tensor:
        t = self.sd[name]
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    def read(self, name: str) -> torch.Tensor:
        return self.sd[name]


class TensorView(Mapping[str, torch.Tensor]):
    """A source seen as a mapping, with meta tensors (planning) or real ones (writing)."""

    def __init__(self, source: TensorSource, meta: bool) -> None:
        self.source, self.is_meta = source, meta
        self._names = set(source.names())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self.source.meta(name) if self.is_meta else self.source.read(name)

    def __contains__(self, name: object) -> bool:  # without reading the tensor
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self.source.names())

    def __len__(self) -> int:
        return len(self._names)


class MetaStateDict(DictSource):
    """The state dict a config implies, on the meta device (what a checkpoint must contain)."""

    def __init__(self, cfg: ModelConfig) -> None:
        from tinyformer.models import meta_model
        from tinyformer.run_folder import state_dict_for_saving

        super().__init__(state_dict_for_saving(meta_model(cfg)))  # a tied head once, as the run folder stores it


def read_json(path: Path, what: str, kind: type = dict) -> Any:
    """A JSON object (or, with ``kind=list``, an array) from ``path``, or CheckpointError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist ({what})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({what}): {exc}") from None
    if not isinstance(data, kind):
        raise CheckpointError(f"{path} must hold a JSON {'object' if kind is dict else 'array'} ({what})")
    return data


def open_hf_weights(folder: str | Path) -> TensorSource:
    """The weights of a Hugging Face model folder: safetensors (single or sharded) preferred, else
    ``pytorch_model.bin`` (single or sharded)."""
    folder = Path(folder)
    for stem, cls in (("model.safetensors", SafetensorsSource), ("pytorch_model.bin", TorchBinSource)):
        index = folder / f"{stem}.index.json"
        if index.is_file():
            data = read_json(index, "sharded checkpoint index")
            weight_map = data.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index} has no weight_map")
            files = checked_shard_names(index, weight_map.values())
            missing = [f for f in files if not (folder / f).is_file()]
            if missing:
                raise CheckpointError(f"{index} lists shard(s) that are missing: {', '.join(missing)}")
            source = cls([folder / f for f in files], str(folder))
            absent = sorted(set(weight_map) - set(source.names()))
            if absent:
                raise CheckpointError(f"{index} lists tensor(s) its shards do not contain: {name_list(absent)}")
            return source
        if (folder / stem).is_file():
            return cls([folder / stem], str(folder))
    raise CheckpointError(f"no model.safetensors, model.safetensors.index.json or pytorch_model.bin in {folder}")


def name_list(names: list[str], limit: int = 6) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
