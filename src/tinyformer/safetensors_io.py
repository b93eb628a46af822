"""Streaming safetensors I/O for conversion: read one tensor at a time, write without buffering a shard.

The safetensors format (https://github.com/huggingface/safetensors):

    [8 bytes: N, little-endian u64] [N bytes: JSON header] [data]
    header = {"__metadata__": {...}, name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...}

with offsets relative to the start of the data, tensors stored contiguously (row-major, little-endian),
no gaps, and the header padded with spaces to a multiple of 8 bytes.

Why not ``safetensors.safe_open`` and ``save_file``? ``safe_open`` memory-maps the file, and every page a
conversion touches stays in the process's resident set until the file is closed, so reading a 2 GB
checkpoint through one handle shows up as 2 GB of RSS. ``save_file`` needs the whole shard as a dict
(and serialises it in one piece). Here a tensor is read with a plain ``readinto`` into its own buffer
and written as soon as it is produced, after the header has been computed from a *plan* (names, shapes
and dtypes obtained by running the conversion on meta tensors first). Peak memory is then a few
tensors, whatever the checkpoint size. The files are ordinary safetensors files: the tests read them
back with the ``safetensors`` library and with ``transformers``.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from tinyformer.errors import CheckpointError
from tinyformer.utils.io import atomic_write_text

DTYPES: dict[str, torch.dtype] = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                                  "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
                                  "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
                                  "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
T = TypeVar("T")
MAX_HEADER_BYTES = 100 * 2**20  # the reference implementation's limit
DEFAULT_SHARD_BYTES = 2 * 2**30
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorSpec:
    """What a tensor will be, before it exists: name, shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class SafetensorsFile:
    """One safetensors file, header parsed and checked on open; tensors read on demand.

    Corrupt or truncated files raise :class:`CheckpointError` naming the file and the problem.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"weight file {self.path} does not exist")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{self.path} is not a safetensors file (only {size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"{self.path} is not a valid safetensors file (header length {n}, "
                                      f"file size {size}): corrupt or truncated")
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # 10^6 nested brackets
            raise CheckpointError(f"{self.path} has a corrupt safetensors header ({exc})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path} has a corrupt safetensors header (not a JSON object)")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        end_of_data = 0
        for name, entry in header.items():
            try:
                dtype = DTYPES[entry["dtype"]]
                shape = tuple(int(d) for d in entry["shape"])
                begin, end = (int(o) for o in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: tensor {name!r} has an invalid or unsupported header entry "
                                      f"{entry!r}") from None
            expected = TensorSpec(name, shape, dtype).nbytes
            if end - begin != expected or begin < 0 or min(shape, default=1) < 0:
                raise CheckpointError(f"{self.path}: tensor {name!r} has {end - begin} bytes for shape {list(shape)} "
                                      f"of {entry['dtype']} ({expected} expected): corrupt file")
            self._entries[name] = (dtype, shape, begin, end)
            end_of_data = max(end_of_data, end)
        if self.data_start + end_of_data > size:
            raise CheckpointError(f"{self.path} is truncated: its header needs {self.data_start + end_of_data} bytes, "
                                  f"the file has {size}")

    def keys(self) -> list[str]:
        return list(self._entries)

    def spec(self, name: str) -> TensorSpec:
        dtype, shape, _, _ = self._entries[name]
        return TensorSpec(name, shape, dtype)

    def meta(self, name: str) -> torch.Tensor:
        """A meta-device tensor of the right shape and dtype (no data read)."""
        dtype, shape, _, _ = self._entries[name]
        return torch.empty(shape, dtype=dtype, device="meta")

    def read(self, name: str) -> torch.Tensor:
        """The tensor, read from disk into freshly allocated memory (not a view of a mapping)."""
        dtype, shape, begin, end = self._entries[name]
        buf = torch.empty(end - begin, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            got = f.readinto(memoryview(buf.numpy()))
        if got != end - begin:
            raise CheckpointError(f"{self.path} is truncated inside tensor {name!r}")
        return buf.view(dtype).reshape(shape)


def split_shards(items: Iterable[T], nbytes: Callable[[T], int], max_shard_bytes: int) -> Iterator[list[T]]:
    """Greedy split, in order, into shards of at most ``max_shard_bytes`` (an item larger than that gets its own);
    lazy: only the shard being filled is held."""
    shard: list[T] = []
    size = 0
    for item in items:
        if shard and size + nbytes(item) > max_shard_bytes:
            yield shard
            shard, size = [], 0
        shard.append(item)
        size += nbytes(item)
    if shard:
        yield shard


def shard_names(n: int) -> list[str]:
    """``model.safetensors`` for one shard, ``model-00001-of-0000n.safetensors`` otherwise (Hugging Face's)."""
    if n == 1:
        return [WEIGHTS]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _header_bytes(specs: list[TensorSpec]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_planned(folder: str | Path, specs: list[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]],
                  max_shard_bytes: int) -> list[str]:
    """Write ``tensors`` (which must arrive in the order, shapes and dtypes of ``specs``) as safetensors
    shards into ``folder``, plus the index (:func:`write_index`) when there is more than one shard.

    Each tensor is written as it arrives; nothing is buffered. ``folder`` should be a staging folder that
    the caller renames into place once everything succeeded (see ``convert_pipeline.staged_output``).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards = list(split_shards(specs, lambda spec: spec.nbytes, max_shard_bytes)) or [[]]
    names = shard_names(len(shards))
    stream: Iterator[tuple[str, torch.Tensor]] = iter(tensors)
    for shard, fname in zip(shards, names):
        with open(folder / fname, "wb") as f:
            f.write(_header_bytes(shard))
            for spec in shard:
                try:
                    name, tensor = next(stream)
                except StopIteration:
                    raise RuntimeError(f"conversion stopped before tensor {spec.name!r}") from None
                if name != spec.name or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                    raise RuntimeError(f"conversion produced {name!r} {tuple(tensor.shape)} {tensor.dtype}, "
                                       f"planned {spec.name!r} {spec.shape} {spec.dtype}")
                # a flat uint8 view of the tensor's storage: written without another copy
                f.write(memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
                del tensor
            f.flush()
            os.fsync(f.fileno())
    if next(stream, None) is not None:
        raise RuntimeError("conversion produced more tensors than planned")
    if len(shards) > 1:
        write_index(folder, {spec.name: fname for shard, fname in zip(shards, names) for spec in shard},
                    sum(spec.nbytes for spec in specs))
    return names


def write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    """``model.safetensors.index.json`` (Hugging Face's): the shard holding each tensor, and their total bytes."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    atomic_write_text(folder / INDEX, json.dumps(index, indent=2) + "\n")
