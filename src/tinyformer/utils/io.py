"""Atomic file writes: nothing already on disk is replaced until the new content is complete.

Write to a temporary file in the same folder, fsync it, then ``os.replace`` it over the target
(atomic on POSIX and Windows); a crash at any point leaves either the old file or the new one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from tinyformer.errors import DataError, TinyformerError


@contextlib.contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``target``; on success it is fsynced and renamed onto it."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    # mkstemp makes the file private (0600); give it the mode a plain open() would (0666 minus umask)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_path, 0o666 & ~umask)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, target)
        fsync_dir(target.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def fsync_dir(folder: Path) -> None:
    """fsync a folder: a rename lives in the directory entry, so this makes it survive a power cut."""
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(target: str | Path, data: bytes) -> None:
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(target: str | Path, text: str) -> None:
    atomic_write_bytes(target, text.encode("utf-8"))


def atomic_write_with(target: str | Path, writer: Callable[[Path], None]) -> None:
    """Let ``writer(tmp_path)`` produce the file (e.g. safetensors.save_file), then commit it."""
    with atomic_path(target) as tmp:
        writer(tmp)


def read_utf8(path: str | Path, error: type[TinyformerError] = DataError, what: str = "") -> str:
    """The text of a UTF-8 file (a leading byte-order mark dropped). A file that cannot be read, or that is
    not UTF-8 text (binary, Latin-1), raises ``error`` naming it, so that the command line prints one line
    instead of a ``UnicodeDecodeError`` traceback."""
    p = Path(path)
    label = f"{what} {p}" if what else str(p)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise error(f"cannot read {label}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise error(f"{label} is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start} "
                    f"({exc.reason}); is it the right file?") from None
