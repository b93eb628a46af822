"""`tinyformer generate`: continue a prompt with a trained model, streaming the text as it is decoded.

    tinyformer generate --model RUN --prompt "Once upon a time" --temperature 0.8 --top-k 50 --seed 1

The human-readable output is the prompt followed by its continuation (as llama.cpp's command line prints
it), so that the text reads from its start; ``--no-echo`` prints the continuation alone (the default with
``--chat``, whose prompt is a rendered conversation). ``--verbose`` timings go to stderr on a line of their
own. ``--temperature 0`` is greedy decoding. ``--json`` prints one JSON object per sample, one per line,
instead of streaming text. ``--chat`` renders the prompt as one user message with the model's chat
template (as ``tinyformer chat`` does) and stops at the end of the assistant's turn.
Sample i of ``--num-samples N`` uses seed ``--seed + i``; the samples are
the same whether they are decoded one at a time (streaming) or as one batch (``--json``).
The sampler, streaming and stop logic live in ``tinyformer.generation``; this module only parses
flags and prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

from tinyformer.cli.common import (
    add_decoding_args,
    decide_compile,
    read_prompt,
    speculative_from_args,
    template_timeout,
)
from tinyformer.devices import resolve_device, resolve_dtype
from tinyformer.errors import GenerationError
from tinyformer.generation import constraint
from tinyformer.generation.beam import DEFAULT_EARLY_STOPPING, DEFAULT_LENGTH_PENALTY
from tinyformer.generation.constraint import Grammar
from tinyformer.generation.generator import CONTEXT_POLICIES, Generator
from tinyformer.generation.sampling import HUMAN_TEMPERATURE, HUMAN_TOP_K, SamplingParams

DEFAULT_MAX_NEW_TOKENS = 256


# ------------------------------------------------------------------ flags shared with `tinyformer chat`


def add_model_args(p: argparse.ArgumentParser) -> None:
    add_decoding_args(p, "a torch.compile-d step")
    p.add_argument("--context-policy", default="error", choices=CONTEXT_POLICIES,
                   help="when prompt + new tokens exceed the model's context: 'error' refuses; 'slide' keeps "
                        "the last tokens (--slide-keep) and prefills them again (default: error)")
    p.add_argument("--slide-keep", type=int, default=None, metavar="N",
                   help="tokens kept when the context slides (default: 3/4 of the context)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    d = SamplingParams()
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help=f"tokens to generate at most (default: {DEFAULT_MAX_NEW_TOKENS}, or what fits in the "
                        "context under --context-policy error)")
    # the human default (generation/sampling.py): small models read far better a little below temperature 1
    # with the long tail cut off; the library's SamplingParams() stays the plain distribution
    g.add_argument("--temperature", type=float, default=HUMAN_TEMPERATURE,
                   help=f"softmax temperature; 0 = greedy, 1 = the model's distribution (default: {HUMAN_TEMPERATURE})")
    g.add_argument("--top-k", type=int, default=HUMAN_TOP_K,
                   help=f"keep the k most probable tokens; 0 = off (default: {HUMAN_TOP_K})")
    g.add_argument("--top-p", type=float, default=d.top_p, help="nucleus: smallest set with mass >= p, in (0, 1]")
    g.add_argument("--min-p", type=float, default=d.min_p, help="drop tokens below min_p * max probability")
    g.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty,
                   help="CTRL penalty on tokens already seen (1 = off)")
    g.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty,
                   help="subtract this per earlier occurrence of a token (0 = off)")
    g.add_argument("--presence-penalty", type=float, default=d.presence_penalty,
                   help="subtract this once from every token already generated (0 = off)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop before this text (repeatable; \\n and \\t are understood)")
    g.add_argument("--seed", type=int, default=None, help="random seed: the same seed gives the same output")
    # structured output (generation/constraint.py): the output is built token by token to belong to the language
    g = p.add_argument_group("structured output (one of; needs pip install 'tinyformer[structured]')")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--json-schema", metavar="FILE|JSON",
                   help="the output is JSON valid under this schema (a file, or the schema's JSON text)")
    x.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    x.add_argument("--regex", metavar="RE", help="the whole output matches this regular expression")
    x.add_argument("--grammar", metavar="FILE", help="the output follows this Lark or GBNF grammar file")
    x.add_argument("--choice", action="append", default=None, metavar="TEXT",
                   help="the output is exactly one of these texts (repeatable)")


def constraint_from_args(args: argparse.Namespace) -> Grammar | None:
    """The Grammar of the structured-output flags (None without one); bad values raise GenerationError."""
    if "_constraint" in vars(args):
        return args._constraint
    g: Grammar | None = None
    if getattr(args, "json_schema", None) is not None:
        text = args.json_schema
        path = Path(text)
        if not text.lstrip().startswith(("{", "[")) and text.strip() not in ("true", "false"):
            if not path.is_file():
                raise GenerationError(f"--json-schema {text}: no such file, and not a JSON schema's text")
            text = path.read_text(encoding="utf-8")
        g = constraint.json_schema(text)
    elif getattr(args, "json_object", False):
        g = constraint.json_object()
    elif getattr(args, "regex", None) is not None:
        g = constraint.regex(args.regex)
    elif getattr(args, "grammar", None) is not None:
        path = Path(args.grammar)
        if not path.is_file():
            raise GenerationError(f"--grammar {path}: no such file")
        g = constraint.grammar(path.read_text(encoding="utf-8"))
    elif getattr(args, "choice", None):
        g = constraint.choice(args.choice)
    args._constraint = g
    return g


def warn_incomplete(results: Any, max_new_tokens: int) -> None:
    """One stderr line per sample whose --max-new-tokens ran out before its constraint was complete."""
    for i, r in enumerate(results):
        if r.complete is False:
            print(f"warning: sample {i + 1} is incomplete: --max-new-tokens {max_new_tokens} ran out before the "
                  "output completed its structure", file=sys.stderr, flush=True)


def unescape(text: str) -> str:
    """Shell-friendly escapes in a --stop value: \\n, \\t and \\\\ (nothing else is touched)."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def sampling_params(args: argparse.Namespace, max_new_tokens: int, **changes: Any) -> SamplingParams:
    """SamplingParams from the flags, validated (impossible values raise GenerationError)."""
    flags = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                 repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                 presence_penalty=args.presence_penalty, max_new_tokens=max_new_tokens, seed=args.seed,
                 stop_strings=tuple(unescape(s) for s in args.stop), constraint=constraint_from_args(args))
    return SamplingParams(**{**flags, **changes}).validate()


def load_generator(args: argparse.Namespace) -> Generator:
    """Check the flags that need no model first (cheap, clear errors), then load the run folder; decide
    ``--compile`` for the loaded model (by default the compiled step where it was built, see ``decide_compile``)."""
    speculative = speculative_from_args(args)
    device = resolve_device(args.device, GenerationError)
    dtype = resolve_dtype(args.dtype, device, GenerationError)
    gen = Generator.from_run(args.model, device=device, dtype=dtype, context_policy=args.context_policy,
                             slide_keep=args.slide_keep, verify=not args.no_verify,
                             speculative=speculative, draft_run=args.draft_model)
    gen.compile = decide_compile(args.compile, gen.model, run_dir=args.model, dtype=dtype)
    return gen


def budget(args: argparse.Namespace, gen: Generator, prompt_len: int) -> int:
    """--max-new-tokens, or by default 256 capped to the room left in the context (policy error).
    An explicit value is never changed: one that does not fit is the engine's error to report."""
    if args.max_new_tokens is not None:
        return args.max_new_tokens
    if gen.context_policy == "error" and prompt_len < gen.max_seq_len:
        return min(DEFAULT_MAX_NEW_TOKENS, gen.max_seq_len - prompt_len)
    return DEFAULT_MAX_NEW_TOKENS


def use_replacement_on_output() -> None:
    # A terminal that cannot show a character should get '?' instead of a crash mid-stream.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")


# ------------------------------------------------------------------ the command


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a trained model",
                       description="Generate text from a run folder, streaming it to the terminal.")
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the text to continue")
    src.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a UTF-8 file ('-' = stdin)")
    p.add_argument("--num-samples", type=int, default=1, metavar="N", help="independent samples (seeds seed+i)")
    p.add_argument("--num-beams", type=int, default=1, metavar="K",
                   help="beam search with K beams instead of sampling (prints the best --num-samples beams)")
    p.add_argument("--length-penalty", type=float, default=DEFAULT_LENGTH_PENALTY,
                   help=f"beam search ranks log p / length**penalty (default {DEFAULT_LENGTH_PENALTY})")
    p.add_argument("--early-stopping", choices=["false", "true", "never"], default=str(DEFAULT_EARLY_STOPPING).lower(),
                   help="beam search: stop at K finished beams (true), when the best open beam scored at its "
                        "length cannot win (false, the default), or when no longer beam can win (never)")
    p.add_argument("--echo", action=argparse.BooleanOptionalAction, default=None,
                   help="print the prompt before the generated text (default: on, off with --chat; --no-echo: "
                        "the generated text alone; --json never echoes)")
    p.add_argument("--chat", action="store_true",
                   help="the prompt is one user message: render it with the model's chat template (as `chat` "
                        "does) and stop at the end of the assistant's turn")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per sample and line: text, token_ids (generated), logprobs, "
                        "timings (prompt_tokens, prefill_ms, completion_tokens, decode_tokens_per_s; with "
                        "--speculative also draft_proposed, draft_accepted)")
    p.add_argument("--verbose", action="store_true",
                   help="print the timings (prefill, decode tokens/s) to stderr after each sample")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the end-of-sequence token: decode exactly --max-new-tokens")
    add_sampling_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    use_replacement_on_output()
    if args.num_samples < 1:
        raise GenerationError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.num_beams < 1:
        raise GenerationError(f"--num-beams must be >= 1, got {args.num_beams}")
    if args.num_beams > 1 and args.num_samples > args.num_beams:
        raise GenerationError(f"--num-samples ({args.num_samples}) cannot exceed --num-beams ({args.num_beams})")
    if args.num_beams > 1 and speculative_from_args(args) is not None:
        raise GenerationError("speculative decoding does not apply to beam search: drop --speculative / "
                              "--draft-model or --num-beams")
    if args.num_beams > 1 and constraint_from_args(args) is not None:
        raise GenerationError("--num-beams does not take --json-schema, --json-object, --regex, --grammar or --choice")
    prompt = read_prompt(args, stdin=True)
    # Impossible sampler values are reported before the (slow) model load.
    sampling_params(args, 0 if args.max_new_tokens is None else args.max_new_tokens)
    timeout_s = template_timeout(args)
    gen = load_generator(args)
    if args.ignore_eos:
        gen.eos_token_id = None
    echo = (not args.chat) if args.echo is None else args.echo
    if args.chat:
        from tinyformer.data.chat_template import ChatTemplate
        from tinyformer.generation.chat import ChatSession

        session = ChatSession(gen, template=ChatTemplate(gen.tokenizer, timeout_s=timeout_s))
        prompt = session.template.render([{"role": "user", "content": prompt}])
    ids = gen.encode(prompt)
    params = sampling_params(args, budget(args, gen, len(ids)))
    if args.chat:
        params = session.stop_params(params).validate()

    if args.num_beams > 1:
        early_stopping = {"false": False, "true": True}.get(args.early_stopping, args.early_stopping)
        results = gen.beam_search(ids, args.num_beams, params.max_new_tokens, args.length_penalty,
                                  params.stop_token_ids, early_stopping=early_stopping,
                                  num_return_sequences=args.num_samples)
    elif args.json:
        results = gen.generate([ids] * args.num_samples, params)
    else:
        results = None

    if results is not None:
        for i, result in enumerate(results):
            if args.json:
                line = result.to_dict()
                if args.num_beams == 1:  # one batch: its timings on every line
                    line["timings"] = gen.timings.to_dict()
                print(json.dumps(line, ensure_ascii=False), flush=True)
            else:
                header(args, i)
                print((prompt if echo else "") + result.text, flush=True)
        if args.verbose and args.num_beams == 1:
            print_timings(gen)
        warn_incomplete(results, params.max_new_tokens)
        return 0

    for i in range(args.num_samples):
        seed = None if params.seed is None else (params.seed + i) % 2**64
        header(args, i)
        pending = prompt if echo else ""  # written with the first piece: a prompt the engine refuses is not shown
        stream = gen.stream(ids, dataclasses.replace(params, seed=seed), logprobs=False)
        for piece in stream:
            sys.stdout.write(pending + piece)
            sys.stdout.flush()
            pending = ""
        sys.stdout.write(pending)
        sys.stdout.write("\n")
        sys.stdout.flush()
        warn_incomplete([stream.result], params.max_new_tokens)
        if args.verbose:
            print_timings(gen)
    return 0


def print_timings(gen: Generator) -> None:
    """The timings of the last sample on stderr, on a line of their own: stdout is flushed first (it ends
    with a newline), so that a terminal or a ``2>&1`` file shows them under the text, never glued to it."""
    sys.stdout.flush()
    t = gen.timings
    prefill_rate = t.prompt_tokens / (t.prefill_ms / 1e3) if t.prefill_ms > 0 else 0.0
    drafts = "" if t.draft_proposed is None else \
        f"; drafts: {t.draft_accepted} of {t.draft_proposed} accepted"
    print(f"prefill: {t.prompt_tokens} tokens in {t.prefill_ms:.1f} ms ({prefill_rate:.1f} tokens/s); decode: "
          f"{t.completion_tokens} tokens, {t.decode_tokens_per_s:.2f} tokens/s{drafts}", file=sys.stderr, flush=True)


def header(args: argparse.Namespace, i: int) -> None:
    if args.num_samples > 1 and not args.json:
        print(f"--- sample {i + 1} ---", flush=True)
