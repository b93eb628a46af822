"""The task modes of `tinyformer eval`: ``--task FILE.jsonl|builtin`` and ``--harness TASKS``.

``--task`` scores an offline task file (:mod:`tinyformer.evaluation.tasks`) with the run's model;
``--harness`` runs lm-evaluation-harness tasks through the tinyformer lm-eval model
(:mod:`tinyformer.evaluation.harness`, needs the ``eval`` extra). Both print one line per figure, or
one JSON object with ``--json``, and add their figures to the run's report card when it has one
(:mod:`tinyformer.report_card`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tinyformer.errors import ConfigError

__all__ = ["add_arguments", "check_text_mode", "report_and_print", "run_modes", "run_reward_mode"]

# flags of the question modes, with their defaults: given with --data they would silently do nothing
_QUESTION_FLAGS = {"include_path": None, "num_fewshot": None, "limit": None, "builtin_questions": 100,
                   "max_new_tokens": 32}


def add_arguments(p: argparse.ArgumentParser) -> None:
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


def check_text_mode(args: argparse.Namespace) -> None:
    """--data mode: refuse flags that only the question modes read."""
    for name, default in _QUESTION_FLAGS.items():
        if getattr(args, name) != default:
            raise ConfigError(f"--{name.replace('_', '-')} goes with --task or --harness, not --data")


def _check(args: argparse.Namespace) -> None:
    for name in ("limit", "num_fewshot", "builtin_questions", "max_new_tokens"):
        value = getattr(args, name)
        floor = 0 if name == "num_fewshot" else 1
        if value is not None and value < floor:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {floor}, got {value}")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be positive, got {args.batch_size}")
    if args.task and args.harness:
        raise ConfigError("give --task or --harness, not both")
    if args.include_path and not args.harness:
        raise ConfigError("--include-path goes with --harness")
    if args.per_token:
        raise ConfigError("--per-token goes with --data")


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


def report_and_print(args: argparse.Namespace, result: dict[str, Any],
                     rows: list[tuple[str, str, float, int | None]]) -> int:
    """The end of every eval mode, once it has printed its figures (a report card that cannot be written must
    not lose them): ``rows`` into the run's report card (unless ``--no-report``), then ``result`` as one JSON
    object with ``--json``, else the card's path."""
    from tinyformer.report_card import merge_eval_table
    from tinyformer.utils.io import report_or_warning

    report = None if args.no_report else report_or_warning(lambda: merge_eval_table(args.model, rows))
    if args.json:
        # default=str: lm-eval's results may hold numpy integers, which json cannot write
        print(json.dumps({**result, "report": report}, default=str))
    elif report is not None:
        print(f"updated {report}")
    return 0


def run_modes(args: argparse.Namespace) -> int:
    """`tinyformer eval --task/--harness`: evaluate, print, update the report card."""
    _check(args)
    result, rows = _task(args) if args.task else _harness(args)
    if not args.json:
        for name, metric, value, n in rows:
            count = f" ({n} questions)" if n is not None else ""
            print(f"{name}: {metric} {value:.4f}{count}", flush=True)
    return report_and_print(args, result, rows)


def run_reward_mode(args: argparse.Namespace) -> int:
    """`tinyformer eval --reward SPEC [--data PROMPTS.jsonl] [--num-samples K]`: mean reward, printed (one JSON
    object with --json) and added to the report card (evaluation/reward_scoring.py)."""
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
    return report_and_print(args, result, rows)
