"""Constrained decoding against independent judges: hundreds of temperature-1 samples from random tiny
models, checked with ``jsonschema`` (an independent validator), ``re.fullmatch`` and set membership; rows of
different constraints sharing one engine; a row's budget running out before its grammar is complete."""

from __future__ import annotations

import json
import re
import string

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from tinyformer.config import ModelConfig  # noqa: E402
from tinyformer.data.tokenizer import build_tokenizer  # noqa: E402
from tinyformer.errors import GenerationError, TinyformerError  # noqa: E402
from tinyformer.generation import constraint as C  # noqa: E402
from tinyformer.generation.engine import BatchEngine, EngineRow, new_prefix_cache  # noqa: E402
from tinyformer.generation.generator import Generator  # noqa: E402
from tinyformer.generation.sampling import SamplingParams  # noqa: E402
from tinyformer.generation.streaming import TextState, TokenBytes  # noqa: E402
from tinyformer.models.decoder import DecoderLM  # noqa: E402

ALPHABET = string.ascii_letters + string.digits + ' {}[]":,.-_@+\n'

NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": -20, "maximum": 300},
        "name": {"type": "string", "minLength": 2, "maxLength": 6},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{1,3}$"},
        "kind": {"enum": ["cat", "dog", 7, None]},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["ok"],
            "additionalProperties": False,
        },
        "either": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "string", "maxLength": 2},
                             {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}]},
    },
    "required": ["id", "name", "kind", "tags", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models: a second intra-op thread only stalls on a busy machine (10x slower here)."""


def tiny_generator(tok, seed: int = 0, max_seq_len: int = 320) -> Generator:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=1, n_head=2, d_ff=64, max_seq_len=max_seq_len)
    return Generator(DecoderLM(cfg).eval(), tok)


@pytest.fixture(scope="module")
def char_gen() -> Generator:
    return tiny_generator(build_tokenizer("char", ALPHABET))


@pytest.fixture(scope="module")
def bpe_gen() -> Generator:
    text = json.dumps([{"name": "ab", "id": 12, "tags": ["x", "yz"], "owner": {"ok": True}}] * 50) + ALPHABET * 20
    return tiny_generator(build_tokenizer("bpe", text, vocab_size=320), seed=1)


def _check_json(results, schema, min_finished: float) -> None:
    finished = [r for r in results if r.finish_reason == "stop"]
    for r in finished:
        assert r.complete is True
        jsonschema.validate(json.loads(r.text), schema)  # raises on any violation
    for r in results:
        if r.finish_reason == "length":
            assert r.complete is False  # a prefix, and said to be one
    assert len(finished) >= min_finished * len(results), [r.text for r in results if r.finish_reason != "stop"][:3]


def test_temperature_one_samples_of_a_char_model_validate_against_a_nested_schema(char_gen):
    params = SamplingParams(temperature=1.0, max_new_tokens=240, seed=0, constraint=C.json_schema(NESTED))
    results = char_gen.generate(["x"] * 200, params, logprobs=False)
    _check_json(results, NESTED, 0.9)
    # the samples differ (the mask leaves the model's choices among the allowed tokens)
    assert len({r.text for r in results}) > 150


def test_temperature_one_samples_of_a_bpe_model_validate_against_a_nested_schema(bpe_gen):
    params = SamplingParams(temperature=1.0, max_new_tokens=240, seed=3, constraint=C.json_schema(NESTED))
    results = bpe_gen.generate(["x"] * 100, params, logprobs=False)
    _check_json(results, NESTED, 0.9)
    assert any(len(bpe_gen.tokenizer.token_bytes(t)) > 1 for r in results for t in r.token_ids)  # multi-byte tokens


def test_optional_fields_are_sometimes_present_and_sometimes_absent(char_gen):
    params = SamplingParams(temperature=1.0, max_new_tokens=240, seed=5, constraint=C.json_schema(NESTED))
    objs = [json.loads(r.text) for r in char_gen.generate(["y"] * 64, params, logprobs=False)
            if r.finish_reason == "stop"]
    for key in ("code", "score", "either"):
        present = sum(key in o for o in objs)
        assert 0 < present < len(objs), key


def test_json_object_samples_parse_as_objects(bpe_gen):
    params = SamplingParams(temperature=1.0, max_new_tokens=120, seed=2, constraint=C.json_object())
    results = bpe_gen.generate(["x"] * 64, params, logprobs=False)
    _check_json(results, {"type": "object"}, 0.5)


@pytest.mark.parametrize("pattern", [r"[a-c]{2,4}@[0-9]{1,3}\.(com|org)", r"(yes|no)(, [a-z]{1,3})*\.",
                                     r"-?(0|[1-9][0-9]{0,2})(\.[0-9]{1,2})?"])
def test_regex_samples_fullmatch(char_gen, bpe_gen, pattern):
    for gen in (char_gen, bpe_gen):
        params = SamplingParams(temperature=1.0, max_new_tokens=60, seed=1, constraint=C.regex(pattern))
        results = gen.generate(["z"] * 100, params, logprobs=False)
        done = [r.text for r in results if r.finish_reason == "stop"]
        assert len(done) >= 90
        assert all(re.fullmatch(pattern, t) for t in done), [t for t in done if not re.fullmatch(pattern, t)]


def test_choice_samples_are_one_of_the_choices_and_cover_them(bpe_gen):
    options = ["yes", "no", "maybe not", "{ok}"]
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=4, constraint=C.choice(options))
    texts = [r.text for r in bpe_gen.generate(["q"] * 200, params, logprobs=False)]
    assert set(texts) == set(options)


def test_greedy_constrained_decoding_stays_in_the_language(char_gen):
    params = SamplingParams(temperature=0, max_new_tokens=240, constraint=C.json_schema(NESTED))
    results = char_gen.generate(["a", "b", "c"], params, logprobs=False)
    _check_json(results, NESTED, 1.0)


def test_rows_of_one_engine_keep_their_own_constraints_and_an_unconstrained_row_is_untouched(char_gen):
    """Continuous batching with a prefix cache: rows of different grammars (and one without) join the
    engine at different steps; each row meets its own grammar, and the free row draws exactly what it
    draws alone."""
    gen, tok = char_gen, char_gen.tokenizer
    tb = TokenBytes(tok)
    vocab = C.TokenVocabulary.of(tok, gen.vocab_size, [tok.eos_id])
    grammars = [C.json_schema(NESTED), C.regex(r"[a-f]{3,8}"), C.choice(["alpha", "beta"]), None,
                C.json_schema({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                               "minItems": 2, "maxItems": 4})]
    prompt = tok.encode("shared prefix of every prompt: " * 2)

    def row(g, seed):
        params = SamplingParams(temperature=1.0, max_new_tokens=200, seed=seed, constraint=g)
        r = EngineRow(prompt, params, TextState(tb, [tok.eos_id]), want_logprobs=False,
                      constraint=None if g is None else C.Matcher(g, vocab))
        r.generator = torch.Generator().manual_seed(seed)
        return r

    def run(rows, joins):
        engine = BatchEngine(gen.model, max_batch=len(rows), max_len=320,
                             prefix_cache=new_prefix_cache(gen.model, 4))
        step, pending = 0, list(zip(joins, rows))
        with torch.inference_mode():
            while pending or engine.rows:
                for j, r in [p for p in pending if p[0] <= step]:
                    engine.add(r)
                    pending.remove((j, r))
                for o in engine.step():
                    if o.finish_reason is not None:
                        engine.remove(o.row)
                step += 1
        return rows

    for trial in range(4):
        rows = run([row(g, 10 * trial + i) for i, g in enumerate(grammars)], joins=[0, 2, 3, 5, 9])
        for g, r in zip(grammars, rows):
            if g is None or r.finish_reason != "stop":
                continue
            text = r.text.text
            if g.kind == "json_schema":
                jsonschema.validate(json.loads(text), g.schema)
            elif g.kind == "regex":
                assert re.fullmatch(g.source, text)
            else:
                assert text in ("alpha", "beta")
        alone = run([row(None, 10 * trial + 3)], joins=[0])[0]
        assert alone.token_ids == rows[3].token_ids


def test_a_schema_that_cannot_finish_in_the_budget_ends_with_length_and_says_so(char_gen):
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 40}}, "required": ["s"]}
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=0, constraint=C.json_schema(schema))
    results = char_gen.generate(["x"] * 8, params, logprobs=False)
    assert all(r.finish_reason == "length" and r.complete is False for r in results)
    for r in results:
        with pytest.raises(json.JSONDecodeError):
            json.loads(r.text)


def test_an_unsupported_keyword_is_an_error_that_names_it():
    for keyword, schema in [("uniqueItems", {"type": "array", "uniqueItems": True}),
                            ("contains", {"type": "array", "contains": {"const": 1}}),
                            ("dependentRequired", {"type": "object", "dependentRequired": {"a": ["b"]}})]:
        with pytest.raises(GenerationError, match=keyword):
            C.json_schema(schema)


@pytest.mark.parametrize("bad, message", [('{"type": "foo"}', "foo"), ("{not json", "not valid JSON"),
                                          ("[1, 2]", "must be an object"), ("false", "allows no value")])
def test_invalid_schemas_are_one_line_errors(bad, message):
    with pytest.raises(GenerationError, match=message) as info:
        C.json_schema(bad)
    assert "\n" not in str(info.value)


def test_bad_regex_choices_and_grammars_are_errors():
    with pytest.raises(GenerationError, match="regex"):
        C.regex("a(b")
    with pytest.raises(GenerationError, match="choices"):
        C.choice([])
    with pytest.raises(GenerationError, match="grammar"):
        C.grammar("start: undefined_rule")


def test_gbnf_and_lark_grammars_constrain_the_output(char_gen):
    gbnf = 'root ::= "[" digit ("+" digit)* "]"\ndigit ::= [0-9]'
    lark = 'start: "[" DIGIT ("+" DIGIT)* "]"\nDIGIT: /[0-9]/'
    for g in (C.grammar(gbnf), C.grammar(lark)):
        params = SamplingParams(temperature=1.0, max_new_tokens=60, seed=0, constraint=g)
        done = [r.text for r in char_gen.generate(["g"] * 50, params, logprobs=False) if r.finish_reason == "stop"]
        assert len(done) >= 45 and all(re.fullmatch(r"\[[0-9](\+[0-9])*\]", t) for t in done)


def test_a_grammar_the_vocabulary_cannot_write_is_an_error_not_a_wrong_token(char_gen):
    params = SamplingParams(max_new_tokens=10, constraint=C.regex(r"ab\(c"))  # the char vocabulary has no "("
    with pytest.raises(TinyformerError, match="no token of the vocabulary continues the regex"):
        char_gen.generate(["x"], params)


def test_without_llguidance_the_error_names_the_extra(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_llguidance(name, *args, **kwargs):
        if name.startswith("llguidance"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    C._compile.cache_clear()
    with pytest.raises(GenerationError, match=r"pip install 'tinyformer\[structured\]'"):
        C.regex("a+b")
    C._compile.cache_clear()
