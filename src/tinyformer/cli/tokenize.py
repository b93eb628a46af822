"""`tinyformer tokenize`: how a run's tokenizer cuts a text, token by token.

    tinyformer tokenize --model RUN --text "注意力机制"            a table: id, piece, characters, bytes
    tinyformer tokenize --model RUN --file notes.txt --json      the same as JSON

Each row is one token: its id, its piece (the text it stands for; ``b'\\xe6\\xb3'`` when it is part of a
character, as a byte-level BPE that never saw a Chinese character splits it into its 3 UTF-8 bytes), the
characters it completes and its bytes (generation/token_pieces.py). The totals give tokens per character and
characters and bytes per token: what a text costs in context length and compute with this tokenizer.
"""

from __future__ import annotations

import argparse
import json
import sys
import unicodedata
from pathlib import Path

from tinyformer.errors import ConfigError, DataError
from tinyformer.utils.io import read_utf8


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenize", help="show how a run's tokenizer cuts a text: ids, pieces, characters, bytes",
                       description="Tokenize a text with a run folder's tokenizer (or a tokenizer.json) and show "
                                   "every token's id, piece, characters and bytes, with tokens per character.")
    p.add_argument("--model", required=True, metavar="RUN", help="run folder, or a tokenizer.json file")
    p.add_argument("--text", help="the text to tokenize")
    p.add_argument("--file", help="a UTF-8 file holding the text (may be - for stdin)")
    p.add_argument("--add-special", action="store_true",
                   help="apply the tokenizer's post-processor (e.g. BERT's [CLS] ... [SEP], Llama's BOS)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _read_text(args: argparse.Namespace) -> str:
    if (args.text is None) == (args.file is None):
        raise ConfigError("give exactly one of --text or --file")
    if args.text is not None:
        return args.text
    if args.file == "-":
        return sys.stdin.read()
    path = Path(args.file)
    if not path.is_file():
        raise DataError(f"--file {path} does not exist")
    return read_utf8(path, DataError, "--file")


def _load_tokenizer(model: str):  # -> Tokenizer
    from tinyformer.data.tokenizer import Tokenizer

    path = Path(model)
    if path.is_file() or (path / "tokenizer.json").is_file():
        return Tokenizer.load(path)
    if not path.exists():
        raise DataError(f"--model {path} does not exist")
    raise DataError(f"{path} holds no tokenizer.json")


def summary(text: str, n_tokens: int) -> dict[str, float | int]:
    """Totals and ratios of ``text`` cut into ``n_tokens`` tokens."""
    chars, n_bytes = len(text), len(text.encode("utf-8"))
    return {"tokens": n_tokens, "characters": chars, "bytes": n_bytes,
            "tokens_per_character": n_tokens / chars if chars else 0.0,
            "characters_per_token": chars / n_tokens if n_tokens else 0.0,
            "bytes_per_token": n_bytes / n_tokens if n_tokens else 0.0}


def _display_width(text: str) -> int:
    """Terminal columns of ``text``: East Asian wide and full-width characters take two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _pad(text: str, width: int) -> str:
    return text + " " * (width - _display_width(text))


def _shown(piece) -> str:
    if piece.special:
        return piece.text
    return repr(piece.raw.decode("utf-8")) if piece.complete else repr(piece.raw)


def run(args: argparse.Namespace) -> int:
    from tinyformer.generation.token_pieces import token_pieces

    text = _read_text(args)
    tokenizer = _load_tokenizer(args.model)
    try:
        ids = tokenizer.encode(text, add_special_tokens=args.add_special)
    except DataError:
        raise
    except Exception as exc:  # `tokenizers` raises bare Exceptions
        raise DataError(f"cannot tokenize the text: {exc}") from None
    pieces = token_pieces(tokenizer, ids)
    totals = summary(text, len(ids))
    if args.json:
        print(json.dumps({"tokenizer": tokenizer.kind, "vocab_size": tokenizer.vocab_size, **totals,
                          "pieces": [{"id": p.id, "piece": p.text, "bytes": list(p.raw), "characters": p.chars,
                                      "special": p.special} for p in pieces]}, ensure_ascii=False))
        return 0
    width = len(str(tokenizer.vocab_size))
    shown = [_shown(p) for p in pieces]
    piece_width = max([5] + [_display_width(s) for s in shown])
    print(f"{'#':>5}  {'id':>{width}}  {_pad('piece', piece_width)}  chars  bytes")
    for k, (p, s) in enumerate(zip(pieces, shown)):
        print(f"{k:>5}  {p.id:>{width}}  {_pad(s, piece_width)}  {p.chars:>5}  {len(p.raw):>5}")
    print(f"{totals['tokens']} tokens, {totals['characters']} characters, {totals['bytes']} bytes "
          f"({tokenizer.kind} tokenizer, {tokenizer.vocab_size} ids): "
          f"{totals['tokens_per_character']:.2f} tokens per character, "
          f"{totals['characters_per_token']:.2f} characters and {totals['bytes_per_token']:.2f} bytes per token")
    return 0
