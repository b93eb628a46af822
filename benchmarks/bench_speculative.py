"""Speculative decoding against plain greedy decoding: tokens/s and acceptance, side by side in one process.

SmolLM2-135M-Instruct (a run folder from ``tinyformer convert --from-gguf``, and its int8 copy from
``tinyformer quantize``), greedy, batch 1, end-of-sequence ignored, eager decoding (--compile: the packaged
steps). Each prompt is decoded plain, with prompt lookup (``ngram``, each --draft-tokens K) and, with
--draft-layers, with a draft model (the first N layers of the same model, its final norm and head: same
tokenizer, no training), one after the other, --reps rounds, so that the machine's load hits every method
alike; the medians are reported with the ratio to plain and the acceptance rate (draft tokens kept /
proposed). Every speculative output is checked token for token against the plain one.

Prompts (built from text on disk, as plain text to continue):

  copy      500 characters of TinyShakespeare, then "The same passage, copied exactly:" and its first words
  code      30 lines of json.decoder.py_scanstring (the standard library's source), then "The same code with
            py_scanstring renamed to scan_string:" and the renamed def
  quote     through the run's chat template: a user turn with a quoted document (textwrap.TextWrapper's
            docstring) and "Which sentence of the document says what the width option does? Quote it
            exactly.", the assistant turn opened with a quotation mark
  free      free writing: "Once upon a time, a dragon who wanted to learn to cook"
  quote-plain  (only with --prompts) the quote prompt before 2026-12-02: the same document as plain text, "Question:
            what do the width and expand_tabs options do? Answer by quoting the document.\nAnswer: \"";
            SmolLM2-135M-Instruct paraphrases there (docs/benchmarks/speculative.md)

Each row gives ``copied``: the share of the output's tokens inside a run of >= 4 tokens that also occurs in
the prompt, which says whether the text copies from its context (what prompt lookup can draft).

--llama-python runs llama-cpp-python's ``LlamaPromptLookupDecoding`` (and plain llama.cpp) on the same token
ids in a subprocess, alternating too.

    python benchmarks/bench_speculative.py --model RUN --int8 RUN_INT8 --threads 2 --draft-tokens 4 8 \\
        --llama-python /path/to/venv/bin/python --gguf F32=smol-f32.gguf Q8_0=smol-q8_0.gguf
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

from tinyformer.data.chat_template import ChatTemplate
from tinyformer.generation.compile_cache import compiled_step
from tinyformer.generation.generator import Generator
from tinyformer.generation.sampling import SamplingParams
from tinyformer.generation.speculative import SpeculativeConfig
from tinyformer.generation.weight_layout import prepare_for_decoding
from tinyformer.models.decoder import DecoderLM
from tinyformer.run_folder import load_model, load_tokenizer

SHAKESPEARE = Path("/work/shared/data/tinyshakespeare/input.txt")


DEFAULT_PROMPTS = ("copy", "code", "quote", "free")
QUOTE_QUESTION = "Which sentence of the document says what the width option does? Quote it exactly."


def prompts(shakespeare: Path, chat: ChatTemplate) -> dict[str, str]:
    """The prompts, from TinyShakespeare and the standard library's sources; ``chat`` renders the quote
    prompt's user turn."""
    text = shakespeare.read_text(encoding="utf-8") if shakespeare.is_file() else inspect.getsource(textwrap)
    start = text.index("\n\n", 2000) + 2  # a speech's first line
    passage = text[start : text.rindex("\n", start, start + 500)]
    import json as json_module
    src = inspect.getsource(json_module.decoder)
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "py_scanstring")
    code = ast.get_source_segment(src, fn) or ""
    code = "\n".join(code.splitlines()[:30])
    doc = (inspect.getdoc(textwrap.TextWrapper) or "")[:900]
    first = " ".join(passage.split()[:4])
    # an instruct model answers a question in its chat format; the opening quotation mark starts the quote,
    # as the copy and code prompts start their copies
    quote = chat.render([{"role": "user", "content": f"Document:\n\"\"\"\n{doc}\n\"\"\"\n\n{QUOTE_QUESTION}"}]) + '"'
    return {
        "copy": f"{passage}\n\nThe same passage, copied exactly:\n\n{first}",
        "code": f"```python\n{code}\n```\n\nThe same code with py_scanstring renamed to scan_string:\n\n"
                f"```python\ndef scan_string(",
        "quote": quote,
        "free": "Once upon a time, a dragon who wanted to learn to cook",
        "quote-plain": f"Document:\n\"\"\"\n{doc}\n\"\"\"\n\nQuestion: what do the width and expand_tabs options do? "
                 "Answer by quoting the document.\nAnswer: \"",
    }


def copied(output: list[int], prompt: list[int], n: int = 4) -> float:
    """The share of ``output``'s tokens inside a run of >= n tokens that also occurs in ``prompt``:
    |{i : output[j : j + n] occurs in prompt for some j in (i - n, i]}| / len(output)."""
    grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    covered = [False] * len(output)
    for i in range(len(output) - n + 1):
        if tuple(output[i : i + n]) in grams:
            covered[i : i + n] = [True] * n
    return sum(covered) / max(1, len(output))


def truncated_copy(model: DecoderLM, n_layer: int) -> DecoderLM:
    """The first ``n_layer`` blocks of ``model`` with its embedding, final norm and head: a draft model that
    shares the tokenizer (early exit, not trained)."""
    cfg = dataclasses.replace(model.cfg, n_layer=n_layer)
    draft = DecoderLM(cfg)
    sd = {k: v for k, v in model.state_dict().items()
          if not k.startswith("blocks.") or int(k.split(".")[1]) < n_layer}
    draft.load_state_dict(sd, strict=False)
    return draft.eval()


def run_tinyformer(run: str, label: str, texts: dict[str, str], args) -> list[dict]:
    with torch.inference_mode(False):  # --compile: torch.export cannot trace inference-mode parameters
        model = load_model(run).eval()
        return _run_tinyformer(model, run, label, texts, args)


def _run_tinyformer(model: DecoderLM, run: str, label: str, texts: dict[str, str], args) -> list[dict]:
    prepare_for_decoding(model)
    tok = load_tokenizer(run)
    ids = {name: tok.encode(t) for name, t in texts.items()}
    # --compile: every method decodes with the packaged steps (the one-token step and the verification over
    # up to K + 1 positions), as the commands do by default
    compiled = {"compile": True} if args.compile else {}
    methods: dict[str, Generator] = {"plain": Generator(model, tok, **compiled)}
    for k in args.draft_tokens:
        methods[f"ngram K={k}"] = Generator(model, tok, speculative=SpeculativeConfig("ngram", k), **compiled)
        if args.compile and args.eager_verification:  # the packaged one-token step, the verification eager
            g = methods[f"ngram K={k} eager verification"] = Generator(
                model, tok, speculative=SpeculativeConfig("ngram", k), **compiled)
            g._compiled = compiled_step(model, True)
            g._compiled.verifier = lambda *a: None
    drafts = []
    if args.draft_layers:
        drafts.append((f"draft: first {args.draft_layers} layers", truncated_copy(load_model(run).eval(),
                                                                                  args.draft_layers)))
    if args.draft_run and label == "fp32":
        drafts.append((f"draft: {Path(args.draft_run).name}", load_model(args.draft_run).eval()))
    for name, draft in drafts:
        prepare_for_decoding(draft)
        methods[f"{name} K={args.draft_model_tokens}"] = Generator(
            model, tok, speculative=SpeculativeConfig("draft", args.draft_model_tokens), draft_model=draft,
            draft_tokenizer=tok, **compiled)
    for g in methods.values():
        g.eos_token_id = None
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)
    rows = []
    for name, p in ids.items():
        if args.compile:  # builds (or loads) the packages outside the timed calls
            for g in methods.values():
                g.generate([p], params, logprobs=False)
        speeds: dict[str, list[float]] = {m: [] for m in methods}
        acc: dict[str, tuple[int, int]] = {}
        out: dict[str, list[int]] = {}
        for _ in range(args.reps):
            for m, g in methods.items():  # alternating: the load hits every method alike
                r = g.generate([p], params, logprobs=False)[0]
                speeds[m].append(g.timings.decode_tokens_per_s)
                out[m] = r.token_ids
                if g.timings.draft_proposed is not None:
                    acc[m] = (g.timings.draft_accepted, g.timings.draft_proposed)
        base = statistics.median(speeds["plain"])
        for m in methods:
            tps = statistics.median(speeds[m])
            a, n = acc.get(m, (0, 0))
            rows.append({"weights": label, "prompt": name, "prompt_tokens": len(p), "method": m,
                         "tokens_per_s": round(tps, 2), "ratio": round(tps / base, 2),
                         "acceptance": round(a / n, 2) if n else None, "proposed": n,
                         "copied": round(copied(out["plain"], p), 2),
                         "same_as_plain": out[m] == out["plain"], "load": os.getloadavg()[0]})
            print(json.dumps(rows[-1]), flush=True)
        print(f"  {label} {name}: {tok.decode(out['plain'])[:80]!r}", file=sys.stderr, flush=True)
    return rows


def forward_costs(run: str, sizes: list[int], rounds: int = 5) -> None:
    """The cost of one row call over T positions after a 300-token prefix, relative to the first size (1): what
    a verification of T - 1 drafts costs in one-token steps (medians of ``rounds``, calls alternating). Each
    T > 1 twice: its queries attending together, and one call per query (``per_query``, the engine's eager
    verification); each with ``max_logit_diff``, the largest difference between its logits and those of T
    one-token steps over the same tokens from the same cache, each step attending per query as the engine's
    steps do (0.0: bit for bit)."""
    model = load_model(run).eval()
    prepare_for_decoding(model)
    cache = model.new_cache(1, 1024, spare_slots=max(sizes))
    model(torch.randint(0, 1000, (1, 300), generator=torch.Generator().manual_seed(0)), cache=cache)
    calls = [(t, per_query) for t in sizes for per_query in ((False, True) if t > 1 else (False,))]
    times: dict[tuple[int, bool], list[float]] = {c: [] for c in calls}
    for _ in range(rounds):
        for t, per_query in calls:
            x = torch.randint(0, 1000, (1, t))
            t0 = time.perf_counter()
            model(x, cache=cache.at(torch.tensor([300]), 300 + t, per_query=per_query))
            times[t, per_query].append(time.perf_counter() - t0)
    base = statistics.median(times[calls[0]])
    for t, per_query in calls:
        ms = statistics.median(times[t, per_query]) * 1e3
        row = {"forward_positions": t, "per_query": per_query, "ms": round(ms, 1),
               "vs_first": round(ms / 1e3 / base, 2), "load": os.getloadavg()[0]}
        if t > 1:
            x = torch.randint(0, 1000, (1, t), generator=torch.Generator().manual_seed(t))
            stepped, verified = copy.deepcopy(cache), copy.deepcopy(cache)
            steps = torch.cat([model(x[:, i : i + 1], cache=stepped.at(torch.tensor([300 + i]), per_query=True))[:, -1]
                               for i in range(t)])
            together = model(x, cache=verified.at(torch.tensor([300]), per_query=per_query))[0]
            row["max_logit_diff"] = float((together - steps).abs().max())
        print(json.dumps(row), flush=True)


def packaged_forward_costs(run: str, sizes: list[int], rounds: int = 15) -> None:
    """``forward_costs`` for the packaged steps the commands run by default (``--compile``): the greedy one-token
    step (T = 1) and the verification package over T = 2 .. max(sizes) positions, built first if missing, each
    after a 300-token prefix (medians of ``rounds``, calls alternating)."""
    with torch.inference_mode(False), torch.no_grad():  # export cannot trace inference-mode tensors
        model = load_model(run).eval()
        prepare_for_decoding(model)
        step = compiled_step(model)
        cache = model.new_cache(1, 1024, spare_slots=max(sizes))
        model(torch.randint(0, 1000, (1, 300), generator=torch.Generator().manual_seed(0)), cache=cache)
        one, verify = step.get(True), step.verifier(max(sizes), 1, cache)
        if verify is None and max(sizes) > 1:
            raise SystemExit(f"{run}: the verification did not export (see the .failed file in the compile cache)")
        position = torch.tensor([300])
        times: dict[int, list[float]] = {t: [] for t in sizes}
        for _ in range(rounds):
            for t in sizes:
                x, span = torch.randint(0, 1000, (1, t)), torch.empty(300 + t)
                t0 = time.perf_counter()
                (one if t == 1 else verify)(x, position, cache, span)
                times[t].append(time.perf_counter() - t0)
    base = statistics.median(times[sizes[0]])
    for t in sizes:
        ms = statistics.median(times[t]) * 1e3
        print(json.dumps({"forward_positions": t, "packaged": True, "ms": round(ms, 1),
                          "vs_first": round(ms / 1e3 / base, 2), "load": os.getloadavg()[0]}), flush=True)


LLAMA_SIDE = r'''
import json, sys, time, statistics
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
cfg = json.load(open(sys.argv[1]))
label, path = sys.argv[2], sys.argv[3]
llms = {"llama.cpp plain": Llama(path, n_ctx=2048, n_threads=cfg["threads"], verbose=False)}
for k in cfg["draft_tokens"]:
    llms[f"llama.cpp prompt lookup K={k}"] = Llama(path, n_ctx=2048, n_threads=cfg["threads"], verbose=False,
        draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k))
for name, ids in cfg["prompts"].items():
    speeds = {m: [] for m in llms}
    for _ in range(cfg["reps"]):
        for m, llm in llms.items():
            llm.reset()
            times = []
            # Llama.generate yields one token at a time (prompt lookup inside) and never stops at EOS
            for _tok in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0):
                times.append(time.perf_counter())
                if len(times) >= cfg["new_tokens"]:
                    break
            speeds[m].append((len(times) - 1) / (times[-1] - times[0]))
    base = statistics.median(speeds["llama.cpp plain"])
    for m in llms:
        tps = statistics.median(speeds[m])
        print(json.dumps({"weights": label, "prompt": name, "method": m, "tokens_per_s": round(tps, 2),
                          "ratio": round(tps / base, 2)}), flush=True)
'''


def run_llama(args, texts: dict[str, str]) -> list[dict]:
    tok = load_tokenizer(args.model)
    ids = {name: tok.encode(t) for name, t in texts.items()}
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "cfg.json"
        cfg.write_text(json.dumps({"threads": args.threads, "prompts": ids, "reps": args.reps,
                                   "new_tokens": args.new_tokens, "draft_tokens": args.draft_tokens}))
        script = Path(d) / "llama_side.py"
        script.write_text(LLAMA_SIDE)
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        rows = []
        for spec in args.gguf:
            label, _, path = spec.rpartition("=")
            proc = subprocess.run([args.llama_python, str(script), str(cfg), label or Path(path).name, path],
                                  capture_output=True, text=True, env=env)
            if proc.returncode:
                print(proc.stderr[-2000:], file=sys.stderr)
                continue
            for line in proc.stdout.splitlines():
                if line.startswith("{"):
                    rows.append(json.loads(line))
                    print(line, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="SmolLM2-135M run folder (convert --from-gguf)")
    ap.add_argument("--int8", default=None, help="its int8 run folder (tinyformer quantize --type int8)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[8], help="K of the ngram runs")
    ap.add_argument("--draft-layers", type=int, default=0, help="a draft model of the first N layers (0: none)")
    ap.add_argument("--draft-run", default=None, help="a draft model's run folder (same tokenizer), fp32 only")
    ap.add_argument("--draft-model-tokens", type=int, default=4, help="K of the draft-model run")
    ap.add_argument("--prompts", nargs="+", default=None,
                    help="a subset of copy, code, quote, free, quote-plain (default: the first four)")
    ap.add_argument("--shakespeare", type=Path, default=SHAKESPEARE)
    ap.add_argument("--llama-python", default=None, help="python of a venv with llama-cpp-python")
    ap.add_argument("--gguf", nargs="+", default=None, metavar="[LABEL=]FILE", help="the GGUF files llama.cpp loads")
    ap.add_argument("--out", type=Path, default=None, help="write every row as JSON lines here")
    ap.add_argument("--llama-only", action="store_true", help="run the llama.cpp side only")
    ap.add_argument("--compile", action="store_true",
                    help="one-token steps on the packaged compiled step (the commands' default), built before timing")
    ap.add_argument("--eager-verification", action="store_true",
                    help="with --compile, also each ngram K with its verification eager (the packaged step's "
                         "one-token steps): what the packaged verification itself gains")
    ap.add_argument("--skip-fp32", action="store_true", help="leave out the --model (fp32) rows: --int8 and llama.cpp")
    ap.add_argument("--forward-cost", type=int, nargs="+", default=None, metavar="T",
                    help="only time one forward over T positions (e.g. 1 5 9) and exit; with --compile also the "
                         "packaged step (T = 1) and verification (T > 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.forward_cost:
        with torch.inference_mode():
            for run in (args.model, args.int8):
                if run:
                    print(f"# {run}", flush=True)
                    forward_costs(run, args.forward_cost)
                    if args.compile:
                        packaged_forward_costs(run, args.forward_cost)
        return
    texts = prompts(args.shakespeare, ChatTemplate(load_tokenizer(args.model)))
    texts = {k: v for k, v in texts.items() if k in (args.prompts or DEFAULT_PROMPTS)}
    print(f"# {platform.processor() or platform.machine()}, {args.threads} threads, load at start "
          f"{os.getloadavg()}", flush=True)
    started = time.time()
    rows = []
    with torch.inference_mode():
        if not args.llama_only and not args.skip_fp32:
            rows += run_tinyformer(args.model, "fp32", texts, args)
        if args.int8 and not args.llama_only:
            rows += run_tinyformer(args.int8, "int8", texts, args)
    if args.llama_python and args.gguf:
        rows += run_llama(args, texts)
    print(f"# {time.time() - started:.0f} s, load at end {os.getloadavg()}", flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
