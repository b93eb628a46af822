"""Integrity of written weights: a checksum manifest, its verification on load, and safe index names.

    RUN/manifest.json = {"format_version": 1, "algorithm": "crc32",
                         "files": {"model.safetensors": {"bytes": n, "crc32": "1a2b3c4d"}, ...}}

Every weight file a run folder holds (``model.safetensors``, or its shards and
``model.safetensors.index.json``) is listed with its size and CRC-32 when the folder is written
(``train``, ``convert``); loading compares them before any tensor is used, so a flipped byte or a
truncated file is an error naming the file instead of a silently different model. A folder without a
manifest (older runs, folders written by other tools) loads unchecked.

Why CRC-32 and not SHA-256: the check guards against corruption (bit rot, a torn copy), not against
tampering, and it must be cheap on every load. Hashing a 500 MB file from the page cache on this
project's shared 2-core machine took 0.17 s with ``zlib.crc32``, 0.50 s with ``hashlib.sha256`` and
0.71 s with ``hashlib.blake2b`` (best of 3, load average 10.3; benchmarks/bench_checksum.py,
docs/benchmarks/integrity.md). CRC-32 detects every burst of
up to 32 flipped bits and any other random corruption with probability 1 - 2^-32; the size catches
truncation on its own.

Index files (``*.safetensors.index.json``) name their shards; :func:`checked_shard_names` refuses
absolute names and ``..`` so that an index can never make a load read a file outside the model folder.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from pathlib import Path, PurePosixPath, PureWindowsPath

from tinyformer.errors import CheckpointError
from tinyformer.utils.io import atomic_write_text

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
ALGORITHM = "crc32"
_CHUNK = 8 << 20


def bytes_checksum(data: bytes | memoryview) -> str:
    """CRC-32 of ``data`` as 8 hex digits."""
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def file_checksum(path: str | Path) -> str:
    """CRC-32 of a file's bytes as 8 hex digits, read in 8 MiB chunks (constant memory)."""
    crc = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def write_manifest(folder: str | Path, names: Iterable[str], known: dict[str, str] | None = None) -> None:
    """Record size and checksum of ``names`` (files in ``folder``) in ``folder/manifest.json``, atomically.

    ``known`` maps a name to a checksum already computed from the same bytes (no second read)."""
    folder = Path(folder)
    files = {}
    for name in sorted(set(names)):
        path = folder / name
        digest = (known or {}).get(name) or file_checksum(path)
        files[name] = {"bytes": path.stat().st_size, ALGORITHM: digest}
    manifest = {"format_version": MANIFEST_VERSION, "algorithm": ALGORITHM, "files": files}
    atomic_write_text(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def read_manifest(folder: str | Path) -> dict[str, dict[str, object]] | None:
    """The manifest's ``files`` entry, or None when the folder has no manifest."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        files = data["files"]
        if data.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"unknown algorithm {data.get('algorithm')!r}")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CheckpointError(f"{path} is not a readable weight manifest ({exc}); pass --no-verify to load "
                              "the weights unchecked") from None
    return files


def verify_files(folder: str | Path, paths: Iterable[Path]) -> None:
    """Compare each of ``paths`` with ``folder``'s manifest (size, then checksum); nothing to do without one.

    Raises CheckpointError naming the first file that differs from what was written."""
    folder = Path(folder)
    files = read_manifest(folder)
    if files is None:
        return
    for path in paths:
        entry = files.get(path.name)
        if not isinstance(entry, dict):
            raise CheckpointError(f"{path} is not listed in {folder / MANIFEST}: it was not written with this "
                                  "folder; pass --no-verify to load it unchecked")
        size = path.stat().st_size
        if size != entry.get("bytes"):
            raise CheckpointError(f"{path} has {size} bytes, {entry.get('bytes')} were written ({MANIFEST}): the "
                                  f"file is truncated or corrupt. {_fix_hint(folder)}")
        digest = file_checksum(path)
        if digest != entry.get(ALGORITHM):
            raise CheckpointError(f"{path} does not match the checksum recorded when it was written ({ALGORITHM} "
                                  f"{digest}, {MANIFEST} says {entry.get(ALGORITHM)}): the file is corrupt. "
                                  f"{_fix_hint(folder)}")


def _fix_hint(folder: Path) -> str:
    if (folder / "state").is_dir():
        return (f"`tinyformer train --resume {folder}` restores it from the latest checkpoint; "
                "--no-verify loads it anyway")
    return "Restore it from its source (or convert again); --no-verify loads it anyway"


def checked_shard_names(index: str | Path, names: Iterable[object]) -> list[str]:
    """The shard file names of a weight index, each checked to be a plain relative path inside the index's
    folder: absolute paths, drive letters and ``..`` are a CheckpointError naming the entry."""
    out = []
    for name in names:
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"{index} names a shard {name!r} that is not a file name")
        posix, windows = PurePosixPath(name), PureWindowsPath(name)
        if posix.is_absolute() or windows.is_absolute() or windows.drive or ".." in posix.parts \
                or ".." in windows.parts:
            raise CheckpointError(f"{index} names the shard {name!r}, which is outside the model folder; "
                                  "an index may only name files inside its folder")
        out.append(name)
    return sorted(set(out))
