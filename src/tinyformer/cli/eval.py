"""`tinyformer eval`: flags in, figures out; the evaluation itself is in :mod:`tinyformer.evaluation`.

    --data TEXT                  loss, perplexity, bits per byte       evaluation/text_loss.py
    --data CHAT_OR_PREFS.jsonl   assistant-token loss, or preference accuracy and mean log-prob margin
                                                                       evaluation/preference.py
    --task FILE.jsonl|builtin    accuracy on questions                 evaluation/tasks.py
    --harness TASKS              lm-evaluation-harness                 evaluation/harness.py
    --reward SPEC [--data P.jsonl]  mean reward of completions         evaluation/reward_scoring.py

Every mode adds its figures to the run's report card (``report.md``) when there is one
(:mod:`tinyformer.report_card`); ``--harness`` needs the ``eval`` extra.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tinyformer.cli.common import add_no_verify_flag
from tinyformer.errors import ConfigError
from tinyformer.training.train_config import DTYPES

# flags of the question modes, with their defaults: given with --data they would silently do nothing
_QUESTION_FLAGS = {"include_path": None, "num_fewshot": None, "limit": None, "builtin_questions": 100,
                   "max_new_tokens": 32}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="loss and perplexity of a run on a text corpus, accuracy on tasks",
                       description="Evaluate a run folder's model on a corpus (--data: mean next-token loss, "
                                   "perplexity and bits per byte) or on questions (--task, --harness: accuracy).")
    p.add_argument("--model", required=True, metavar="RUN", help="run folder (config.json, model.safetensors, "
                                                                  "tokenizer.json)")
    p.add_argument("--data", default=None, help="a text file, folder of .txt/.md, glob or .jsonl file")
    p.add_argument("--text-field", default="text", help="JSONL field holding the text (default: text)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per window (default: the run's training block size, else max_seq_len)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass (default 8)")
    p.add_argument("--max-batches", type=int, default=None, help="stop after this many batches")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or mps")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="autocast dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16 or float16")
    p.add_argument("--cache-dir", default=None, help="token cache folder (default ~/.cache/tinyformer)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_no_verify_flag(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--per-token", action="store_true",
                   help="with --json: also every predicted token's id, text, bytes and loss (token_losses)")
    g = p.add_argument_group("tasks", "accuracy on questions instead of loss on text")
    g.add_argument("--task", metavar="FILE", default=None,
                   help="JSONL task file (multiple-choice {question, choices, answer} and/or exact-answer "
                        "{prompt, answer} rows), 'builtin' for questions built from the Python standard library, or "
                        "'instructions' for the held-out questions of the built-in instruction set (exact match)")
    g.add_argument("--harness", metavar="TASKS", default=None,
                   help="comma-separated lm-evaluation-harness tasks (needs the 'eval' extra: pip install "
                        "'tinyformer[eval]')")
    g.add_argument("--include-path", metavar="DIR", default=None, help="folder of your own lm-eval task YAMLs")
    g.add_argument("--num-fewshot", type=int, default=None, help="lm-eval few-shot examples (default: the task's)")
    g.add_argument("--limit", type=int, default=None, help="evaluate only the first N questions of each task")
    g.add_argument("--builtin-questions", type=int, default=100,
                   help="questions in --task builtin (default 100)")
    g.add_argument("--max-new-tokens", type=int, default=32,
                   help="longest generated answer of an exact-answer row (default 32)")
    g.add_argument("--reward", action="append", default=None, metavar="SPEC",
                   help="mean reward of the run's completions to the --data prompts (default: the built-in set's "
                        "held-out prompts): builtin:exact|contains|json-schema|python-import or path/file.py:function "
                        "(repeatable, =WEIGHT)")
    g.add_argument("--num-samples", type=int, default=1,
                   help="with --reward: K completions per prompt at temperature 1 (default 1: greedy); adds the "
                        "mean of the best of K")
    g.add_argument("--no-report", action="store_true", help="leave RUN/report.md as it is")
    p.set_defaults(func=run)


def _task(args: argparse.Namespace) -> tuple[dict[str, Any], list[tuple[str, str, float, int | None]]]:
    from tinyformer.devices import resolve_device
    from tinyformer.evaluation import tasks
    from tinyformer.report_card import task_rows
    from tinyformer.run_folder import load_model, load_tokenizer

    if args.task == tasks.BUILTIN:
        items = tasks.builtin_task(args.builtin_questions)
    elif args.task == tasks.INSTRUCTIONS:
        items = tasks.instruction_task()
    else:
        items = tasks.read_task_file(args.task)
    if args.limit is not None:
        items = items[: args.limit]
    dev = resolve_device(args.device)
    model, tokenizer = load_model(args.model, device=dev), load_tokenizer(args.model)
    scores = tasks.evaluate_items(model, tokenizer, items, batch_size=args.batch_size,
                                  max_new_tokens=args.max_new_tokens, progress=not args.no_progress)
    return {"model": str(args.model), "task": args.task, **scores}, task_rows(f"task {args.task}", scores)


def _harness(args: argparse.Namespace) -> tuple[dict[str, Any], list[tuple[str, str, float, int | None]]]:
    try:
        from tinyformer.evaluation.harness import run_harness
    except ImportError as exc:
        raise ConfigError(f"--harness needs lm-evaluation-harness ({exc}); pip install 'tinyformer[eval]'") from None
    tasks = [t.strip() for t in args.harness.split(",") if t.strip()]
    if not tasks:
        raise ConfigError("--harness needs at least one task name")
    dtype = None if args.dtype == "auto" else args.dtype
    results = run_harness(Path(args.model), tasks, include_path=args.include_path, batch_size=args.batch_size,
                          limit=args.limit, num_fewshot=args.num_fewshot, device=args.device, dtype=dtype)
    rows = [(f"lm-eval {task}", metric.replace(",none", ""), float(value), None)
            for task, metrics in results.items() for metric, value in metrics.items()
            if isinstance(value, (int, float)) and "stderr" not in metric]
    return {"model": str(args.model), "harness": tasks, "results": results}, rows


def _reward(args: argparse.Namespace) -> tuple[dict[str, Any], list[tuple[str, str, float, int | None]]]:
    """``--reward SPEC [--data PROMPTS.jsonl] [--num-samples K]``: the mean reward (evaluation/reward_scoring.py)."""
    from tinyformer.evaluation.reward_scoring import evaluate_rewards

    if args.task or args.harness:
        raise ConfigError("give --reward or --task / --harness, not both")
    result = evaluate_rewards(args.model, args.data, args.reward, num_samples=args.num_samples,
                              max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, device=args.device,
                              limit=args.limit)
    name = f"reward {result['reward']}"
    rows = [(name, "mean_reward", result["mean_reward"], result["prompts"])]
    if "best_of_k_mean_reward" in result:
        rows.append((name, f"best_of_{args.num_samples}_mean_reward", result["best_of_k_mean_reward"],
                     result["prompts"]))
    rows += [(name, f"mean_reward {kind}", value, None) for kind, value in result.get("by_kind", {}).items()]
    if not args.json:
        for _, metric, value, _ in rows:
            print(f"{result['model']} on {result['data']}: {metric} {value:.4f}", flush=True)
        if result["reward_failures"]:
            print(result["reward_failures"])
    return result, rows


def _text(args: argparse.Namespace) -> tuple[dict[str, Any], list[tuple[str, str, float, int | None]]]:
    """``--data TEXT``: loss, perplexity and bits per byte (evaluation/text_loss.py)."""
    from tinyformer.evaluation.text_loss import evaluate_text

    if args.per_token and not args.json:
        raise ConfigError("--per-token goes with --json")
    for name, default in _QUESTION_FLAGS.items():
        if getattr(args, name) != default:
            raise ConfigError(f"--{name.replace('_', '-')} goes with --task or --harness, not --data")
    for flag, value in (("--max-batches", args.max_batches), ("--block-size", args.block_size)):
        if value is not None and value < 1:  # a --block-size of 0 must not mean "the default"
            raise ConfigError(f"{flag} must be positive, got {value}")
    result = evaluate_text(Path(args.model), args.data, text_field=args.text_field, block_size=args.block_size,
                           batch_size=args.batch_size, max_batches=args.max_batches, device=args.device,
                           dtype=args.dtype, cache_dir=args.cache_dir, progress=not args.no_progress,
                           per_token=args.per_token, verify=not args.no_verify)
    if not args.json:
        bpb = f", {result['bits_per_byte']:.4f} bits/byte" if result["bits_per_byte"] is not None else ""
        print(f"{result['model']} on {result['data']}: loss {result['loss']:.4f}, perplexity "
              f"{result['perplexity']:.2f}{bpb} ({result['tokens']:,} tokens, block size {result['block_size']})",
              flush=True)
    name, n = f"text {args.data}", result["tokens"]
    rows = [(name, "loss", result["loss"], n), (name, "perplexity", result["perplexity"], n)]
    if result["bits_per_byte"] is not None:
        rows.append((name, "bits_per_byte", result["bits_per_byte"], n))
    return result, rows


def run(args: argparse.Namespace) -> int:
    from tinyformer.report_card import merge_eval_table
    from tinyformer.utils.io import report_or_warning

    if args.batch_size < 1:  # every mode batches
        raise ConfigError(f"--batch-size must be positive, got {args.batch_size}")
    if args.reward:
        result, rows = _reward(args)
    elif args.num_samples != 1:
        raise ConfigError("--num-samples goes with --reward")
    elif args.task or args.harness:  # accuracy on questions
        if args.data:
            raise ConfigError("give --data (text) or --task / --harness (questions), not both")
        for name in ("limit", "num_fewshot", "builtin_questions", "max_new_tokens"):
            value = getattr(args, name)
            floor = 0 if name == "num_fewshot" else 1
            if value is not None and value < floor:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= {floor}, got {value}")
        if args.task and args.harness:
            raise ConfigError("give --task or --harness, not both")
        if args.include_path and not args.harness:
            raise ConfigError("--include-path goes with --harness")
        if args.per_token:
            raise ConfigError("--per-token goes with --data")
        result, rows = _task(args) if args.task else _harness(args)
        if not args.json:
            for name, metric, value, n in rows:
                count = f" ({n} questions)" if n is not None else ""
                print(f"{name}: {metric} {value:.4f}{count}", flush=True)
    elif not args.data:
        raise ConfigError("eval needs --data TEXT, --task FILE.jsonl|builtin or --harness TASKS")
    else:
        from tinyformer.evaluation.preference import evaluate_chat_data

        chat = evaluate_chat_data(Path(args.model), args.data, batch_size=args.batch_size, device=args.device)
        if chat is not None:  # a chat or preference .jsonl file
            kind, result = chat
            print(json.dumps(result) if args.json else _chat_line(kind, result))
            return 0
        result, rows = _text(args)
    # the figures are printed before the report card is written: a card that cannot be written must not lose them
    report = None if args.no_report else report_or_warning(lambda: merge_eval_table(args.model, rows))
    if args.json:
        # default=str: lm-eval's results may hold numpy integers, which json cannot write
        print(json.dumps({**result, "report": report}, default=str))
    elif report is not None:
        print(f"updated {report}")
    return 0


def _chat_line(kind: str, result: dict) -> str:
    if kind == "preference":
        return (f"{result['model']} on {result['data']}: preference accuracy {result['preference_accuracy']:.4f}, "
                f"mean log-prob margin {result['mean_logp_margin']:.4f} ({result['pairs']} pairs, "
                f"{result['skipped']} skipped)")
    return (f"{result['model']} on {result['data']}: assistant-token loss {result['assistant_loss']:.4f}, perplexity "
            f"{result['perplexity']:.2f} ({result['assistant_tokens']:,} tokens in {result['conversations']} "
            f"conversations, {result['skipped']} skipped)")
