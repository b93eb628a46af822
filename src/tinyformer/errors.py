"""User-facing error types.

A :class:`TinyformerError` is a mistake in what the user asked for (a bad config field, a missing
file, an impossible sampler value). The command line prints its message on one line to stderr and
exits non-zero, without a traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class TinyformerError(Exception):
    """User-facing error: the CLI prints its message on one line and exits non-zero."""


class ConfigError(TinyformerError, ValueError):
    """A config field has an invalid value; the message names the field."""


class DataError(TinyformerError):
    """A corpus, tokenizer or data file cannot be used; the message names the file."""


class CheckpointError(TinyformerError):
    """A run folder or checkpoint is missing, corrupt or does not match the config."""


class GenerationError(TinyformerError, ValueError):
    """A prompt or sampler value cannot be used for generation."""


class TemplateLimitError(GenerationError):
    """A chat template ran past its time limit or its size limit while rendering; the message names which."""


class NonFiniteOutputError(TinyformerError):
    """The model's outputs (logits, loss) hold NaN or inf: its weights are corrupt or overflow in this dtype."""


def non_finite_message(where: str) -> str:
    """The one explanation shared by generate, chat, eval and serve."""
    return (f"the model produced non-finite logits (NaN or inf) {where}: its weights are corrupt or overflow in "
            "this dtype; check the run folder (a training run: tinyformer train --resume RUN republishes its "
            "checkpoint) or try --dtype float32")


class OutputError(TinyformerError):
    """A file or folder cannot be written: the disk is full or read-only, a file stands where a folder is
    needed, permission is denied. The message names the path and the system's reason."""


#: errno values that describe the machine (its disks, its limits), not a bug: the CLI prints them on one line
ENVIRONMENT_ERRNOS = frozenset({"ENOSPC", "EDQUOT", "EROFS", "EACCES", "EPERM", "ENOTDIR", "EEXIST", "EISDIR",
                                "ENAMETOOLONG", "EMFILE", "ENFILE", "EIO", "EFBIG", "ELOOP", "EXDEV", "ENOENT"})


def environment_error_message(exc: OSError) -> str | None:
    """One line for an OSError that the disk or the system caused (``[Errno 28] No space left on device``
    while writing a run folder), naming the path; None for any other OSError (a bug: keep its traceback)."""
    import errno

    name = errno.errorcode.get(exc.errno or -1)
    if name not in ENVIRONMENT_ERRNOS:
        return None
    paths = " -> ".join(str(p) for p in (exc.filename, exc.filename2) if p is not None)
    where = f" {paths}" if paths else ""
    if name in ("EEXIST", "ENOTDIR") and exc.filename is not None:
        from pathlib import Path

        path = Path(str(exc.filename))
        blocker = next((p for p in (path, *path.parents) if p.is_file()), None)
        if blocker is not None:
            return f"cannot create a folder at {path}: {blocker} is a file, not a folder"
    verb = "write" if name in ("ENOSPC", "EDQUOT", "EROFS", "EFBIG", "EIO") else "access"
    full = "; free some space and run the command again (what was on disk is unchanged)"
    hint = {"ENOSPC": full, "EDQUOT": full, "EROFS": " (the disk or folder is mounted read-only)"}.get(name, "")
    return f"cannot {verb}{where}: {exc.strerror or exc} ({name}){hint}"
