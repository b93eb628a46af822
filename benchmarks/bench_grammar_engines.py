"""Three grammar engines side by side: llguidance, xgrammar and outlines-core, on one CPU.

For each engine, on a run folder's tokenizer (SmolLM2-135M's 49,152 tokens after
``tinyformer convert --from-gguf``):

* setup: the engine's view of the vocabulary (each token's bytes), once per tokenizer;
* compile: one JSON schema (nested objects, arrays with bounds, enums, patterns) -> a matcher;
* mask: per generated token, the bitmask of the tokens that keep the output a valid prefix, while a
  valid instance of the schema is fed token by token (mean and worst step);
* keywords: which JSON-schema keywords each enforces. For each keyword a schema that uses it and an
  instance that breaks only it, fed one byte per token over a 256-byte vocabulary: the engine enforces
  the keyword when it refuses the instance (or refuses the schema with an error naming what it cannot
  do), ignores it when it accepts the instance.

    python benchmarks/bench_grammar_engines.py --run /tmp/smollm2

The engines are imported from wherever Python finds them (``pip install llguidance xgrammar
outlines-core``); an engine that is missing is reported as such.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
INSTANCE = ('{"name": "Ada Lovelace", "age": 36, "email": "ada@analytical.com", "role": "admin", '
            '"tags": ["math", "poetry"], "address": {"city": "London", "zip": "12345"}, "score": 0.97}')

# keyword -> (schema, an instance that violates only that keyword)
KEYWORDS: dict[str, tuple[dict[str, Any], str]] = {
    "type": ({"type": "integer"}, '"a"'),
    "properties/required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "{}"),
    "additionalProperties: false": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False}, '{"b": 1}'),
    "enum": ({"enum": ["x", "y"]}, '"z"'),
    "const": ({"const": "x"}, '"y"'),
    "minimum/maximum": ({"type": "integer", "minimum": 1, "maximum": 9}, "10"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 0}, "0"),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 1}, "1"),
    "type: [list]": ({"type": ["integer", "null"]}, '"a"'),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "4"),
    "number minimum": ({"type": "number", "minimum": 0.5}, "0.25"),
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 3}, '"abcd"'),
    "pattern": ({"type": "string", "pattern": "^[a-c]+$"}, '"abd"'),
    "format: date": ({"type": "string", "format": "date"}, '"2024-13-45x"'),
    "format: email": ({"type": "string", "format": "email"}, '"no-at-sign"'),
    "format: uuid": ({"type": "string", "format": "uuid"}, '"1234"'),
    "format: date-time": ({"type": "string", "format": "date-time"}, '"yesterday"'),
    "minItems/maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, "[1, 2, 3]"),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, '["a"]'),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    "contains": ({"type": "array", "contains": {"const": 5}}, "[1]"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, '"s"'),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, '"s"'),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "3"),
    "not": ({"not": {"type": "integer"}}, "3"),
    "$ref/$defs": ({"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i"}, '"a"'),
    "minProperties": ({"type": "object", "minProperties": 1}, "{}"),
    "maxProperties": ({"type": "object", "maxProperties": 1}, '{"a": 1, "b": 2}'),
    "patternProperties": ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, '{"xa": "s"}'),
    "if/then/else": ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "3"),
    "dependentRequired": ({"type": "object", "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "dependentSchemas": ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}'),
}


def run_tokens(run: Path) -> tuple[list[bytes], list[int], int]:
    """Each token's bytes (special tokens as b"\\xff" + name, llguidance's convention), the special ids, EOS."""
    from tinyformer.data.tokenizer import Tokenizer

    tok = Tokenizer.load(run / "tokenizer.json")
    specials = {i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
    tokens = [b"\xff" + (tok.id_to_token(i) or "").encode() if i in specials else tok.token_bytes(i)
              for i in range(tok.vocab_size)]
    return tokens, sorted(specials), int(tok.eos_id)


class Engine:
    name = ""

    def setup(self, tokens: list[bytes], specials: list[int], eos: int, encode: Any) -> None: ...
    def compile(self, schema: dict[str, Any]) -> Any: ...
    def mask(self, m: Any, out: torch.Tensor) -> None: ...
    def consume(self, m: Any, token: int) -> bool: ...
    def accepting(self, m: Any) -> bool: ...


class LLGuidance(Engine):
    name = "llguidance"

    def setup(self, tokens, specials, eos, encode):
        import llguidance

        self.ll = llguidance

        class Wrap:
            eos_token_id, bos_token_id, special_token_ids = eos, None, specials

            def __init__(self) -> None:
                self.tokens = tokens

            def __call__(self, s: Any) -> list[int]:
                # llguidance tokenizes strings of the grammar (and checks the tokenizer is canonical)
                return encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s)

        self.tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrap()))
        self.words = (len(tokens) + 31) // 32

    def compile(self, schema):
        g = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = self.ll.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def mask(self, m, out):
        m.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)

    def consume(self, m, token):
        return m.consume_token(token) and not m.is_error()

    def accepting(self, m):
        return m.is_accepting()


class XGrammar(Engine):
    name = "xgrammar"

    def setup(self, tokens, specials, eos, encode):
        import xgrammar

        self.xg = xgrammar
        vocab = [b"" if t.startswith(b"\xff") else t for t in tokens]
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.eos = eos

    def compile(self, schema):
        return self.xg.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema)))

    def mask(self, m, out):
        m.fill_next_token_bitmask(out)

    def consume(self, m, token):
        return m.accept_token(token)

    def accepting(self, m):
        return m.accept_token(self.eos)


class OutlinesCore(Engine):
    name = "outlines-core"

    def setup(self, tokens, specials, eos, encode):
        import outlines_core

        self.oc = outlines_core
        by_bytes: dict[bytes, list[int]] = {}
        for i, t in enumerate(tokens):
            if i != eos and not t.startswith(b"\xff") and t:
                by_bytes.setdefault(t, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, by_bytes)

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Guide(self.oc.Index(regex, self.vocab))

    def mask(self, m, out):
        m.write_mask_into(out.data_ptr(), out.numel(), 4)

    def consume(self, m, token):
        try:
            m.advance(token)
            return True
        except Exception:
            return False

    def accepting(self, m):
        return m.is_finished()


def byte_vocab() -> tuple[list[bytes], list[int], int, Any]:
    return [bytes([b]) for b in range(256)] + [b"\xff<eos>"], [256], 256, lambda s: list(s.encode())


def probe(engine: Engine, schema: dict[str, Any], instance: str) -> str:
    """'enforced' when the engine refuses ``instance`` (or the schema), else 'ignored'."""
    try:
        m = engine.compile(schema)
    except Exception as exc:
        return "refused: " + " ".join(str(exc).split())[:60]
    if all(engine.consume(m, b) for b in instance.encode()) and engine.accepting(m):
        return "ignored"
    return "enforced"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, required=True, help="run folder whose tokenizer.json to use")
    ap.add_argument("--repeat", type=int, default=3, help="compile and mask passes per engine (best kept)")
    args = ap.parse_args()
    from tinyformer.data.tokenizer import Tokenizer

    tokens, specials, eos = run_tokens(args.run)
    encode = Tokenizer.load(args.run / "tokenizer.json").encode
    ids = encode(INSTANCE)
    print(f"vocabulary {len(tokens)} tokens; instance {len(ids)} tokens; torch threads {torch.get_num_threads()}")
    rows = []
    keyword_table: dict[str, dict[str, str]] = {}
    for cls in (LLGuidance, XGrammar, OutlinesCore):
        engine = cls()
        try:
            t0 = time.perf_counter()
            engine.setup(tokens, specials, eos, encode)
            setup = time.perf_counter() - t0
        except ImportError as exc:
            print(f"{cls.name}: not installed ({exc})")
            continue
        compiles, means, worsts = [], [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            m = engine.compile(SCHEMA)
            compiles.append(time.perf_counter() - t0)
            out = torch.full(((len(tokens) + 31) // 32,), -1, dtype=torch.int32)
            steps = []
            for t in ids:
                t0 = time.perf_counter()
                engine.mask(m, out)
                steps.append(time.perf_counter() - t0)
                bit = (int(out[t // 32]) >> (t % 32)) & 1
                if not bit or not engine.consume(m, t):
                    raise SystemExit(f"{cls.name}: the valid instance was refused at token {t}")
            if not engine.accepting(m):
                raise SystemExit(f"{cls.name}: the valid instance was not accepted at its end")
            means.append(statistics.mean(steps))
            worsts.append(max(steps))
        rows.append((cls.name, setup, min(compiles), min(means), min(worsts)))
        small = cls()
        small.setup(*byte_vocab())
        keyword_table[cls.name] = {k: probe(small, s, bad) for k, (s, bad) in KEYWORDS.items()}
    print()
    print(f"{'engine':<14} {'vocab setup':>12} {'compile':>10} {'mask mean':>10} {'mask worst':>11}")
    for name, setup, comp, mean, worst in rows:
        print(f"{name:<14} {setup * 1e3:>10.1f}ms {comp * 1e3:>8.1f}ms {mean * 1e6:>8.1f}us {worst * 1e6:>9.1f}us")
    if rows:
        base = rows[0]
        for name, _, comp, mean, _ in rows[1:]:
            print(f"{name} / {base[0]}: compile {comp / base[2]:.1f}x, mask {mean / base[3]:.1f}x")
    print()
    names = list(keyword_table)
    print(f"{'keyword':<28} " + " ".join(f"{n:<24}" for n in names))
    for k in KEYWORDS:
        print(f"{k:<28} " + " ".join(f"{keyword_table[n][k]:<24}" for n in names))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
