"""`tinyformer eval`: loss and perplexity of a trained model on any text.

The text is encoded with the run's tokenizer (cached like training data) and cut into
non-overlapping windows of ``block_size`` tokens; every token after the first of its window is
predicted from the tokens before it in that window:

    loss = -1/N sum_i log p(x_i | window prefix),   perplexity = exp(loss),
    bits per byte = N * loss / (ln 2 * bytes of the predicted tokens)

Bits per byte does not depend on the tokenizer, so it compares models with different vocabularies.
A .jsonl file of conversations or preference pairs is scored as chat data instead
(:func:`tinyformer.training.preference.evaluate_chat_data`: assistant-token loss, or preference
accuracy and mean log-prob margin).

``--task FILE.jsonl|builtin`` (accuracy on multiple-choice and exact-answer questions) and
``--harness TASKS`` (lm-evaluation-harness) are the question modes, in :mod:`tinyformer.evaluation`.
Every mode adds its figures to the run's report card (``report.md``) when there is one.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

from tinyformer.cli.common import add_no_verify_flag
from tinyformer.errors import ConfigError
from tinyformer.training.config import DTYPES
from tinyformer.utils.io import report_or_warning


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


def _training_block_size(run: Path) -> int | None:
    from tinyformer.training.config import read_run_file

    if not (run / "train.yaml").is_file():
        return None
    try:
        value = read_run_file(run / "train.yaml")["train"].get("block_size")
    except ConfigError:
        return None
    return value if isinstance(value, int) and value > 0 else None


def evaluate_run(run: Path, data: str, *, text_field: str = "text", block_size: int | None = None,
                 batch_size: int = 8, max_batches: int | None = None, device: str = "auto", dtype: str = "auto",
                 cache_dir: str | None = None, progress: bool = True, per_token: bool = False,
                 verify: bool = True) -> dict:
    """Loss, perplexity and bits per byte of the model in ``run`` on the corpus ``data``; with
    ``per_token``, ``token_losses`` lists {id, text, bytes, loss} of every predicted token in text order."""
    from tqdm.auto import tqdm

    from tinyformer.data.dataset import TokenDataset, encode_to_memmap
    from tinyformer.devices import autocast_dtype, resolve_device
    from tinyformer.run_folder import load_config, load_model, load_tokenizer
    from tinyformer.training.prepare import default_cache_dir

    if batch_size < 1:
        raise ConfigError(f"--batch-size must be positive, got {batch_size}")
    if max_batches is not None and max_batches < 1:
        raise ConfigError(f"--max-batches must be positive, got {max_batches}")
    if block_size is not None and block_size < 1:  # 0 must not mean "the default"
        raise ConfigError(f"--block-size must be positive, got {block_size}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    cfg = load_config(run)
    T = block_size or _training_block_size(run) or cfg.max_seq_len
    if T < 1 or T > cfg.max_seq_len:
        raise ConfigError(f"--block-size {T} must be in [1, max_seq_len={cfg.max_seq_len}]")
    dev = resolve_device(device)
    amp = autocast_dtype(dtype, dev)
    tokenizer = load_tokenizer(run)
    model = load_model(run, device=dev, verify=verify)
    path = encode_to_memmap(Path(data), tokenizer, (Path(cache_dir) if cache_dir else default_cache_dir()) / "tokens",
                            text_field=text_field)
    dataset = TokenDataset(path, val_fraction=0.0)
    n = len(dataset)
    windows = (n - 1) // T if n > T else 0
    if windows == 0:
        raise ConfigError(f"{data} has {n} tokens, too few for one window of --block-size {T} (needs {T + 1})")
    # bytes each id stands for, to turn nats/token into bits/byte
    token_bytes = np.array([len(tokenizer.token_bytes(i)) if tokenizer.id_to_token(i) is not None else 0
                            for i in range(tokenizer.vocab_size)], dtype=np.int64)
    n_batches = math.ceil(windows / batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    nll, count, n_bytes = 0.0, 0, 0
    token_losses: list[dict] = []
    ctx = torch.autocast(device_type=dev.type, dtype=amp) if amp is not None else torch.autocast(dev.type,
                                                                                                  enabled=False)
    with torch.no_grad(), ctx:
        batches = dataset.iter_eval_batches("train", batch_size, T, max_batches=max_batches)
        for x, y in tqdm(batches, total=n_batches, desc="eval", unit="batch", disable=not progress):
            logits = model(x.to(dev))
            losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.to(dev).flatten(),
                                                       reduction="none")
            nll += float(losses.sum())
            if not math.isfinite(nll):  # a NaN loss would be reported as a result, exit 0
                from tinyformer.errors import NonFiniteOutputError, non_finite_message

                raise NonFiniteOutputError(non_finite_message(f"on {data}"))
            if per_token:
                # a token may hold part of a character: its text is then lossy, its byte count exact
                token_losses.extend({"id": t, "text": tokenizer.token_bytes(t).decode("utf-8", errors="replace"),
                                     "bytes": int(token_bytes[t]), "loss": v}
                                    for t, v in zip(y.flatten().tolist(), losses.tolist()))
            count += y.numel()
            n_bytes += int(token_bytes[y.numpy()].sum())
    mean = nll / count
    extra = {"token_losses": token_losses} if per_token else {}
    return {
        "model": str(run),
        "data": str(data),
        "tokens": count,
        "block_size": T,
        "loss": mean,
        "perplexity": math.exp(min(mean, 700.0)),
        "bits_per_byte": nll / math.log(2) / n_bytes if n_bytes else None,
        "bytes": n_bytes,
        **extra,
    }


def run(args: argparse.Namespace) -> int:
    if args.task or args.harness:  # accuracy on questions: tinyformer.evaluation
        if args.data:
            raise ConfigError("give --data (text) or --task / --harness (questions), not both")
        from tinyformer.evaluation.command import run_modes

        return run_modes(args)
    if not args.data:
        raise ConfigError("eval needs --data TEXT, --task FILE.jsonl|builtin or --harness TASKS")
    from tinyformer.training.preference import evaluate_chat_data

    chat = evaluate_chat_data(Path(args.model), args.data, batch_size=args.batch_size, device=args.device,
                              as_json=args.json)
    if chat is not None:  # a chat or preference .jsonl file: printed already
        return 0
    if args.per_token and not args.json:
        raise ConfigError("--per-token goes with --json")
    from tinyformer.evaluation.command import check_text_mode

    check_text_mode(args)
    result = evaluate_run(Path(args.model), args.data, text_field=args.text_field, block_size=args.block_size,
                          batch_size=args.batch_size, max_batches=args.max_batches, device=args.device,
                          dtype=args.dtype, cache_dir=args.cache_dir, progress=not args.no_progress,
                          per_token=args.per_token, verify=not args.no_verify)
    if not args.json:  # the figures first: a report card that cannot be written must not lose them
        bpb = f", {result['bits_per_byte']:.4f} bits/byte" if result["bits_per_byte"] is not None else ""
        print(f"{result['model']} on {result['data']}: loss {result['loss']:.4f}, perplexity "
              f"{result['perplexity']:.2f}{bpb} ({result['tokens']:,} tokens, block size {result['block_size']})",
              flush=True)
    report = report_or_warning(lambda: _report_text(args, result))
    if args.json:
        print(json.dumps({**result, "report": report}))
    elif report is not None:
        print(f"updated {report}")
    return 0


def _report_text(args: argparse.Namespace, result: dict) -> str | None:
    """Add loss, perplexity and bits per byte on ``--data`` to the run's report card, if it has one."""
    from tinyformer.evaluation.report import merge_eval_table

    if args.no_report:
        return None
    name, n = f"text {args.data}", result["tokens"]
    rows = [(name, "loss", result["loss"], n), (name, "perplexity", result["perplexity"], n)]
    if result["bits_per_byte"] is not None:
        rows.append((name, "bits_per_byte", result["bits_per_byte"], n))
    path = merge_eval_table(args.model, rows)
    return None if path is None else str(path)
