"""What each token of a text stands for: its id, its bytes, its text piece and the characters it completes.

For a byte-level BPE a token is a run of bytes, which may end inside a multi-byte UTF-8 character (a
Chinese character is 3 bytes, and a tokenizer that never saw it splits it into 3 tokens). So the
characters of a text are counted where they *complete*: feeding the tokens' bytes, in order, to an
incremental UTF-8 decoder, token k completes ``chars[k]`` characters, and

    sum_k chars[k] = characters of the decoded text,  sum_k bytes[k] = its UTF-8 bytes

(for the trained kinds and byte-fallback tokenizers; a normalising tokenizer such as BERT's lower-cased
WordPiece gives its pieces' own counts). Special tokens ([CLS], <|bos|>) are control symbols: no bytes,
no characters, and their own name as the piece. Used by ``tinyformer tokenize`` and the server's
``POST /tokenize``.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

from tinyformer.generation.streaming import TokenBytes

__all__ = ["Piece", "token_pieces"]


@dataclass(frozen=True)
class Piece:
    """One token: ``raw`` its bytes (empty for a special token), ``text`` its piece as a string (the text when
    the bytes are whole UTF-8, else with the bytes that are not written ``\\xNN``: ``b'\\xe6\\xb3'``, part of a
    character, becomes the 8 characters ``\\xe6\\xb3``), ``chars`` the characters it completes, ``special``
    whether it is a control token."""

    id: int
    raw: bytes
    text: str
    chars: int
    special: bool

    @property
    def complete(self) -> bool:
        """Whether the piece is whole UTF-8 (not part of a character)."""
        try:
            self.raw.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True


def token_pieces(tokenizer: object, ids: Sequence[int]) -> list[Piece]:
    """The :class:`Piece` of each id, in order (ids the tokenizer lacks have no bytes)."""
    token_bytes = TokenBytes(tokenizer)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = []
    for token_id in ids:
        if token_id in token_bytes.hidden:
            name = tokenizer.id_to_token(token_id) or ""  # type: ignore[attr-defined]
            out.append(Piece(token_id, b"", name, 0, True))
            continue
        raw = token_bytes.raw(token_id)
        out.append(Piece(token_id, raw, raw.decode("utf-8", errors="backslashreplace"),
                         len(decoder.decode(raw)), False))
    return out
