"""Named data sets: ``--data tinyshakespeare`` is downloaded once, checked, and kept in the user's cache.

    name              file                      source (canonical public URL)
    tinyshakespeare   input.txt, 1,115,394 B    karpathy/char-rnn (the file nanoGPT's recipes use)

The file lives at ``CACHE/datasets/NAME/FILE`` with CACHE = ``$TINYFORMER_CACHE``, else
``$XDG_CACHE_HOME/tinyformer`` (``~/.cache/tinyformer``), the cache the token files use. On first use it
is downloaded to a temporary file, its SHA-256 compared with the one recorded here, and only then
renamed into place; a file already there is checked the same way on every use (1 MB hashes in ~2 ms).
An offline machine gets one line saying where to put the file; a copy placed there by hand (or a cache
pointed at a folder that holds it, as the tests do with ``$TINYFORMER_CACHE``) is used without any
network access. A local path of the same name (a file or folder called ``tinyshakespeare``) wins.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tinyformer.errors import DataError
from tinyformer.utils.io import atomic_path


@dataclass(frozen=True)
class NamedDataset:
    url: str
    filename: str
    sha256: str
    size: int


NAMED_DATASETS: dict[str, NamedDataset] = {
    "tinyshakespeare": NamedDataset(
        url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        filename="input.txt",
        sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
        size=1_115_394,
    ),
}

DOWNLOAD_TIMEOUT_S = 30.0


def default_cache_dir() -> Path:
    """``$TINYFORMER_CACHE`` or ``$XDG_CACHE_HOME/tinyformer`` (``~/.cache/tinyformer``)."""
    if os.environ.get("TINYFORMER_CACHE"):
        return Path(os.environ["TINYFORMER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tinyformer"


def dataset_path(name: str) -> Path:
    """Where the named data set's file is kept (it may not exist yet)."""
    return default_cache_dir() / "datasets" / name / NAMED_DATASETS[name].filename


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_named(name: str) -> Path:
    """The checked local file of data set ``name``, downloaded into the cache on first use."""
    spec = NAMED_DATASETS[name]
    target = dataset_path(name)
    if target.is_file():
        got = _sha256(target)
        if got != spec.sha256:
            raise DataError(f"{target} is not the {name} data set (sha256 {got[:12]}..., expected "
                            f"{spec.sha256[:12]}...); delete it to download it again, or put the right file there")
        return target
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(spec.url, timeout=DOWNLOAD_TIMEOUT_S) as response, atomic_path(target) as tmp:
            with open(tmp, "wb") as f:
                shutil.copyfileobj(response, f)
            got = _sha256(tmp)
            if got != spec.sha256:  # leaving the block by an error discards the temporary file
                raise DataError(f"the download of {name} from {spec.url} does not match its recorded sha256 "
                                f"({got[:12]}... instead of {spec.sha256[:12]}...); nothing was kept")
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise DataError(f"cannot download the {name} data set from {spec.url} ({reason}); on a machine without "
                        f"network access, put that file ({spec.size:,} bytes, sha256 {spec.sha256}) at {target}") \
            from None
    return target
