"""From a TrainConfig to a tokenizer and a token dataset: corpus -> tokenizer -> memmapped token file.

    data = None        the built-in corpus (CPython's help texts and docstrings, ~2 M characters)
    data = PATH        a file, a folder of .txt/.md, a glob, or .jsonl (``text_field`` of each line)
    data = "hf:NAME"   a Hugging Face dataset (needs the optional ``datasets`` package)

Files are streamed twice (once to train the tokenizer, once to encode), never held whole, so a
corpus larger than memory works; the encoded token file is cached by corpus content and
tokenizer (see :func:`tinyformer.data.dataset.encode_to_memmap`) and reused by later runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from tinyformer.data.corpus import builtin_corpus, iter_documents, load_corpus
from tinyformer.data.dataset import TokenDataset, encode_to_memmap
from tinyformer.data.named import default_cache_dir
from tinyformer.data.tokenizer import BPE_MIN_VOCAB, DEFAULT_BPE_VOCAB_SIZE, Tokenizer
from tinyformer.errors import DataError, TinyformerError
from tinyformer.training.train_config import TOKENIZER_KINDS, TrainConfig


def corpus_name(cfg: TrainConfig) -> str:
    return cfg.data if cfg.data is not None else "the built-in corpus"


def _in_memory(cfg: TrainConfig) -> bool:
    return cfg.data is None or cfg.data.startswith("hf:")


def _documents(cfg: TrainConfig) -> Iterator[str]:
    if _in_memory(cfg):
        yield load_corpus(cfg.data, cfg.text_field) if cfg.data else builtin_corpus()
    else:
        yield from iter_documents(cfg.data, cfg.text_field)


class _NonEmpty:
    """Pass documents through while noting whether any holds non-whitespace text, and keep the error that
    stopped reading them: the BPE trainer consumes them in Rust, which turns a Python exception into an
    early end of input (or its own error), and the user must see the real reason, not "empty corpus"."""

    def __init__(self, docs: Iterable[str]) -> None:
        self.docs, self.seen_text = docs, False
        self.error: TinyformerError | None = None

    def __iter__(self) -> Iterator[str]:
        try:
            for doc in self.docs:
                if not self.seen_text and doc.strip():
                    self.seen_text = True
                yield doc
        except TinyformerError as exc:
            self.error = exc
            raise


def _chunks(docs: Iterable[str], size: int = 1 << 16) -> Iterator[str]:
    for doc in docs:
        for start in range(0, len(doc), size):
            yield doc[start : start + size]


def train_tokenizer(cfg: TrainConfig) -> Tokenizer:
    """Train the run's tokenizer on its corpus ("char" or "bpe"), or load one (a tokenizer.json path)."""
    if cfg.tokenizer not in TOKENIZER_KINDS:
        path = Path(cfg.tokenizer)
        if not path.exists():
            raise DataError(f"--tokenizer {cfg.tokenizer!r} is neither one of {', '.join(TOKENIZER_KINDS)} nor an "
                            "existing tokenizer.json (or a folder holding one)")
        return Tokenizer.load(path)
    docs = _NonEmpty(_documents(cfg))
    if cfg.tokenizer == "char":
        chars: set[str] = set()
        for doc in docs:
            chars.update(doc)
        if not docs.seen_text:
            raise DataError(f"corpus {corpus_name(cfg)} is empty (no non-whitespace text)")
        if cfg.sample_tokens > 0:  # the samples start from this prompt ("\n"): a one-line corpus lacks it
            chars.update(cfg.sample_prompt)
        return Tokenizer.train_char("".join(sorted(chars)))
    vocab = cfg.vocab_size or DEFAULT_BPE_VOCAB_SIZE
    if vocab < BPE_MIN_VOCAB:  # before reading the corpus: the size, not the data, is the problem
        raise DataError(f"--vocab-size {vocab} is too small for a byte-level BPE: the minimum is {BPE_MIN_VOCAB} "
                        f"(256 byte tokens + {BPE_MIN_VOCAB - 256} special tokens), plus the merges it learns")
    try:
        tok = Tokenizer.train_bpe(_chunks(docs), vocab)
    except Exception:
        if docs.error is not None:
            raise docs.error from None
        if not docs.seen_text:
            raise DataError(f"corpus {corpus_name(cfg)} is empty (no non-whitespace text)") from None
        raise
    if docs.error is not None:
        raise docs.error
    if not docs.seen_text:
        raise DataError(f"corpus {corpus_name(cfg)} is empty (no non-whitespace text)")
    return tok


def check_sample_prompt(cfg: TrainConfig, tokenizer: Tokenizer) -> None:
    """Before step 1: the prompt the samples start from must be encodable (a char tokenizer trained
    elsewhere, or a run resumed, may lack its characters), else the run would fail at its first sample."""
    if cfg.sample_tokens <= 0:
        return
    try:
        tokenizer.encode(cfg.sample_prompt)
    except DataError as exc:
        raise DataError(f"the sample prompt {cfg.sample_prompt!r} cannot be encoded: {exc}; pass --train.sample_prompt "
                        "TEXT with characters of the corpus, or --sample-tokens 0") from None


def build_dataset(cfg: TrainConfig, tokenizer: Tokenizer) -> TokenDataset:
    """Encode the corpus (or reuse its cached token file) and split it into train and val."""
    source: str | Path = load_corpus(cfg.data, cfg.text_field) if _in_memory(cfg) else Path(cfg.data)
    cache = (Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()) / "tokens"
    path = encode_to_memmap(source, tokenizer, cache, text_field=cfg.text_field)
    return TokenDataset(path, val_fraction=cfg.val_fraction)


def check_windows(dataset: TokenDataset, block_size: int, world_size: int = 1) -> None:
    """Fail early, with the data layer's clear message, when a split is too short for one window."""
    generator = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        if split == "val" and not len(dataset.splits["val"]):
            continue
        for rank in range(world_size):
            dataset.get_batch(split, 1, block_size, generator, rank, world_size)
