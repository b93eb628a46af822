"""Tests for tinyformer.data.dataset: the token-file cache, batching, and sharding."""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tinyformer.data.dataset import (
    TokenDataset,
    encode_to_memmap,
    shard_range,
    split_for_encoding,
    token_dtype,
)
from tinyformer.data.tokenizer import Tokenizer, build_tokenizer
from tinyformer.errors import DataError


@pytest.fixture(scope="module")
def text() -> str:
    rng = random.Random(0)
    words = "the cat sat on a mat with 😀 and 世界; then    it ran\taway. Done!".split(" ")
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 15))) for _ in range(1500)]
    return "\n".join(lines) + "\n\n  trailing  \n"


@pytest.fixture(scope="module")
def char_tok(text: str) -> Tokenizer:
    return build_tokenizer("char", text + "XYZ", None)


@pytest.fixture(scope="module")
def bpe_tok(text: str) -> Tokenizer:
    return build_tokenizer("bpe", text, 300)


# ---------------------------------------------------------------- encoding and cache


def test_token_dtype_rule() -> None:
    assert token_dtype(100) == np.uint16
    assert token_dtype(65535) == np.uint16
    assert token_dtype(65536) == np.uint32


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_encode_matches_tokenizer(kind: str, text: str, char_tok: Tokenizer, bpe_tok: Tokenizer, tmp_path: Path):
    tok = char_tok if kind == "char" else bpe_tok
    path = encode_to_memmap(text, tok, tmp_path)
    assert path.parent == tmp_path and path.name.endswith("-uint16.bin")
    stored = np.fromfile(path, dtype=np.uint16)
    assert stored.tolist() == tok.encode(text)
    # Small chunks (fresh cache) give the same tokens: chunk boundaries do not change tokenization.
    small = encode_to_memmap(text, tok, tmp_path / "small", chunk_chars=500)
    assert np.array_equal(np.fromfile(small, dtype=np.uint16), stored)


def test_split_for_encoding_cuts_before_whitespace(text: str) -> None:
    pieces = split_for_encoding(text, 200)
    assert "".join(pieces) == text
    assert len(pieces) > len(text) // 200
    assert all(len(p) <= 200 for p in pieces)
    assert all(p[0].isspace() and not prev[-1].isspace() for prev, p in zip(pieces, pieces[1:]))


def test_uint32_for_large_vocab(tmp_path: Path) -> None:
    chars = "".join(chr(0x10000 + i) for i in range(70_000))  # no surrogates in this range
    tok = build_tokenizer("char", chars, None)
    assert tok.vocab_size == 70_003
    path = encode_to_memmap(chars[-10:] + chars[:5], tok, tmp_path)
    assert path.name.endswith("-uint32.bin")
    data = TokenDataset(path, val_fraction=0.0)
    assert data.tokens.dtype == np.uint32
    assert data.tokens.tolist() == [70_003 - 10 + i for i in range(10)] + [3, 4, 5, 6, 7]


def test_cache_hit_does_not_reencode(text: str, char_tok: Tokenizer, tmp_path: Path, monkeypatch) -> None:
    first = encode_to_memmap(text, char_tok, tmp_path)
    mtime = first.stat().st_mtime_ns

    def boom(*args, **kwargs):
        raise AssertionError("re-encoded on a cache hit")

    monkeypatch.setattr(char_tok, "encode_batch", boom)
    assert encode_to_memmap(text, char_tok, tmp_path) == first
    assert first.stat().st_mtime_ns == mtime
    monkeypatch.undo()

    other_text = encode_to_memmap(text + "X", char_tok, tmp_path)
    other_tok = encode_to_memmap(text, build_tokenizer("char", text + "XYZW", None), tmp_path)
    assert len({first, other_text, other_tok}) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (first, other_text, other_tok))


def test_failed_encode_leaves_no_file(char_tok: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="position"):
        encode_to_memmap("the cat \u2603", char_tok, tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DataError, match="no tokens"):
        encode_to_memmap("", char_tok, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_files_are_documents_joined_by_eos(bpe_tok: Tokenizer, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("the cat sat", encoding="utf-8")
    (corpus / "sub" / "b.md").write_text("on a mat 😀", encoding="utf-8")
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t}) for t in ["then it", "ran away"]), encoding="utf-8")

    path = encode_to_memmap([corpus, jsonl], bpe_tok, tmp_path / "cache")
    eos = bpe_tok.eos_id
    expected: list[int] = []
    for i, doc in enumerate(["the cat sat", "on a mat 😀", "then it", "ran away"]):
        expected += ([eos] if i else []) + bpe_tok.encode(doc)
    assert np.fromfile(path, dtype=np.uint16).tolist() == expected

    assert encode_to_memmap(corpus, bpe_tok, tmp_path / "cache") != path  # different content, new key
    # Changing a file's content changes the key even with the same names.
    (corpus / "a.txt").write_text("the cat ran", encoding="utf-8")
    assert encode_to_memmap([corpus, jsonl], bpe_tok, tmp_path / "cache") != path


# ---------------------------------------------------------------- batches


def test_split_ranges() -> None:
    data = TokenDataset(np.arange(1000), val_fraction=0.1)
    train, val = data.splits["train"], data.splits["val"]
    assert (train, val) == (range(0, 900), range(900, 1000))
    assert data.split(0.25) == (range(0, 750), range(750, 1000))
    assert data.split(0.0) == (range(0, 1000), range(1000, 1000))
    for bad in (-0.1, 1.0):
        with pytest.raises(DataError, match="val_fraction"):
            data.split(bad)


def test_get_batch_shapes_shift_and_bounds() -> None:
    data = TokenDataset(np.arange(5000, dtype=np.uint16), val_fraction=0.2)
    g = torch.Generator().manual_seed(0)
    for split, lo, hi in (("train", 0, 4000), ("val", 4000, 5000)):
        x, y = data.get_batch(split, 64, 16, g)
        assert x.shape == y.shape == (64, 16) and x.dtype == y.dtype == torch.int64
        # Tokens are their own positions, so each row must be a run of consecutive ints.
        assert torch.equal(x - x[:, :1], torch.arange(16).expand(64, 16))
        assert torch.equal(y, x + 1)
        assert x.min() >= lo and y.max() < hi  # the window never leaves its split


def test_get_batch_from_memmap_file(text: str, char_tok: Tokenizer, tmp_path: Path) -> None:
    data = TokenDataset(encode_to_memmap(text, char_tok, tmp_path))
    x, y = data.get_batch("train", 8, 32, torch.Generator().manual_seed(3))
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        assert char_tok.decode([*row_x, row_y[-1]]) in text  # x then y's last token is a span of the text


def test_get_batch_deterministic_and_resumable() -> None:
    data = TokenDataset(np.arange(10_000))
    a = [data.get_batch("train", 4, 8, torch.Generator().manual_seed(42)) for _ in range(2)]
    assert torch.equal(a[0][0], a[1][0])
    other = data.get_batch("train", 4, 8, torch.Generator().manual_seed(43))
    assert not torch.equal(a[0][0], other[0])

    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        data.get_batch("train", 4, 8, g)
    state = g.get_state()
    expected = [data.get_batch("train", 4, 8, g)[0] for _ in range(3)]
    resumed = torch.Generator()
    resumed.set_state(state)
    assert all(torch.equal(e, data.get_batch("train", 4, 8, resumed)[0]) for e in expected)


def test_get_batch_covers_every_start_uniformly() -> None:
    data = TokenDataset(np.arange(40), val_fraction=0.0)
    x, _ = data.get_batch("train", 20_000, 8, torch.Generator().manual_seed(0))
    counts = np.bincount(x[:, 0].numpy(), minlength=40)
    assert counts[:32].min() > 0 and counts[32:].sum() == 0  # starts 0..31: a window needs 9 tokens
    assert counts[:32].max() < 2 * counts[:32].min()  # 625 expected each


def test_get_batch_sharded() -> None:
    data = TokenDataset(np.arange(1003), val_fraction=0.0)
    g = torch.Generator().manual_seed(0)
    for rank in range(3):
        shard = shard_range(1003, rank, 3)
        x, y = data.get_batch("train", 256, 10, g, rank=rank, world_size=3)
        assert x.min() >= shard.start and y.max() < shard.stop


def test_iter_eval_batches() -> None:
    data = TokenDataset(np.arange(1000), val_fraction=0.2)
    batches = list(data.iter_eval_batches("val", 3, 16))
    xs = torch.cat([x for x, _ in batches])
    ys = torch.cat([y for _, y in batches])
    n_windows = (200 - 1) // 16
    assert xs.shape == (n_windows, 16) and [len(x) for x, _ in batches] == [3, 3, 3, 3]
    assert torch.equal(xs.flatten(), torch.arange(800, 800 + n_windows * 16))  # in order, no overlap
    assert torch.equal(ys, xs + 1)
    assert len(list(data.iter_eval_batches("val", 3, 16, max_batches=2))) == 2
    # Ranks read disjoint parts.
    firsts = [next(data.iter_eval_batches("val", 1, 16, rank=r, world_size=2))[0][0, 0].item() for r in (0, 1)]
    assert firsts == [800, 900]


def test_too_small_split_suggests_block_size() -> None:
    data = TokenDataset(np.arange(100), val_fraction=0.1)
    with pytest.raises(DataError, match=r"'val' split has 10 tokens.*block_size <= 9") as info:
        data.get_batch("val", 2, 64, torch.Generator())
    fit = int(re.search(r"block_size <= (\d+)", str(info.value)).group(1))
    assert data.get_batch("val", 2, fit, torch.Generator())[0].shape == (2, fit)
    with pytest.raises(DataError, match=r"rank 1 of 4\) has 23 tokens"):
        data.get_batch("train", 2, 64, torch.Generator(), rank=1, world_size=4)
    with pytest.raises(DataError, match="unknown split 'test'"):
        data.get_batch("test", 2, 4, torch.Generator())
    with pytest.raises(DataError, match="block_size"):
        list(data.iter_eval_batches("train", 2, 90))


def test_token_file_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        TokenDataset(tmp_path / "tokens-x-uint16.bin")
    odd = tmp_path / "tokens-x-uint16.bin"
    odd.write_bytes(b"\x00\x01\x02")
    with pytest.raises(DataError, match="3 bytes"):
        TokenDataset(odd)
    unnamed = tmp_path / "tokens.bin"
    np.arange(10, dtype=np.uint32).tofile(unnamed)
    with pytest.raises(DataError, match="dtype"):
        TokenDataset(unnamed)
    assert TokenDataset(unnamed, dtype="uint32", val_fraction=0.0).tokens.tolist() == list(range(10))


def test_shard_range_disjoint_and_covering() -> None:
    for n in (0, 1, 7, 100, 1001):
        for world in (1, 2, 3, 8):
            shards = [shard_range(n, r, world) for r in range(world)]
            assert [i for s in shards for i in s] == list(range(n))  # disjoint, covering, in order
            assert max(map(len, shards)) - min(map(len, shards)) <= 1
    for rank, world in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(DataError, match="world_size"):
            shard_range(10, rank, world)


def test_no_temp_files_left(text: str, char_tok: Tokenizer, tmp_path: Path) -> None:
    encode_to_memmap(text, char_tok, tmp_path)
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []
