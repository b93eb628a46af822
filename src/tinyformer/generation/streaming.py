"""Incremental text output while tokens are decoded one at a time.

* :class:`Utf8StreamDecoder` turns the raw bytes of each token into text without ever showing half a
  character: byte-level tokenizers routinely split one multi-byte UTF-8 character (CJK, emoji) across
  several tokens.
* :class:`StopStringMatcher` holds back text that might turn out to be the start of a stop string, so
  a stop string is never shown, even when it arrives spread over several tokens.

A streaming loop chains them: ``text = dec.push(token_bytes)``, ``emit, stopped = stop.push(text)``,
and at the end ``stop.push(dec.flush())`` then ``stop.flush()``. :class:`TokenBytes` gives each token's bytes
for shown text (special tokens as none), the same for ``generate``, ``chat`` and ``serve``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

from tinyformer.errors import GenerationError

__all__ = ["StopStringMatcher", "TextState", "TokenBytes", "Utf8StreamDecoder"]


class TokenBytes:
    """Each token's bytes for streamed text, memoised: ``tb(token_id)``.

    Special tokens (BOS, PAD, a chat template's ``<|im_start|>``, ...) are control symbols, not text: they
    are generated and returned as ids but shown as nothing, like ``decode(skip_special_tokens=True)``;
    ``hidden`` holds their ids. Ids the tokenizer does not know (a model vocabulary padded beyond the
    tokenizer's, a gap in a foreign vocabulary) stand for no text. :meth:`raw` gives a token's own bytes,
    special or not (the server's log-probability entries name every token).
    """

    def __init__(self, tokenizer: object | None) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend", None)
        added = backend.get_added_tokens_decoder().items() if backend is not None else ()
        self.hidden: frozenset[int] = frozenset(i for i, t in added if t.special)
        self._raw: dict[int, bytes] = {}

    def raw(self, token_id: int) -> bytes:
        if token_id not in self._raw:
            b, tok = b"", self.tokenizer
            if tok is not None and token_id < tok.vocab_size:  # type: ignore[attr-defined]
                with contextlib.suppress(Exception):  # a gap in a foreign vocabulary
                    b = tok.token_bytes(token_id)  # type: ignore[attr-defined]
            self._raw[token_id] = b
        return self._raw[token_id]

    def __call__(self, token_id: int) -> bytes:
        return b"" if token_id in self.hidden else self.raw(token_id)


def _seq_len(lead: int) -> int:
    """Length of the well-formed sequence that ``lead`` starts (Unicode Table 3-7); 0 if it starts none."""
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


# The allowed range of the byte after a lead, where it is not 80..BF (Unicode Table 3-7): the narrowed ranges
# exclude overlong forms (E0, F0), UTF-16 surrogates (ED) and code points above U+10FFFF (F4); every later
# continuation byte is 80..BF.
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _incomplete_tail(data: bytes) -> int:
    """Length of the trailing bytes of ``data`` that are a proper prefix of a well-formed UTF-8 sequence.

    Those bytes may still become a character once more bytes arrive, so they must be held back;
    anything else at the end is either complete or certainly invalid. Returns 0 when nothing needs
    holding.
    """
    # A sequence is at most 4 bytes, so an incomplete one starts within the last 3 bytes.
    for back in range(1, min(3, len(data)) + 1):
        byte = data[-back]
        if 0x80 <= byte <= 0xBF:
            continue  # continuation byte: its lead (if any) is further back
        need = _seq_len(byte)
        if need <= back:
            return 0  # ASCII, an invalid byte, or a sequence that already has all its bytes
        lo, hi = _SECOND_BYTE.get(byte, (0x80, 0xBF))
        if back >= 2 and not lo <= data[-back + 1] <= hi:
            return 0  # the second byte rules out this lead: the bytes are certainly invalid
        return back
    return 0


class Utf8StreamDecoder:
    """Incremental UTF-8 decoder that only returns complete characters.

    ``push(b)`` returns the text completed by ``b``; an incomplete trailing sequence is held until the
    bytes that finish it arrive. Bytes that can never be part of a well-formed sequence become U+FFFD
    as soon as that is certain, i.e. as soon as the offending byte arrives (e.g. ``b"\\xff"``, or
    ``b"\\xed\\xa0"``, a surrogate), not one push later. Replacement follows the Unicode "maximal
    subpart" rule, so the concatenation of all pushes plus :meth:`flush` always equals
    ``all_bytes.decode("utf-8", errors="replace")``, however the bytes were split.
    """

    def __init__(self) -> None:
        self.pending = b""  # bytes held back because they may still complete a character

    def push(self, data: bytes | bytearray | memoryview) -> str:
        """Feed the bytes of one token; return the text that is now complete (possibly ``""``)."""
        buf = self.pending + bytes(data)
        hold = _incomplete_tail(buf)
        cut = len(buf) - hold
        self.pending = buf[cut:]
        # The part before `cut` ends on a sequence boundary (or on bytes that are invalid whatever
        # follows), so decoding it on its own gives exactly what decoding the whole stream would.
        return buf[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        """End of stream: a held incomplete sequence becomes one U+FFFD. Resets the decoder."""
        rest, self.pending = self.pending, b""
        return rest.decode("utf-8", errors="replace")


class StopStringMatcher:
    """Streams text and stops before the first stop string.

    ``push(text) -> (emit, stopped)``: ``emit`` is text that can no longer be part of a stop string.
    The longest suffix of the text so far that is a proper prefix of some stop string is held back.
    When a stop string is complete, ``stopped`` is True and ``emit`` is the text before it; the stop
    string and anything after it are never emitted, and later pushes return ``("", True)``.

    If several stop strings match, the one that is completed first in the stream wins (earliest end;
    among those ending together, the longest, i.e. earliest start). This is what feeding the text one
    character at a time would do, so the output never depends on how the text was split into pushes.
    """

    def __init__(self, stop_strings: Iterable[str]) -> None:
        stops = tuple(stop_strings)
        if isinstance(stop_strings, str) or not all(isinstance(s, str) and s for s in stops):
            raise GenerationError(f"stop_strings must be non-empty strings, got {stop_strings!r}")
        self.stop_strings = stops
        # Every proper prefix of every stop string: the suffixes worth holding back.
        self._prefixes = {s[:i] for s in stops for i in range(1, len(s))}
        self._max_hold = max((len(s) - 1 for s in stops), default=0)
        self.held = ""  # text held back because it may be the start of a stop string
        self.stopped = False  # a stop string has been seen

    def push(self, text: str) -> tuple[str, bool]:
        """Feed a piece of text; return ``(text safe to show, whether a stop string completed)``."""
        if self.stopped:
            return "", True
        buf = self.held + text
        # (end, start) of each stop string's first occurrence, which is also its earliest end
        found = [(start + len(s), start) for s in self.stop_strings if (start := buf.find(s)) >= 0]
        if found:
            self.stopped = True
            self.held = ""
            return buf[: min(found)[1]], True
        hold = next((n for n in range(min(self._max_hold, len(buf)), 0, -1) if buf[-n:] in self._prefixes), 0)
        self.held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """End of stream without a stop: return the held-back text (``""`` after a stop)."""
        rest, self.held = self.held, ""
        return "" if self.stopped else rest


class TextState:
    """The text of one generated sequence, token by token: UTF-8 decoding, stop strings, end tokens.

    ``accept(token)`` returns ``(text, finished)``: the text the token completes ("" while a character
    or a possible stop string is incomplete) and whether the sequence ended here (an end token, which is
    never shown, or a completed stop string, which is never shown either). ``close()`` ends the sequence
    for another reason (length, timeout) and returns the text held back until then: half a character
    becomes U+FFFD, a held possible start of a stop string is shown unless it completes one.
    ``stopped`` tells whether the sequence ended on a stop (end token or stop string). ``pieces`` joins
    to the whole text shown.
    """

    def __init__(self, token_bytes: Callable[[int], bytes], end_ids: Iterable[int] = (),
                 stop_strings: Iterable[str] = ()) -> None:
        self._token_bytes = token_bytes
        self._end_ids = frozenset(int(t) for t in end_ids)
        self._decoder = Utf8StreamDecoder()
        self._stopper = StopStringMatcher(stop_strings)
        self.pieces: list[str] = []
        self.done = False
        self.stopped = False

    def accept(self, token: int) -> tuple[str, bool]:
        if self.done:
            return "", True
        if token in self._end_ids:
            self.stopped = True
            return self._end(), True
        text, stopped = self._stopper.push(self._decoder.push(self._token_bytes(token)))
        self.pieces.append(text)
        if stopped:
            self.stopped = self.done = True
        return text, stopped

    def close(self) -> str:
        """End the sequence (any reason): the held-back text, "" if it had already ended."""
        return "" if self.done else self._end()

    def _end(self) -> str:
        tail, stopped = self._stopper.push(self._decoder.flush())
        if stopped:
            self.stopped = True
        else:
            tail += self._stopper.flush()
        self.done = True
        self.pieces.append(tail)
        return tail

    @property
    def text(self) -> str:
        return "".join(self.pieces)
