"""Tests for tinyformer.generation.streaming: UTF-8 stream decoding and stop-string matching."""

from __future__ import annotations

import itertools
import random

import pytest

from tinyformer.errors import GenerationError
from tinyformer.generation.streaming import StopStringMatcher, Utf8StreamDecoder

TEXT = "Añ 世界, 日本語 😀👍🏽 𝄞 ğü — Ωμέγα 🇫🇷!"
REPLACEMENT = "\ufffd"


def decode_pieces(pieces: list[bytes]) -> list[str]:
    dec = Utf8StreamDecoder()
    out = [dec.push(p) for p in pieces]
    out.append(dec.flush())
    return out


def split_at(data: bytes, cuts: tuple[int, ...]) -> list[bytes]:
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


def assert_clean(piece: str) -> None:
    assert REPLACEMENT not in piece
    piece.encode("utf-8")  # raises on lone surrogates, i.e. a broken sequence


def test_multibyte_text_split_at_every_pair_of_boundaries():
    data = TEXT.encode("utf-8")
    assert len(data) > 2 * len(TEXT)  # really multi-byte
    for cuts in itertools.combinations(range(1, len(data)), 2):
        out = decode_pieces(split_at(data, cuts))
        for piece in out:
            assert_clean(piece)
        assert "".join(out) == TEXT, cuts


def test_multibyte_text_byte_by_byte_emits_each_char_once_complete():
    data = TEXT.encode("utf-8")
    dec = Utf8StreamDecoder()
    emitted = []
    for i in range(len(data)):
        piece = dec.push(data[i : i + 1])
        assert_clean(piece)
        emitted.append(piece)
        # Everything that forms complete characters so far has been emitted, nothing more.
        done = "".join(emitted)
        assert data[: i + 1].startswith(done.encode("utf-8"))
        assert len(data[: i + 1]) - len(done.encode("utf-8")) <= 3
    assert dec.flush() == ""
    assert "".join(emitted) == TEXT


def test_arbitrary_bytes_match_whole_decode_with_replacement():
    rng = random.Random(0)
    alphabet = [b"a", b"\xff", b"\xc0", b"\x80", b"\xbf", b"\xe0", b"\xed", b"\xf0", b"\xf4", b"\xa0",
                b"\x9f", b"\x90", b"\x8f", b"\xc2", b"\xe4\xb8", b"\xf0\x9f\x98"]
    for _ in range(400):
        data = b"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        ncuts = rng.randint(0, min(4, max(len(data) - 1, 0)))
        cuts = tuple(sorted(rng.sample(range(1, len(data)), ncuts))) if ncuts else ()
        want = data.decode("utf-8", errors="replace")
        assert "".join(decode_pieces(split_at(data, cuts))) == want, (data, cuts)
        assert "".join(decode_pieces([data[i : i + 1] for i in range(len(data))])) == want, data


def test_invalid_bytes_are_replaced_as_soon_as_certain():
    dec = Utf8StreamDecoder()
    assert dec.push(b"\xff") == REPLACEMENT  # never valid
    assert dec.push(b"\xe4\xb8") == ""  # may still become 世
    assert dec.pending == b"\xe4\xb8"
    assert dec.push(b"A") == REPLACEMENT + "A"  # it can not any more
    assert dec.push(b"\xed\xa0") == REPLACEMENT * 2  # ED A0 would be a UTF-16 surrogate
    assert dec.push(b"\xf4\x90") == REPLACEMENT * 2  # above U+10FFFF
    assert dec.push(b"\xf0\x9f\x98") == ""
    assert dec.flush() == REPLACEMENT  # truncated at end of stream
    assert dec.pending == b""
    assert dec.push(bytearray(b"\xe4\xb8\x96")) == "世"


# ---------------------------------------------------------------------------------------------
# stop strings
# ---------------------------------------------------------------------------------------------


def run_matcher(stops: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    m = StopStringMatcher(stops)
    emitted, stopped = [], False
    for p in pieces:
        e, stopped = m.push(p)
        emitted.append(e)
        if stopped:
            break
    return emitted, stopped, m.flush()


def reference_stop(stops: list[str], text: str) -> tuple[str, bool]:
    """Stop at the first position where some stop string is complete; emit what precedes it."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            return text[: end - max(len(s) for s in hits)], True
    return text, False


def split_text(text: str, cuts: tuple[int, ...]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def test_stop_string_split_across_pushes_at_every_pair_of_points():
    text = "Hello wor<|e|>nd and <|end|> ignored <|end|>"
    stops = ["<|end|>"]
    for cuts in itertools.chain(
        [()],
        itertools.combinations(range(1, len(text)), 1),
        itertools.combinations(range(1, len(text)), 2),
        itertools.combinations(range(1, len(text)), 3),
    ):
        emitted, stopped, tail = run_matcher(stops, split_text(text, cuts))
        assert stopped, cuts
        assert "".join(emitted) == "Hello wor<|e|>nd and ", cuts
        assert tail == ""
        for piece in emitted:
            assert "<|end|>" not in piece


def test_stop_string_one_character_at_a_time():
    text = "abc STOP def"
    emitted, stopped, _ = run_matcher(["STOP"], list(text))
    assert stopped and "".join(emitted) == "abc "
    # Held-back text is not emitted until it can no longer start the stop string.
    assert emitted[:6] == ["a", "b", "c", " ", "", ""]


def test_holds_back_possible_prefix_and_releases_it():
    m = StopStringMatcher(["<|end|>"])
    assert m.push("Hello <|") == ("Hello ", False)
    assert m.held == "<|"
    assert m.push("e") == ("", False)
    assert m.push("x!") == ("<|ex!", False)
    assert m.push("tail <") == ("tail ", False)
    assert m.flush() == "<"
    assert not m.stopped


def test_after_stop_nothing_more_is_emitted():
    m = StopStringMatcher(["\n\n"])
    assert m.push("one\n") == ("one", False)
    assert m.push("\ntwo") == ("", True)
    assert m.push("three") == ("", True)
    assert m.flush() == ""
    assert m.stopped


def test_no_stop_strings_passes_text_through():
    m = StopStringMatcher([])
    assert m.push("abc") == ("abc", False)
    assert m.flush() == ""


@pytest.mark.parametrize(
    "stops,text,want",
    [
        (["abcd", "bc"], "xxabcdyy", "xxa"),  # "bc" is complete first
        (["abc", "bc"], "xxabcyy", "xx"),  # same end: the longer one
        (["aab"], "aaab", "a"),  # overlapping prefix candidates
        (["ab", "b"], "cab", "c"),
        (["世界"], "你好世界!", "你好"),
    ],
)
def test_multiple_and_overlapping_stop_strings(stops, text, want):
    assert reference_stop(stops, text) == (want, True)
    for n in range(1, 4):
        for cuts in itertools.combinations(range(1, len(text)), n):
            emitted, stopped, _ = run_matcher(stops, split_text(text, cuts))
            assert stopped and "".join(emitted) == want, cuts


def test_random_texts_match_reference_for_any_split():
    rng = random.Random(1)
    for _ in range(300):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 14)))
        want, want_stopped = reference_stop(stops, text)
        ncuts = rng.randint(0, min(5, max(len(text) - 1, 0)))
        cuts = tuple(sorted(rng.sample(range(1, len(text)), ncuts))) if ncuts else ()
        emitted, stopped, tail = run_matcher(stops, split_text(text, cuts))
        assert stopped == want_stopped, (stops, text, cuts)
        assert "".join(emitted) + tail == want, (stops, text, cuts)


def test_empty_stop_string_is_rejected():
    with pytest.raises(GenerationError, match="stop_strings"):
        StopStringMatcher(["ok", ""])
    with pytest.raises(GenerationError, match="stop_strings"):
        StopStringMatcher("</s>")


def test_token_bytes_show_special_tokens_as_nothing_and_keep_their_raw_bytes():
    """One rule for generate, chat and serve: the tokenizer's special tokens (ids 0-2 of a char tokenizer)
    stand for no text, every other id for its own bytes, ids past the tokenizer's vocabulary for none;
    ``raw`` still names the special ones (the server's log-probability entries)."""
    from tinyformer.data.tokenizer import build_tokenizer
    from tinyformer.generation.streaming import TokenBytes

    tok = build_tokenizer("char", "hello world")
    tb = TokenBytes(tok)
    specials = {i for i in range(tok.vocab_size) if tok.token_bytes(i) and tok.decode([i]) == ""}
    assert tb.hidden == {0, 1, 2} and specials <= tb.hidden
    assert all(tb(i) == b"" and tb.raw(i) == tok.token_bytes(i) for i in tb.hidden)
    assert b"".join(tb(i) for i in tok.encode("hello")) == b"hello"
    assert tb(tok.vocab_size + 5) == b"" == tb.raw(tok.vocab_size + 5)
    assert TokenBytes(None)(3) == b""
