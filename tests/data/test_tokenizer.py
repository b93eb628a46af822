"""Tests for tinyformer.data.tokenizer: char and byte-level BPE tokenizers and loading tokenizer.json."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from tinyformer.data.tokenizer import BOS, EOS, PAD, Tokenizer, build_tokenizer, byte_level_decoder
from tinyformer.errors import DataError

CHAR_TEXT = "Hello, wörld!\n\n\tIndented  line with  double spaces.\r\nEmoji 😀 and 世界.\n"
UNSEEN = "ß 한국어 🚀🚀 e\u0301 \x00 tabs\t\tand\nnewlines\n\n — “quotes” <|eos|> done"


@pytest.fixture(scope="module")
def bpe_corpus() -> str:
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog 世界 你好 😀 naïve café tokens model Ω≈ç".split()
    return "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(3000))


@pytest.fixture(scope="module")
def bpe(bpe_corpus: str) -> Tokenizer:
    return build_tokenizer("bpe", bpe_corpus, 300)


# ---------------------------------------------------------------- char


def test_char_ids_are_nanogpt_ids_plus_specials() -> None:
    tok = build_tokenizer("char", CHAR_TEXT, None)
    chars = sorted(set(CHAR_TEXT))
    assert tok.kind == "char"
    assert tok.vocab_size == len(chars) + 3
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert tok.encode(CHAR_TEXT) == [chars.index(c) + 3 for c in CHAR_TEXT]
    assert tok.decode(tok.encode(CHAR_TEXT)) == CHAR_TEXT
    assert tok.id_to_token(3) == chars[0] and tok.token_to_id(chars[-1]) == len(chars) + 2
    assert tok.token_to_id(EOS) == 1 and tok.id_to_token(0) == BOS


def test_char_tokenizer_json_loads_in_raw_tokenizers(tmp_path: Path) -> None:
    tok = build_tokenizer("char", CHAR_TEXT, None)
    path = tok.save(tmp_path / "tokenizer.json")
    raw = tokenizers.Tokenizer.from_file(str(path))
    rng = random.Random(1)
    alphabet = sorted(set(CHAR_TEXT))
    samples = [
        CHAR_TEXT,
        " ",
        "\n\n",
        "".join(rng.choice(alphabet) for _ in range(500)),
        f"a{EOS}b{BOS}{PAD}",
    ]
    for text in samples:
        ids = tok.encode(text)
        assert raw.encode(text).ids == ids
        assert raw.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == text
    assert tok.encode(f"a{EOS}b") == [tok.token_to_id("a"), 1, tok.token_to_id("b")]

    loaded = Tokenizer.load(path)
    assert loaded.kind == "char" and loaded.encode(CHAR_TEXT) == tok.encode(CHAR_TEXT)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (0, 1, 2)
    assert loaded.to_json() == tok.to_json()


def test_char_unknown_character_error() -> None:
    tok = build_tokenizer("char", "abc ", None)
    with pytest.raises(DataError, match=r"'z' \(U\+007A\) at position 6"):
        tok.encode("ab ca z")
    with pytest.raises(DataError, match="position 9"):
        tok.encode(f"a{EOS}b!")  # the special token counts 7 characters


def test_char_token_bytes_and_skip_specials() -> None:
    tok = build_tokenizer("char", CHAR_TEXT, None)
    ids = tok.encode(f"{BOS}{CHAR_TEXT}{EOS}")
    assert b"".join(map(tok.token_bytes, ids)) == f"{BOS}{CHAR_TEXT}{EOS}".encode()
    assert tok.token_bytes(tok.token_to_id("😀")) == "😀".encode()
    assert tok.decode(ids, skip_special_tokens=True) == CHAR_TEXT
    with pytest.raises(DataError, match="out of range"):
        tok.decode([tok.vocab_size])


# ---------------------------------------------------------------- byte-level BPE


def test_byte_level_table_is_gpt2_alphabet() -> None:
    table = byte_level_decoder()
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(table.values()) == list(range(256))
    assert table["Ġ"] == ord(" ") and table["Ċ"] == ord("\n") and table["A"] == ord("A")


def test_bpe_round_trip_arbitrary_unicode(bpe: Tokenizer, bpe_corpus: str) -> None:
    assert bpe.kind == "bpe"
    assert bpe.vocab_size == 300 == bpe.backend.get_vocab_size()
    assert (bpe.bos_id, bpe.eos_id, bpe.pad_id) == (0, 1, 2)
    for text in (UNSEEN, bpe_corpus[:2000], "", " leading space", "😀"):
        ids = bpe.encode(text)
        assert all(0 <= i < bpe.vocab_size for i in ids)
        assert bpe.decode(ids) == text
        assert b"".join(map(bpe.token_bytes, ids)) == text.encode("utf-8")
    assert bpe.encode(f"x{EOS}y").count(bpe.eos_id) == 1
    # Merges learned: the corpus takes clearly fewer tokens than bytes.
    assert len(bpe.encode(bpe_corpus)) < 0.75 * len(bpe_corpus.encode())


def test_bpe_token_bytes_can_split_characters(bpe: Tokenizer) -> None:
    ids = bpe.encode("🚀")  # not in the corpus, so not one token
    parts = [bpe.token_bytes(i) for i in ids]
    assert b"".join(parts) == "🚀".encode()
    assert len(parts) > 1
    with pytest.raises(UnicodeDecodeError):
        parts[0].decode("utf-8")


def test_bpe_save_load_raw(bpe: Tokenizer, tmp_path: Path) -> None:
    path = bpe.save(tmp_path)
    assert path == tmp_path / "tokenizer.json"
    raw = tokenizers.Tokenizer.from_file(str(path))
    assert raw.encode(UNSEEN).ids == bpe.encode(UNSEEN)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (BOS, EOS, PAD)
    loaded = Tokenizer.load(tmp_path)
    assert loaded.kind == "bpe" and loaded.vocab_size == 300 and loaded.encode(UNSEEN) == bpe.encode(UNSEEN)


def test_bpe_vocab_size_limits(bpe_corpus: str) -> None:
    with pytest.raises(DataError, match=">= 259"):
        build_tokenizer("bpe", bpe_corpus, 258)
    with pytest.raises(DataError, match=r"use vocab_size <= \d+") as info:
        build_tokenizer("bpe", bpe_corpus, 100_000)
    suggested = int(re.search(r"vocab_size <= (\d+)", str(info.value)).group(1))
    assert 300 <= suggested < 100_000
    assert build_tokenizer("bpe", bpe_corpus, suggested).vocab_size == suggested


def test_build_tokenizer_bad_kind() -> None:
    with pytest.raises(DataError, match="'word'.*char, bpe"):
        build_tokenizer("word", "text", None)


# ---------------------------------------------------------------- foreign tokenizer.json


def _foreign(tmp_path: Path, specials: list[str]) -> Path:
    raw = tokenizers.Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(["hello world, hello there"] * 50, trainer=trainer)
    path = tmp_path / "tokenizer.json"
    raw.save(str(path))
    return path


def test_load_detects_common_special_names(tmp_path: Path) -> None:
    path = _foreign(tmp_path, ["<unk>", "<s>", "</s>", "<pad>"])
    tok = Tokenizer.load(path)
    raw = tokenizers.Tokenizer.from_file(str(path))
    assert tok.bos_id == raw.token_to_id("<s>") == 1
    assert tok.eos_id == raw.token_to_id("</s>") == 2
    assert tok.pad_id == raw.token_to_id("<pad>") == 3
    assert tok.chat_template is None

    (tmp_path / "gpt2").mkdir()
    gpt2 = Tokenizer.load(_foreign(tmp_path / "gpt2", ["<|endoftext|>"]))
    assert gpt2.eos_id == 0 and gpt2.bos_id is None and gpt2.pad_id is None


def test_load_reads_tokenizer_config(tmp_path: Path) -> None:
    _foreign(tmp_path, ["<s>", "</s>", "<|im_end|>"])
    template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    config = {
        "chat_template": template,
        "eos_token": {"content": "<|im_end|>", "special": True},
        "bos_token": None,
        "pad_token": "<missing>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.load(tmp_path)
    assert tok.chat_template == template
    assert tok.eos_token == "<|im_end|>" and tok.eos_id == 2
    assert tok.bos_token == "<s>"  # not set in the config: found by name
    assert tok.pad_id is None  # the config names a token the vocabulary lacks: ignored
    explicit = Tokenizer.load(tmp_path, eos_token="</s>", pad_token="<s>")
    assert explicit.eos_id == 1 and explicit.pad_id == 0

    # Saving keeps the template; loading the saved folder gives it back.
    tok.save(tmp_path / "copy")
    assert Tokenizer.load(tmp_path / "copy").chat_template == template


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        Tokenizer.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not a tokenizer")
    with pytest.raises(DataError, match="bad.json"):
        Tokenizer.load(bad)
    path = _foreign(tmp_path, ["<s>"])
    with pytest.raises(DataError, match="'<nope>' is not in the tokenizer vocabulary"):
        Tokenizer.load(path, eos_token="<nope>")


def test_token_bytes_sentencepiece_style_byte_fallback() -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "a": 4, "▁a": 5}
    vocab.update({f"<0x{b:02X}>": 6 + i for i, b in enumerate("😀".encode())})
    raw = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=[("▁", "a")], byte_fallback=True, unk_token="<unk>")
    )
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    raw.add_special_tokens(["<s>", "</s>"])
    tok = Tokenizer(raw)
    ids = tok.encode("a 😀a")
    assert tok.kind == "hf" and (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, None)
    assert tok.decode(ids) == "a 😀a"
    assert [tok.token_bytes(i) for i in ids[2:6]] == [bytes([b]) for b in "😀".encode()]
    # The prepended "▁" is a real space in the bytes; only the decoder's Strip removes it.
    assert b"".join(map(tok.token_bytes, ids)) == " a 😀a".encode()


# ---------------------------------------------------------------------------- saved padding / truncation


def test_saved_padding_and_truncation_do_not_touch_prompts(bpe: Tokenizer, tmp_path: Path) -> None:
    """A decoder tokenizer.json saved with padding (and truncation) encodes a prompt to its own ids only:
    the same ids as the file without those settings, read by raw `tokenizers`."""
    plain = tmp_path / "plain.json"
    bpe.save(plain)
    spec = json.loads(plain.read_text())
    spec["padding"] = {"strategy": {"Fixed": 64}, "direction": "Left", "pad_to_multiple_of": None,
                       "pad_id": bpe.pad_id, "pad_type_id": 0, "pad_token": PAD}
    spec["truncation"] = {"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0}
    padded = tmp_path / "padded.json"
    padded.write_text(json.dumps(spec))
    text = "The quick brown fox jumps over the lazy dog"
    want = tokenizers.Tokenizer.from_file(str(plain)).encode(text, add_special_tokens=False).ids
    raw = tokenizers.Tokenizer.from_file(str(padded)).encode(text)
    assert len(raw.ids) == 64 and sum(raw.attention_mask) == 3  # what the file asks for: cut to 3, padded to 64
    tok = Tokenizer.load(padded)
    assert tok.encode(text) == want
    assert [e for e in tok.encode_batch([text, "a"])] == [want, tokenizers.Tokenizer.from_file(str(plain)).encode(
        "a", add_special_tokens=False).ids]
    assert "padding" not in json.loads(tok.to_json()) or json.loads(tok.to_json())["padding"] is None


def test_max_length_truncates_the_content_and_keeps_the_special_tokens() -> None:
    from tokenizers import processors

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a", "b", "c", "d"])}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                           special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok = Tokenizer(backend)
    assert tok.encode("a b c d", add_special_tokens=True) == [2, 4, 5, 6, 7, 3]
    assert tok.encode("a b c d", add_special_tokens=True, max_length=4) == [2, 4, 5, 3]
    assert tok.encode("a b c d", max_length=2) == [4, 5]
    with pytest.raises(DataError, match="no room"):
        tok.encode("a b", add_special_tokens=True, max_length=2)


def test_tokenizer_files_get_the_mode_of_other_run_files(bpe: Tokenizer, tmp_path: Path) -> None:
    import os
    import stat

    from tinyformer.utils.io import atomic_write_text

    atomic_write_text(tmp_path / "config.json", "{}")  # how every other run file is written
    bpe.save(tmp_path)
    want = stat.S_IMODE(os.stat(tmp_path / "config.json").st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert want == 0o666 & ~umask
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == want, name
