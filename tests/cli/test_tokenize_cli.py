"""`tinyformer tokenize`: every token's id, piece, characters and bytes, against the tokenizer and UTF-8."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tinyformer.cli.main import main
from tinyformer.data.tokenizer import Tokenizer
from tinyformer.generation.token_pieces import token_pieces

ROOT = Path(__file__).resolve().parents[2]
CHINESE_DIR = ROOT / "docs" / "examples" / "zh"
ENGLISH = ("The model reads token ids, not characters. A tokenizer cuts the text into pieces and the "
           "embedding table turns each id into a vector. ") * 40


@pytest.fixture(scope="module")
def english_bpe(tmp_path_factory) -> Path:
    """A byte-level BPE trained on English only (as the default tokenizer, on a smaller corpus)."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    Tokenizer.train_bpe(ENGLISH, 320).save(path)
    return path


def tokenize_json(capsys, model: Path, *args: str) -> dict:
    assert main(["tokenize", "--model", str(model), *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_pieces_concatenate_to_the_texts_bytes_and_characters_sum_to_its_length(capsys, english_bpe):
    text = "Attention 注意力 🙂!"
    out = tokenize_json(capsys, english_bpe, "--text", text)
    assert [p["id"] for p in out["pieces"]] == Tokenizer.load(english_bpe).encode(text)
    assert b"".join(bytes(p["bytes"]) for p in out["pieces"]) == text.encode("utf-8")
    assert sum(p["characters"] for p in out["pieces"]) == len(text)
    assert (out["tokens"], out["characters"], out["bytes"]) == (len(out["pieces"]), len(text),
                                                               len(text.encode("utf-8")))
    assert out["tokens_per_character"] == pytest.approx(out["tokens"] / len(text))
    assert out["bytes_per_token"] == pytest.approx(len(text.encode("utf-8")) / out["tokens"])


def test_an_english_trained_byte_level_bpe_spends_three_tokens_on_each_chinese_character(capsys, english_bpe):
    text = "模型训练"  # 4 characters of 3 UTF-8 bytes each, none of them in the English corpus
    out = tokenize_json(capsys, english_bpe, "--text", text)
    assert out["tokens"] == 3 * len(text) == out["bytes"]
    # only the third byte of each character completes it
    assert [p["characters"] for p in out["pieces"]] == [0, 0, 1] * len(text)
    assert out["pieces"][0]["piece"] == "\\xe6"  # part of a character: its byte written out


def test_a_tokenizer_trained_on_chinese_text_gives_more_characters_per_token(capsys, english_bpe, tmp_path):
    text = (CHINESE_DIR / "attention.txt").read_text(encoding="utf-8")
    chinese = tmp_path / "zh.json"
    Tokenizer.train_bpe("\n\n".join(p.read_text(encoding="utf-8") for p in sorted(CHINESE_DIR.glob("*.txt"))),
                        1024).save(chinese)
    before = tokenize_json(capsys, english_bpe, "--file", str(CHINESE_DIR / "attention.txt"))
    after = tokenize_json(capsys, chinese, "--file", str(CHINESE_DIR / "attention.txt"))
    assert before["tokens_per_character"] > 2.5  # about 3 bytes per character, few merges
    assert after["characters_per_token"] > 1.2
    assert after["tokens"] == len(Tokenizer.load(chinese).encode(text))


def test_special_tokens_are_named_pieces_with_no_characters_or_bytes(capsys, english_bpe):
    out = tokenize_json(capsys, english_bpe, "--text", "<|bos|>The")
    first = out["pieces"][0]
    assert (first["id"], first["piece"], first["characters"], first["bytes"], first["special"]) == (
        Tokenizer.load(english_bpe).bos_id, "<|bos|>", 0, [], True)
    assert sum(p["characters"] for p in out["pieces"]) == len("The")


def test_the_table_has_one_row_per_token_and_the_ratios(capsys, english_bpe):
    text = "The 注"
    assert main(["tokenize", "--model", str(english_bpe), "--text", text]) == 0
    lines = capsys.readouterr().out.splitlines()
    ids = Tokenizer.load(english_bpe).encode(text)
    assert lines[0].split() == ["#", "id", "piece", "chars", "bytes"]
    assert [int(row.split()[1]) for row in lines[1:-1]] == ids
    assert "b'\\xe6'" in lines[-4]  # the first byte of 注, shown as bytes
    assert lines[-1].startswith(f"{len(ids)} tokens, {len(text)} characters, {len(text.encode())} bytes")
    assert f"{len(ids) / len(text):.2f} tokens per character" in lines[-1]


def test_token_pieces_of_a_char_tokenizer_are_one_character_each():
    tok = Tokenizer.train_char("注意力 abc")
    pieces = token_pieces(tok, tok.encode("力 a注"))
    assert [(p.text, p.chars, len(p.raw)) for p in pieces] == [("力", 1, 3), (" ", 1, 1), ("a", 1, 1), ("注", 1, 3)]


@pytest.mark.parametrize("args", [[], ["--text", "a", "--file", "x.txt"], ["--file", "missing.txt"]])
def test_bad_input_is_one_line_and_exit_code_2(capsys, english_bpe, args):
    assert main(["tokenize", "--model", str(english_bpe), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tinyformer tokenize: error:")


def test_a_folder_without_a_tokenizer_is_a_one_line_error(capsys, tmp_path):
    assert main(["tokenize", "--model", str(tmp_path), "--text", "a"]) == 2
    assert "holds no tokenizer.json" in capsys.readouterr().err
