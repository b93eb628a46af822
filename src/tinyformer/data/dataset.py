"""Token files and batches: encode a corpus once to a flat memmap, then sample (x, y) windows from it.

The token file is a raw little-endian array of ids (``uint16`` when ``vocab_size <= 65535``, else
``uint32``) named ``tokens-<hash>-<dtype>.bin``, where the hash covers the corpus content and the
``tokenizer.json`` text, so a changed corpus or tokenizer gets a new file and an unchanged one is
reused. When the corpus is a set of files, documents (files, JSONL records) are joined with the
tokenizer's EOS id *between* them (none before the first or after the last; nothing when the
tokenizer has no EOS); a corpus given as one string is one document.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from tinyformer.data.corpus import iter_corpus_files, iter_documents
from tinyformer.data.tokenizer import Tokenizer
from tinyformer.errors import DataError
from tinyformer.utils.io import fsync_dir

_CACHE_VERSION = b"tinyformer-tokens-v1"
CHUNK_CHARS = 1 << 18  # characters encoded per call: bounds memory and feeds tokenizers' threads
_BATCH_CHARS = 1 << 23  # characters handed to one encode_batch call


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (``vocab_size <= 65535``), else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def split_for_encoding(text: str, chunk_chars: int = CHUNK_CHARS) -> list[str]:
    """Cut ``text`` into pieces of at most ~``chunk_chars`` characters that encode like the whole.

    Each cut is placed where a run of whitespace starts (a newline if possible, else a space or
    tab) in the second half of the window. GPT-2's pre-tokenizer regex never joins a non-blank
    character with the whitespace after it, and a whitespace run is tokenized the same whatever
    preceded it, so for byte-level BPE (and trivially for the char tokenizer) the encoded pieces
    concatenate to the encoding of ``text``. A window without whitespace is cut hard.
    """
    pieces: list[str] = []
    start, n = 0, len(text)
    while n - start > chunk_chars:
        cut = _find_cut(text, start + chunk_chars // 2, start + chunk_chars)
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _find_cut(text: str, lo: int, hi: int) -> int:
    """The last position in (lo, hi) that starts a whitespace run, preferring newlines; else ``hi``."""
    for sep in ("\n", " ", "\t"):
        pos = text.rfind(sep, lo, hi)
        while pos > lo:
            if not text[pos - 1].isspace():
                return pos
            pos = text.rfind(sep, lo, pos)
    return hi


def _cache_key(tokenizer: Tokenizer, text: str | None, files: list[Path], text_field: str) -> str:
    h = hashlib.sha256(_CACHE_VERSION)
    tok = tokenizer.to_json().encode()
    h.update(len(tok).to_bytes(8, "little") + tok)
    if text is not None:
        h.update(b"text\0" + text.encode("utf-8", "surrogatepass"))
        return h.hexdigest()
    h.update(b"files\0" + text_field.encode() + b"\0")
    for file in files:
        # Length-prefixed, so moving bytes from one file to the next (a new EOS position) changes the key.
        h.update(file.stat().st_size.to_bytes(8, "little") + file.suffix.lower().encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda f=f: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def encode_to_memmap(source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], tokenizer: Tokenizer,
                     cache_dir: str | os.PathLike[str], *, text_field: str = "text",
                     chunk_chars: int = CHUNK_CHARS) -> Path:
    """Encode a corpus once into ``cache_dir/tokens-<hash>-<dtype>.bin`` and return its path.

    ``source`` is corpus text when it is a ``str``; a ``Path`` (file, folder or glob) or a list
    of paths names files, read with :func:`~tinyformer.data.corpus.iter_documents`. An existing
    file for the same content and tokenizer is returned without encoding. The file is written to
    a temporary name, fsynced and renamed, so a crash never leaves a partial cache file.
    """
    text = source if isinstance(source, str) else None
    paths = [] if text is not None else [source] if isinstance(source, os.PathLike) else source
    files = [f for path in paths for f in iter_corpus_files(path)]
    dtype = token_dtype(tokenizer.vocab_size)
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"tokens-{_cache_key(tokenizer, text, files, text_field)[:24]}-{dtype.name}.bin"
    if out.is_file():
        return out

    documents: Iterable[str] = [text] if text is not None else (d for f in files for d in iter_documents(f, text_field))
    eos = tokenizer.eos_id
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=".tokens-", suffix=".tmp")
    total = 0
    try:
        with os.fdopen(fd, "wb") as f:

            def flush(batch: list[tuple[bool, str]]) -> int:
                ids: list[int] = []
                for (new_doc, _), chunk_ids in zip(batch, tokenizer.encode_batch([c for _, c in batch])):
                    if new_doc and eos is not None:
                        ids.append(eos)
                    ids.extend(chunk_ids)
                f.write(np.asarray(ids, dtype=dtype).tobytes())
                return len(ids)

            batch: list[tuple[bool, str]] = []
            size = 0
            # (starts a new document, chunk) pairs; the first document is not marked as new
            for item in ((i > 0 and j == 0, chunk) for i, doc in enumerate(documents)
                         for j, chunk in enumerate(split_for_encoding(doc, chunk_chars))):
                batch.append(item)
                size += len(item[1])
                if size >= _BATCH_CHARS:
                    total += flush(batch)
                    batch, size = [], 0
            total += flush(batch)
            f.flush()
            os.fsync(f.fileno())
        if total == 0:
            raise DataError(f"corpus {source if text is None else '(text)'} encodes to no tokens; is it empty?")
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # a cache: making the rename durable is best effort
        fsync_dir(cache)
    return out


def shard_range(n: int, rank: int, world_size: int) -> range:
    """The ``rank``-th of ``world_size`` disjoint contiguous ranges covering ``range(n)``.

    Shard ``r`` is ``[floor(n·r/W), floor(n·(r+1)/W))``: sizes differ by at most one.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise DataError(f"rank {rank} / world_size {world_size} is invalid: need world_size >= 1 and 0 <= rank < "
                        "world_size")
    return range(n * rank // world_size, n * (rank + 1) // world_size)


class TokenDataset:
    """A flat array of token ids, split into train/val, with random and sequential batching.

    ``source`` is a token file from :func:`encode_to_memmap` (opened as a read-only memmap; the
    dtype is read from the ``-uint16.bin``/``-uint32.bin`` suffix unless given) or an in-memory
    integer array.
    """

    def __init__(self, source: str | os.PathLike[str] | np.ndarray, dtype: np.dtype | str | None = None,
                 val_fraction: float = 0.1) -> None:
        if isinstance(source, np.ndarray):
            self.path = None
            self.tokens = source.reshape(-1)
        else:
            self.path = Path(source)
            self.tokens = _open_memmap(self.path, dtype)
        self.splits: dict[str, range] = {}
        self.split(val_fraction)

    def __len__(self) -> int:
        return len(self.tokens)

    def split(self, val_fraction: float) -> tuple[range, range]:
        """Set and return the (train, val) index ranges: the first ``n - round(f·n)`` tokens, then the rest.

        Both are contiguous, so no training window ever contains a validation token.
        """
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"val_fraction {val_fraction} must be in [0, 1)")
        n = len(self.tokens)
        n_train = n - round(n * val_fraction)
        self.splits = {"train": range(0, n_train), "val": range(n_train, n)}
        return self.splits["train"], self.splits["val"]

    def _window_range(self, split: str | range, block_size: int, rank: int, world_size: int) -> range:
        """This rank's shard of ``split``, checked to hold a window of ``block_size + 1`` tokens."""
        if isinstance(split, range):
            whole, name = split, "range"
        elif split in self.splits:
            whole, name = self.splits[split], f"{split!r} split"
        else:
            raise DataError(f"unknown split {split!r}; use one of {sorted(self.splits)}")
        if block_size < 1:
            raise DataError(f"block_size {block_size} must be >= 1")
        part = shard_range(len(whole), rank, world_size)
        part = range(whole.start + part.start, whole.start + part.stop)
        if len(part) < block_size + 1:
            where = f"{name} (rank {rank} of {world_size})" if world_size > 1 else name
            fit = f"use block_size <= {len(part) - 1}" if len(part) > 1 else "use a larger corpus"
            raise DataError(f"{where} has {len(part)} tokens, too few for block_size {block_size} (a window needs "
                            f"block_size + 1 tokens); {fit}, or change val_fraction / add data")
        return part

    def _windows(self, starts: np.ndarray, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + np.arange(block_size + 1)
        window = torch.from_numpy(np.asarray(self.tokens[idx]).astype(np.int64))
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def get_batch(self, split: str | range, batch_size: int, block_size: int, generator: torch.Generator | None = None,
                  rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``batch_size`` windows uniformly from this rank's shard of ``split``.

        Returns int64 ``(x, y)`` of shape (B, T) with ``y[b, t] = x[b, t + 1]`` (the next token).
        Window starts are ``torch.randint`` draws from ``generator``, so a seeded generator gives
        the same batches and saving/restoring its state resumes the data stream exactly.
        """
        part = self._window_range(split, block_size, rank, world_size)
        starts = torch.randint(0, len(part) - block_size, (batch_size,), generator=generator).numpy()
        return self._windows(starts + part.start, block_size)

    def iter_eval_batches(self, split: str | range, batch_size: int, block_size: int, rank: int = 0,
                          world_size: int = 1, max_batches: int | None = None
                          ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Non-overlapping windows from the start of this rank's shard, in order (last batch may be smaller).

        Window ``k`` covers tokens ``[k·T, k·T + T]``; there are ``(len(shard) - 1) // T`` of them.
        """
        part = self._window_range(split, block_size, rank, world_size)
        starts = np.arange(part.start, part.stop - block_size, block_size)
        for i, b in enumerate(range(0, len(starts), batch_size)):
            if max_batches is not None and i >= max_batches:
                return
            yield self._windows(starts[b : b + batch_size], block_size)


def _open_memmap(path: Path, dtype: np.dtype | str | None) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"token file {path} does not exist; create it with encode_to_memmap")
    if dtype is None:
        suffix = path.stem.rsplit("-", 1)[-1]
        if suffix not in ("uint16", "uint32"):
            raise DataError(f"cannot tell the dtype of token file {path}: name it *-uint16.bin/*-uint32.bin or pass "
                            "dtype")
        dtype = suffix
    dt = np.dtype(dtype)
    size = path.stat().st_size
    if size == 0 or size % dt.itemsize:
        raise DataError(f"token file {path} has {size} bytes, not a positive multiple of {dt.itemsize} ({dt.name})")
    return np.memmap(path, dtype=dt, mode="r")
