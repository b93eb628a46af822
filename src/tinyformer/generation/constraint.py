"""Constrained decoding: at each step, the tokens that keep the output a valid prefix of a language.

A :class:`Grammar` says what the output must be: a JSON schema (:func:`json_schema`), any JSON object
(:func:`json_object`), a regular expression (:func:`regex`), one of fixed strings (:func:`choice`), or a
Lark / GBNF grammar (:func:`grammar`). It rides on ``SamplingParams.constraint``; every row that decodes
with it gets its own :class:`Matcher` (its own position in the language), built over the model's
vocabulary (:class:`TokenVocabulary`, each token's bytes). Per decode step, for a row at output prefix
``s``::

    allowed[v] = 1  iff  s + bytes(v) is a prefix of some string of the language     (v not an end token)
    allowed[eos] = 1  iff  s itself is in the language
    y ~ softmax(logits masked to allowed)          generation/sampling.py (sample(..., allowed=...))
    matcher.advance(y)                             s <- s + bytes(y)

so the finished output is in the language by construction; a row whose budget (``max_new_tokens``) runs
out first ends with ``finish_reason`` "length" and :attr:`Matcher.accepting` False.

The engine is llguidance (``pip install 'tinyformer[structured]'``), chosen by measurement
(``benchmarks/bench_grammar_engines.py``, docs/structured_output.md): it compiles a schema in about a
millisecond (a request's schema costs nothing to serve), computes a 49k-token mask in ~0.1 ms, reads Lark,
GBNF (converted to Lark) and regexes, and refuses a schema keyword it cannot enforce with an error naming
it, where another engine silently ignores it. JSON is written with fixed separators ``", "`` and
``": "`` and no other whitespace, so a model cannot loop on blank lines inside an object.
"""

from __future__ import annotations

import functools
import json
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tinyformer.errors import GenerationError
from tinyformer.generation.streaming import TokenBytes

__all__ = ["EXTRA", "JSON_OPTIONS", "Grammar", "Matcher", "TokenVocabulary", "allowed_tokens", "choice", "grammar",
           "json_object", "json_schema", "regex", "tool_calls"]

#: The pip extra that installs the grammar engine.
EXTRA = "structured"
#: llguidance's JSON options: compact JSON with Python's separators (no free whitespace to loop on).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "json_object", "regex", "choice", "lark")


def _ll() -> Any:
    """The llguidance module, or a one-line GenerationError naming the extra that installs it."""
    try:
        import llguidance
    except ImportError:
        raise GenerationError("structured output (JSON schema, regex, choice, grammar) needs llguidance: "
                              f"pip install 'tinyformer[{EXTRA}]'") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What the output must be. ``kind`` is one of ``KINDS``; ``source`` its canonical text: the schema as
    JSON in its own key order (the order properties are written in), the regex, the choices as a JSON
    list, the Lark grammar. Build one with the functions below, which check it (a
    :class:`GenerationError` names what is wrong)."""

    kind: str
    source: str

    @property
    def schema(self) -> Any:
        """The JSON schema (``json_schema`` and ``json_object`` kinds), else None."""
        return json.loads(self.source) if self.kind in ("json_schema", "json_object") else None

    def describe(self) -> str:
        return {"json_schema": "the JSON schema", "json_object": "a JSON object", "regex": "the regex",
                "choice": "one of the choices", "lark": "the grammar"}[self.kind]

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's own format (cached)."""
        return _compile(self.kind, self.source)


@functools.lru_cache(maxsize=256)
def _compile(kind: str, source: str) -> str:
    ll = _ll()
    if kind in ("json_schema", "json_object"):
        return ll.LLMatcher.grammar_from_json_schema(source, overrides=JSON_OPTIONS)
    if kind == "regex":
        return ll.LLMatcher.grammar_from_regex(source)
    if kind == "choice":
        options = json.loads(source)
        return ll.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
    return ll.LLMatcher.grammar_from_lark(source)


def _checked(g: Grammar) -> Grammar:
    message = _ll().LLMatcher.validate_grammar(g.llguidance_grammar())
    if message:
        text = " ".join(message.split())
        raise GenerationError(f"{g.describe()} cannot be enforced: {text}")
    return g


def json_schema(schema: Any) -> Grammar:
    """A JSON schema (a dict or its JSON text): the output is one JSON value valid under it. A schema that
    is not JSON, not an object (or boolean), or uses a keyword llguidance cannot enforce (``uniqueItems``,
    ``contains``, ``not``, ``if``/``then``, ``dependentRequired``, ...) is a GenerationError naming it."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GenerationError(f"the JSON schema is not valid JSON: {exc}") from None
    if schema is True:
        schema = {}
    if schema is False:
        raise GenerationError("the JSON schema false allows no value")
    if not isinstance(schema, dict):
        raise GenerationError(f"a JSON schema must be an object, got {type(schema).__name__}")
    return _checked(Grammar("json_schema", json.dumps(schema)))


def json_object() -> Grammar:
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    return _checked(Grammar("json_object", json.dumps({"type": "object"})))


def regex(pattern: str) -> Grammar:
    """The whole output matches ``pattern`` (Rust ``regex`` syntax, as Python's for the common part; no
    look-around or back-references; anchors are implied)."""
    if not isinstance(pattern, str) or not pattern:
        raise GenerationError(f"a regex must be a non-empty string, got {pattern!r}")
    return _checked(Grammar("regex", pattern))


def choice(options: Sequence[str]) -> Grammar:
    """The output is exactly one of ``options`` (non-empty strings)."""
    if isinstance(options, str) or not options or not all(isinstance(o, str) and o for o in options):
        raise GenerationError(f"choices must be one or more non-empty strings, got {options!r}")
    return _checked(Grammar("choice", json.dumps(list(dict.fromkeys(options)))))


def grammar(text: str) -> Grammar:
    """A context-free grammar: Lark (llguidance's dialect: ``start: ...``, regexes as ``/.../``) or GBNF
    (llama.cpp's ``root ::= ...``, converted to Lark)."""
    if not isinstance(text, str) or not text.strip():
        raise GenerationError("the grammar is empty")
    if "::=" in text:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        _ll()
        try:
            text = gbnf_to_lark(text)
        except Exception as exc:
            raise GenerationError(f"the GBNF grammar cannot be read: {' '.join(str(exc).split())}") from None
    return _checked(Grammar("lark", text))


def tool_calls(functions: Sequence[tuple[str, Any]], *, required: bool, parallel: bool) -> Grammar:
    """Tool calls in the format of ``data/chat_template.py`` (``<tool_call>\\n{"name": NAME, "arguments":
    ARGS}\\n</tool_call>``, blocks on their own lines): the name one of ``functions`` ((name, parameters
    schema or None) pairs), the arguments valid under that function's schema. ``required``: the output is
    one call (``parallel``: one or more); else free text that may end in calls, constrained from the moment
    ``<tool_call>`` is written (text containing ``<tool_call>`` any other way is not allowed)."""
    from tinyformer.data.chat_template import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

    options, defs = [], {}
    for name, parameters in functions:
        params = {"type": "object"} if parameters is None else parameters
        try:
            json_schema(params)
        except GenerationError as exc:
            raise GenerationError(f"the parameters of function {name!r}: {exc}") from None
        params, own = _hoist_defs(params, name)
        defs.update(own)
        options.append({"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    if not options:
        raise GenerationError("tool calls need at least one function")
    call = {"x-guidance": JSON_OPTIONS, **({"$defs": defs} if defs else {}),
            **(options[0] if len(options) == 1 else {"anyOf": options})}
    lit = json.dumps
    body = f"body: %json {json.dumps(call)} {lit(TOOL_CALL_CLOSE)}\n"
    more = f"more: ({lit(chr(10) + TOOL_CALL_OPEN)} body)*\n" if parallel else "more: \n"
    open_tag = TOOL_CALL_OPEN.rstrip("\n")
    if required:
        start = f"start: {lit(TOOL_CALL_OPEN)} body more\n"
    else:
        # one lexeme for "free text, then the opening tag": it ends at the first <tool_call>, which free text
        # (TEXT) may never contain
        start = ("start: TEXT | TEXT_OPEN body more\n"
                 f"TEXT: /(?s:.*)/ & ~/(?s:.*){open_tag}(?s:.*)/\n"
                 f"TEXT_OPEN: /(?s:.*){open_tag}\\n/ & ~/(?s:.*){open_tag}(?s:.*){open_tag}(?s:.*)/\n")
    return _checked(Grammar("lark", start + body + more))


def _hoist_defs(schema: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``schema`` without its ``$defs`` / ``definitions`` (which a schema nested inside the call object can no
    longer reach as ``#/$defs/...``), its references renamed to ``#/$defs/{prefix}.{name}``; and those defs."""
    own = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    if not own:
        return schema, {}

    def rename(x: Any) -> Any:
        if isinstance(x, dict):
            out = {}
            for k, v in x.items():
                if k == "$ref" and isinstance(v, str):
                    for root in ("#/$defs/", "#/definitions/"):
                        if v.startswith(root):
                            v = f"#/$defs/{prefix}.{v[len(root):]}"
                out[k] = rename(v)
            return out
        if isinstance(x, list):
            return [rename(v) for v in x]
        return x

    body = rename({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})
    return body, {f"{prefix}.{k}": rename(v) for k, v in own.items()}


# ----------------------------------------------------------------------------------------------
# the vocabulary and the per-row matcher
# ----------------------------------------------------------------------------------------------


class TokenVocabulary:
    """The model's vocabulary as the grammar engine sees it: each token id's bytes.

    Ids ``0 .. vocab_size-1`` of the model; a token is its bytes (``Tokenizer.token_bytes``), a special
    token (BOS, ``<|im_start|>``, ...) and an id the tokenizer lacks are marked special (never allowed by
    a grammar), and ``end_ids`` are the end-of-sequence tokens, allowed exactly when the output is
    complete. Built once per (tokenizer, vocab_size, end_ids): :meth:`of` caches it.
    """

    _cache: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], TokenVocabulary]] = \
        weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, tokenizer: Any, vocab_size: int, end_ids: Sequence[int]) -> None:
        ll = _ll()
        ends = sorted({int(t) for t in end_ids if 0 <= int(t) < vocab_size})
        if not ends:
            raise GenerationError("structured output needs an end-of-sequence token (the tokenizer has none)")
        token_bytes = TokenBytes(tokenizer)
        special = token_bytes.hidden | set(ends)
        raw = token_bytes.raw  # b"" for an id the tokenizer lacks
        tokens = [(b"" if i in special else raw(i)) or b"\xff[" + str(i).encode() + b"]" for i in range(vocab_size)]
        encode = tokenizer.encode

        class _Wrapper:  # what llguidance.TokenizerWrapper reads
            eos_token_id, bos_token_id = ends[0], None
            special_token_ids = sorted(special)

            def __init__(self) -> None:
                self.tokens = tokens

            def __call__(self, s: Any) -> list[int]:
                text = s.decode("utf-8", "replace") if isinstance(s, bytes) else s
                try:
                    return [t for t in encode(text) if t < vocab_size]
                except Exception:  # a character the tokenizer lacks: llguidance then spells it from token bytes
                    return []

        self.ll_tokenizer = ll.LLTokenizer(ll.TokenizerWrapper(_Wrapper()), n_vocab=vocab_size, eos_token=ends)

    @classmethod
    def of(cls, tokenizer: Any, vocab_size: int, end_ids: Sequence[int]) -> TokenVocabulary:
        """The cached vocabulary of ``tokenizer`` padded to ``vocab_size`` ids with these end tokens."""
        key = (int(vocab_size), tuple(sorted({int(t) for t in end_ids})))
        with cls._lock:
            per = cls._cache.setdefault(tokenizer, {})
            if key not in per:
                per[key] = cls(tokenizer, vocab_size, end_ids)
            return per[key]


class Matcher:
    """One row's place in the language of a :class:`Grammar`: the tokens allowed next, and the state
    after each token. ``accepting``: the output so far is complete (an end token is allowed);
    ``stopped``: nothing can follow (complete, or an end token was taken).

    Speculative decoding hook: :meth:`check_draft` gives how many leading draft tokens the grammar
    accepts (without moving), :func:`draft_masks` the mask after each of them, and
    :meth:`rollback` undoes accepted tokens that the target model then rejected.
    """

    def __init__(self, g: Grammar, vocab: TokenVocabulary) -> None:
        ll = _ll()
        self.grammar = g
        self._m = ll.LLMatcher(vocab.ll_tokenizer, g.llguidance_grammar(), log_level=0)
        if self._m.is_error():
            raise GenerationError(f"{g.describe()} cannot be enforced: {' '.join(self._m.get_error().split())}")

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def stopped(self) -> bool:
        return self._m.is_stopped()

    def fill(self, words: Tensor) -> None:
        """Write the allowed-token bitmask into ``words``, a contiguous CPU int32 tensor of ceil(V / 32) words:
        bit ``v % 32`` of word ``v // 32`` is 1 iff token v is allowed."""
        self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def advance(self, token: int) -> None:
        """Take ``token``; a token the mask did not allow is a GenerationError (a bug, never a user's)."""
        if not self._m.consume_token(int(token)) or self._m.is_error():
            raise GenerationError(f"token {token} does not continue {self.grammar.describe()}: "
                                  f"{self._m.get_error().splitlines()[0] if self._m.get_error() else 'refused'}")

    def check_draft(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar accepts from here (the state does not move)."""
        return int(self._m.validate_tokens([int(t) for t in tokens]))

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` advanced tokens."""
        if n and not self._m.rollback(int(n)):
            raise GenerationError(f"cannot roll the grammar back by {n} tokens")


def unpack_bits(words: Tensor, vocab_size: int) -> Tensor:
    """``[B, W]`` int32 bitmask words -> ``[B, V]`` bool (bit ``v % 32`` of word ``v // 32``)."""
    bits = np.unpackbits(words.numpy().view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab_size].astype(bool))


def draft_masks(matcher: Matcher, drafts: Sequence[int], vocab_size: int) -> Tensor:
    """``[len(drafts) + 1, V]`` bool: row j, the tokens ``matcher`` allows after the first j ``drafts`` (the
    draft is accepted tentatively and rolled back, so the matcher does not move; rows after a draft it refuses
    allow every token, as nothing there is kept: that token is never consumed, as a refused token puts the
    matcher in its error state for good)."""
    words = torch.full((len(drafts) + 1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    valid = matcher.check_draft(drafts)
    for i in range(valid + 1):
        matcher.fill(words[i])
        if i < valid:
            matcher.advance(drafts[i])
    matcher.rollback(valid)
    return unpack_bits(words, vocab_size)


def allowed_tokens(matchers: Sequence[Matcher | None], vocab_size: int,
                   device: torch.device | str = "cpu") -> Tensor:
    """``[B, V]`` bool: row b's allowed tokens (every token for a row without a matcher)."""
    words = torch.full((len(matchers), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for b, m in enumerate(matchers):
        if m is not None:
            m.fill(words[b])
    return unpack_bits(words, vocab_size).to(device)
