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

from tinyformer.errors import DataError, OutputError, TinyformerError


def make_folder(folder: str | Path) -> Path:
    """``mkdir -p folder``, with a one-line :class:`OutputError` when a file stands where a folder is needed
    (``--out notes.txt/run``) or the disk refuses (read-only, full)."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), folder)
        raise OutputError(f"cannot create the folder {folder}: {blocker} is a file, not a folder") from None
    except OSError as exc:
        raise OutputError(f"cannot create the folder {folder}: {exc.strerror or exc}") from None
    return folder


def _write_failure(target: Path, exc: BaseException) -> OutputError | None:
    """A one-line error for a write that the disk refused, raised by a library that hides the errno
    (numpy's ``tofile``: "8192 requested and 4928 written"; safetensors' ``SafetensorError``)."""
    if type(exc).__name__ == "SafetensorError" or (isinstance(exc, OSError) and exc.errno is None):
        import shutil

        try:
            full = shutil.disk_usage(target.parent).free < 2**20
        except OSError:
            full = False
        reason = "No space left on device (ENOSPC)" if full else "is the disk full?"
        return OutputError(f"cannot write {target}: {' '.join(str(exc).split())} ({reason}); what was on disk "
                           "is unchanged")
    return None


@contextlib.contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``target``; on success it is fsynced and renamed onto it."""
    target = Path(target)
    make_folder(target.parent)
    remove_stale_temporaries(target, ".tmp")
    fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(target), suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp's file is private (0600); give it the mode open() would
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, target)
        fsync_dir(target.parent)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        failure = _write_failure(target, exc)
        if failure is not None:
            raise failure from None
        raise


def _umask() -> int:
    """The process's umask (reading it means setting it: it is set back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def staging_folder(target: Path, suffix: str = "", infix: str = "") -> Path:
    """A new empty hidden folder ``.NAME.<infix>PID-<random><suffix>`` next to ``target``, once those that killed
    writers left are removed, with the mode a plain mkdir gives it (mkdtemp's folder is private)."""
    make_folder(target.parent)
    remove_stale_temporaries(target, suffix, infix)
    staging = Path(tempfile.mkdtemp(prefix=temporary_prefix(target, infix), suffix=suffix, dir=target.parent))
    os.chmod(staging, 0o777 & ~_umask())
    return staging


def replace_folder(staging: Path, target: Path, old: Path) -> None:
    """Rename the complete folder ``staging`` to ``target``; a ``target`` already there is first renamed to
    ``old``, and deleted once the new one is in place."""
    import shutil

    if target.exists():
        target.rename(old)
    staging.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def temporary_prefix(target: Path, infix: str = "") -> str:
    """``.NAME.<infix>PID-``: the start of a temporary's name next to ``target``, naming the process writing it."""
    return f".{target.name}.{infix}{os.getpid()}-"


def _writer_alive(path: Path, target: Path, infix: str) -> bool | None:
    """Whether the process named in a temporary's name (``.NAME.<infix>PID-...``) still runs; None if none is
    named."""
    pid = path.name[len(target.name) + 2 + len(infix):].partition("-")[0]
    if not pid.isdigit():
        return None
    try:  # signal 0: a check that the process exists (this one included)
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: alive, another user's
        return True
    return True


def remove_stale_temporaries(target: Path, suffix: str, infix: str = "") -> None:
    """Remove the hidden temporaries ``.NAME.<infix>PID-<random>SUFFIX`` that an earlier write of ``target`` left
    when it was killed (SIGKILL runs no cleanup): those whose process is gone, and those that name no process
    and are untouched for ``STALE_AFTER_S`` (a staging folder: it and the files in it)."""
    import glob
    import shutil
    import time

    try:
        leftovers = list(target.parent.glob(f".{glob.escape(target.name)}.{infix}*{suffix}"))
    except OSError:
        return
    for path in leftovers:
        try:
            alive = _writer_alive(path, target, infix)
            touched = max([path.lstat().st_mtime, *(p.lstat().st_mtime for p in path.iterdir())]
                          if path.is_dir() and not path.is_symlink() else [path.lstat().st_mtime])
            if alive or (alive is None and time.time() - touched < STALE_AFTER_S):
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink()
        except OSError:
            continue


#: a temporary that names no writer and is untouched this long is left over (writers touch theirs as they write)
STALE_AFTER_S = 60.0


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


def check_utf8_arguments(argv: list[str]) -> None:
    """Refuse a command-line argument holding a byte that is not UTF-8 (a file name in Latin-1: Python
    carries it as a lone surrogate): it would be accepted, trained on for hours, and then fail to be
    written into report.md or a plot title. One line naming the argument and the byte, before any work."""
    for arg in argv:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as exc:
            raw = arg.encode("utf-8", "surrogateescape")
            shown = raw.decode("utf-8", "replace")
            raise DataError(f"the argument {shown!r} is not UTF-8 text (byte 0x{raw[exc.start]:02x}): "
                            "rename the file or folder, or choose another name") from None


@contextlib.contextmanager
def folder_lock(folder: str | Path, what: str = "run folder") -> Iterator[Path]:
    """Hold an advisory lock on ``folder`` (which need not exist yet) while a process writes it: the lock
    file ``.NAME.lock`` next to it holds the writer's pid and host, and a second writer gets a one-line
    :class:`~tinyformer.errors.CheckpointError` naming them instead of interleaving its records with theirs.

    The lock is an ``flock`` on that file, so the kernel releases it when the holder dies however it dies
    (SIGKILL included): a lock file left by a dead process is simply taken over. It is removed on exit.
    (Platforms without ``fcntl``, i.e. Windows, run unlocked.)"""
    import socket

    from tinyformer.errors import CheckpointError

    folder = Path(folder)
    try:
        import fcntl
    except ModuleNotFoundError:
        yield folder
        return
    make_folder(folder.parent)
    lock = folder.parent / f".{folder.name}.lock"
    for _ in range(10):  # retried only if the file was removed between our open and our flock
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode("utf-8", "replace").split()
            os.close(fd)
            who = f"process {holder[0]} on {holder[1]}" if len(holder) >= 2 else "another process"
            raise CheckpointError(f"{what} {folder} is being written by {who} (lock file {lock}); wait for it to "
                                  "finish or stop it, then run this again") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    else:
        raise CheckpointError(f"cannot lock {what} {folder}: its lock file {lock} keeps changing")
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        yield folder
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()  # before the unlock: a writer that opens the path next gets a fresh file
        os.close(fd)  # releases the flock


def report_or_warning(write: Callable[[], object]) -> str | None:
    """``write()`` a report card and return its path; a card that cannot be written (a read-only or full
    disk) is a warning on stderr, not an error: the command has printed its figures already."""
    import sys

    from tinyformer.errors import environment_error_message

    try:
        path = write()
    except (OSError, OutputError) as exc:
        reason = (environment_error_message(exc) if isinstance(exc, OSError) else None) or str(exc)
        print(f"warning: the report card was not updated: {reason}", file=sys.stderr)
        return None
    return None if path is None else str(path)
