"""`--data tinyshakespeare`: a named data set, downloaded once into the cache and checked by SHA-256.
No test downloads: the cache is pointed at a copy of the shared file, and `urlopen` is replaced."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tinyformer.data.corpus import iter_corpus_files
from tinyformer.data.named import NAMED_DATASETS, dataset_path
from tinyformer.errors import DataError

# ../shared/data next to the repository, as the other tests and benchmarks read it ($TINYFORMER_SHARED_DATA
# names another copy of that folder, e.g. for a git worktree that is not next to it)
SHARED = Path(os.environ.get("TINYFORMER_SHARED_DATA") or Path(__file__).resolve().parents[3] / "shared" / "data") \
    / "tinyshakespeare" / "input.txt"
SPEC = NAMED_DATASETS["tinyshakespeare"]
needs_shared = pytest.mark.skipif(not SHARED.is_file(), reason=f"{SHARED} is not there")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def no_network(*args, **kwargs):
    raise urllib.error.URLError("no network in tests")


def serving(data: bytes):
    def urlopen(url, timeout=None):
        assert url == SPEC.url
        return io.BytesIO(data)

    return urlopen


@needs_shared
def test_recorded_checksum_and_size_are_the_shared_files():
    data = SHARED.read_bytes()
    assert hashlib.sha256(data).hexdigest() == SPEC.sha256 and len(data) == SPEC.size


@needs_shared
def test_a_file_in_the_cache_is_used_without_the_network(cache, monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    target = cache / "datasets" / "tinyshakespeare" / "input.txt"
    assert dataset_path("tinyshakespeare") == target
    target.parent.mkdir(parents=True)
    shutil.copyfile(SHARED, target)
    assert iter_corpus_files("tinyshakespeare") == [target]


@needs_shared
def test_first_use_downloads_checks_and_keeps_the_file(cache, monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", serving(SHARED.read_bytes()))
    (path,) = iter_corpus_files("tinyshakespeare")
    assert path.read_bytes() == SHARED.read_bytes()
    monkeypatch.setattr(urllib.request, "urlopen", no_network)  # the second use reads the cache
    assert iter_corpus_files("tinyshakespeare") == [path]


def test_offline_machine_is_told_where_to_put_the_file(cache, monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    with pytest.raises(DataError) as info:
        iter_corpus_files("tinyshakespeare")
    message = str(info.value)
    assert str(dataset_path("tinyshakespeare")) in message and SPEC.sha256 in message and SPEC.url in message


def test_a_download_with_the_wrong_checksum_keeps_nothing(cache, monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", serving(b"First Citizen:\nnot the real file\n"))
    with pytest.raises(DataError, match="does not match its recorded sha256"):
        iter_corpus_files("tinyshakespeare")
    folder = dataset_path("tinyshakespeare").parent
    assert not folder.exists() or not any(folder.iterdir())


def test_a_wrong_file_in_the_cache_is_refused(cache, monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    target = dataset_path("tinyshakespeare")
    target.parent.mkdir(parents=True)
    target.write_text("something else")
    with pytest.raises(DataError, match="is not the tinyshakespeare data set"):
        iter_corpus_files("tinyshakespeare")


@needs_shared
def test_train_reads_the_named_data_set(cache, monkeypatch):
    from tinyformer.training.prepare import train_tokenizer
    from tinyformer.training.train_config import TrainConfig

    monkeypatch.setattr(urllib.request, "urlopen", serving(SHARED.read_bytes()))
    tok = train_tokenizer(TrainConfig(data="tinyshakespeare", tokenizer="char"))
    assert tok.vocab_size == len(set(SHARED.read_text(encoding="utf-8"))) + 3  # 65 characters + 3 specials
