"""The walkthrough's pure-Python token automaton (docs/walkthrough.md, section 13: a regex as a byte DFA,
lifted to tokens by walking each token's bytes) gives exactly the grammar engine's masks, step by step,
on small char and BPE vocabularies, for simple regexes and for --choice (with the section's rule for
forced bytes, ``canonical_mask``)."""

from __future__ import annotations

import random
import re
import string
from pathlib import Path

import pytest

pytest.importorskip("llguidance")

from tinyformer.data.tokenizer import build_tokenizer  # noqa: E402
from tinyformer.generation import constraint as C  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs"
SECTION = re.compile(r"^## 13\. ", re.M)


def section_code(page: Path) -> str:
    """The python blocks of section 13 of a walkthrough page, joined."""
    text = page.read_text(encoding="utf-8")
    start = SECTION.search(text).start()
    end = text.find("\n## ", start + 1)
    return "\n".join(re.findall(r"```python\n(.*?)```", text[start:end], flags=re.S))


@pytest.fixture(scope="module")
def automaton() -> dict:
    ns: dict = {}
    exec(compile(section_code(DOCS / "walkthrough.md"), "walkthrough.md#13", "exec"), ns)
    return ns


def test_the_chinese_walkthrough_shows_the_same_code():
    strip = lambda code: [line.split("#")[0].rstrip() for line in code.splitlines()]  # noqa: E731
    assert strip(section_code(DOCS / "walkthrough.zh.md")) == strip(section_code(DOCS / "walkthrough.md"))


def vocabularies():
    alphabet = string.ascii_lowercase + string.digits + " ,.@-_()|+"
    char = build_tokenizer("char", alphabet)
    text = ("yes, no, maybe. abc@xyz.com 123-456 (a|b) " * 40) + alphabet
    bpe = build_tokenizer("bpe", text, vocab_size=300)
    return [char, bpe]


REGEXES = [r"(ab|a)[0-9]+", r"[a-c]+@[a-z]+\.(com|org)", r"(yes|no)(, (yes|no))*\.", r"-?[0-9]+(\.[0-9][0-9]?)?",
           r"x*(y|z)?w+", r"\(a\|b\)"]
CHOICES = [["yes", "no", "maybe"], ["a.b", "a|b", "(x)"], ["123", "12", "1"]]


@pytest.mark.parametrize("tok", vocabularies(), ids=["char", "bpe"])
def test_masks_equal_the_engines_along_random_walks(automaton, tok):
    ByteDFA, walk = automaton["ByteDFA"], automaton["walk"]
    token_mask = lambda d, s, v, e: automaton["canonical_mask"](d, s, v, e, tok.encode)  # noqa: E731
    specials = {i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
    vocab = [None if i in specials else tok.token_bytes(i) for i in range(tok.vocab_size)]
    eos = tok.eos_id
    engine_vocab = C.TokenVocabulary.of(tok, tok.vocab_size, [eos])
    rng = random.Random(0)
    cases = [(rx, C.regex(rx)) for rx in REGEXES] + \
        [(automaton["choice_regex"](opts), C.choice(opts)) for opts in CHOICES]
    compared = 0
    for rx, grammar in cases:
        dfa = ByteDFA(rx)
        for _ in range(6):
            state, matcher = dfa.start, C.Matcher(grammar, engine_vocab)
            for _ in range(40):
                ours = token_mask(dfa, state, vocab, eos)
                theirs = C.allowed_tokens([matcher], tok.vocab_size)[0].tolist()
                assert ours == theirs, (rx, [vocab[t] for t in range(len(ours)) if ours[t] != theirs[t]])
                compared += 1
                choices = [t for t, ok in enumerate(ours) if ok]
                t = rng.choice(choices)
                matcher.advance(t)
                if t == eos:
                    break
                state = walk(dfa, state, vocab[t])
    assert compared > 200
