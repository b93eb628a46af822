"""`tinyformer eval`: flags in, figures out; the evaluation itself is in :mod:`tinyformer.evaluation`.

    --data TEXT                  loss, perplexity, bits per byte       evaluation/text_loss.py
    --data CHAT_OR_PREFS.jsonl   assistant-token loss, or preference accuracy and mean log-prob margin
                                                                       evaluation/preference.py
    --task FILE.jsonl|builtin    accuracy on questions                 evaluation/tasks.py
    --harness TASKS              lm-evaluation-harness                 evaluation/harness.py
    --reward SPEC [--data P.jsonl]  mean reward of completions         evaluation/reward_scoring.py

Every mode adds its figures to the run's report card (``report.md``) when there is one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tinyformer.cli.common import add_no_verify_flag
from tinyformer.errors import ConfigError
from tinyformer.training.train_config import DTYPES


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
    from tinyformer.evaluation.command import add_arguments

    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.reward:  # the mean reward of completions to prompts: tinyformer.evaluation.reward_scoring
        from tinyformer.evaluation.command import run_reward_mode

        return run_reward_mode(args)
    if args.num_samples != 1:
        raise ConfigError("--num-samples goes with --reward")
    if args.task or args.harness:  # accuracy on questions: tinyformer.evaluation
        if args.data:
            raise ConfigError("give --data (text) or --task / --harness (questions), not both")
        from tinyformer.evaluation.command import run_modes

        return run_modes(args)
    if not args.data:
        raise ConfigError("eval needs --data TEXT, --task FILE.jsonl|builtin or --harness TASKS")
    from tinyformer.evaluation.preference import evaluate_chat_data

    chat = evaluate_chat_data(Path(args.model), args.data, batch_size=args.batch_size, device=args.device)
    if chat is not None:  # a chat or preference .jsonl file
        kind, result = chat
        print(json.dumps(result) if args.json else _chat_line(kind, result))
        return 0
    if args.per_token and not args.json:
        raise ConfigError("--per-token goes with --json")
    from tinyformer.evaluation.command import check_text_mode, report_and_print

    check_text_mode(args)
    from tinyformer.evaluation.text_loss import TextEvalOptions, evaluate_text

    options = TextEvalOptions(text_field=args.text_field, block_size=args.block_size, batch_size=args.batch_size,
                              max_batches=args.max_batches, device=args.device, dtype=args.dtype,
                              cache_dir=args.cache_dir, progress=not args.no_progress, per_token=args.per_token,
                              verify=not args.no_verify)
    result = evaluate_text(Path(args.model), args.data, options)
    if not args.json:
        bpb = f", {result['bits_per_byte']:.4f} bits/byte" if result["bits_per_byte"] is not None else ""
        print(f"{result['model']} on {result['data']}: loss {result['loss']:.4f}, perplexity "
              f"{result['perplexity']:.2f}{bpb} ({result['tokens']:,} tokens, block size {result['block_size']})",
              flush=True)
    name, n = f"text {args.data}", result["tokens"]
    rows = [(name, "loss", result["loss"], n), (name, "perplexity", result["perplexity"], n)]
    if result["bits_per_byte"] is not None:
        rows.append((name, "bits_per_byte", result["bits_per_byte"], n))
    return report_and_print(args, result, rows)


def _chat_line(kind: str, result: dict) -> str:
    if kind == "preference":
        return (f"{result['model']} on {result['data']}: preference accuracy {result['preference_accuracy']:.4f}, "
                f"mean log-prob margin {result['mean_logp_margin']:.4f} ({result['pairs']} pairs, "
                f"{result['skipped']} skipped)")
    return (f"{result['model']} on {result['data']}: assistant-token loss {result['assistant_loss']:.4f}, perplexity "
            f"{result['perplexity']:.2f} ({result['assistant_tokens']:,} tokens in {result['conversations']} "
            f"conversations, {result['skipped']} skipped)")
