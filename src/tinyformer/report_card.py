"""report.md: a run folder's report card, readable without running anything. The one writer of every part.

    training card   written by the trainer at the end of every ``fit()`` (and rewritten by a resumed run),
                    from metrics.jsonl and the objective: objective, steps, tokens trained on, the figures
                    below, then what the objective adds (SFT answers 5 held-out questions, DPO gives the
                    held-out preference accuracy before and after training)
    derived card    written by ``quantize`` and ``convert`` (``--merge-lora``, ``--from-hf``, ``--from-gguf``):
                    what the run is, made from what, with which settings (quantize: the per-layer errors),
                    and where the parent run's own card is; a derived run never carries its parent's card
    eval table      ``tinyformer eval`` (and the trainer, for the built-in task) merges its figures into one
                    Markdown table between two HTML comments; the latest value of each (evaluation, metric)
                    is kept, the rest of the file is left as it was; a legend under the table says what a
                    built-in evaluation is and its chance level

Every figure is defined once, here, and the console prints it with the same label from the same
metrics.jsonl record (:func:`train_loss_line`, :func:`heldout_line`):

    train loss (mean of steps A-B)   the mean of the per-step training losses of steps A..B, the steps since
                                     the previous evaluation (the eval record's ``train_loss``)
    LABEL (step N, K held-out batches)   the objective's held-out figure at the evaluation of step N, over the
                                     same K fixed batches at every evaluation (the eval record's
                                     ``objective.val_loss_key``); a loss that is a negative log-likelihood
                                     adds its perplexity exp(loss)

    <!-- tinyformer eval -->
    ## Evaluation
    | evaluation | metric | value | n |
    |---|---|---|---|
    | task builtin | acc | 0.3100 | 100 |

    task builtin: ... chance level 0.25 (one of four choices)
    <!-- /tinyformer eval -->

Every write replaces the file atomically.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinyformer.utils.io import atomic_write_text

if TYPE_CHECKING:
    from tinyformer.training.objectives import Objective

__all__ = ["BEGIN", "END", "REPORT", "heldout_line", "merge_eval_table", "task_rows", "train_loss_line",
           "write_derived_card", "write_training_card"]

REPORT = "report.md"
BEGIN, END = "<!-- tinyformer eval -->", "<!-- /tinyformer eval -->"
_HEADER = ["## Evaluation", "", "| evaluation | metric | value | n |", "|---|---|---|---|"]

Row = tuple[str, str, float, int | None]

#: What an evaluation named in the table is, printed under it when the table holds it.
LEGENDS = {
    "task builtin": "task builtin: multiple-choice questions \"Which module provides `Name`?\" about classes of "
                    "CPython's standard library, four module names to choose from (evaluation/tasks.py); chance "
                    "level 0.25. acc takes the choice of highest log-likelihood, acc_norm divides it by the "
                    "choice's characters, acc_bytes by its UTF-8 bytes",
}


# ------------------------------------------------------------------ the figures (console and card alike)


def train_loss_line(record: dict[str, Any]) -> str | None:
    """'train loss (mean of steps 16-30): 6.8091' from an eval record of metrics.jsonl (None without one)."""
    if record.get("train_loss") is None:
        return None
    step, n = int(record["step"]), int(record.get("train_loss_steps") or 1)
    span = f"step {step}" if n == 1 else f"mean of steps {step - n + 1}-{step}"
    return f"train loss ({span}): {record['train_loss']:.4f}"


def heldout_line(record: dict[str, Any], objective: Objective) -> str | None:
    """'validation loss (step 30, 8 held-out batches): 6.8726 (perplexity 965.48)' from an eval record, for
    ``objective``'s held-out figure (None when the record has none)."""
    value = record.get(objective.val_loss_key)
    if value is None:
        return None
    batches = record.get("val_batches")
    which = f", {batches} held-out batches" if batches else ""
    ppl = f" (perplexity {math.exp(min(value, 700.0)):.2f})" if objective.loss_is_nll else ""
    return f"{objective.loss_label} (step {record['step']}{which}): {value:.4f}{ppl}"


# ------------------------------------------------------------------ the training card


def write_training_card(run_dir: str | Path, records: Sequence[dict[str, Any]], objective: Objective,
                        extra: list[str]) -> Path:
    """Write a training run's card: ``records`` are metrics.jsonl's, ``extra`` the objective's own lines
    (:meth:`~tinyformer.training.objectives.Objective.report`)."""
    run_dir = Path(run_dir)
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    cfg = objective.cfg
    lines = [f"# Report card: {run_dir.name}", "",
             f"- objective: `{cfg.objective}`" + (f", from `{cfg.init_from}`" if cfg.init_from else ""),
             f"- data: {cfg.data or 'built-in'}"]
    if train:
        last = train[-1]
        lines.append(f"- steps: {last['step']}, {objective.token_kind} trained on: {last.get('tokens', 0):,}, "
                     f"training time: {last.get('time', 0.0):.1f} s")
    if evals:
        figures = [train_loss_line(evals[-1]), heldout_line(evals[-1], objective)]
        lines += [f"- {line}" for line in figures if line]
        if figures[1] is None:
            lines.append(f"- {objective.loss_label}: none (no held-out split)")
    return _write_card(run_dir, lines, extra)


def _write_card(folder: Path, lines: list[str], extra: Sequence[str]) -> Path:
    """Write ``folder``/report.md: ``lines``, then the ``extra`` lines after a blank one."""
    path = folder / REPORT
    atomic_write_text(path, "\n".join([*lines, *(["", *extra] if extra else [])]) + "\n")
    return path


# ------------------------------------------------------------------ the card of a derived run


def write_derived_card(out: str | Path, what: str, parent: str | Path, settings: Iterable[tuple[str, str]],
                       extra: Sequence[str] = ()) -> Path:
    """Write the card of a run made from another one: ``what`` it is ('int8 weight-only quantization'), from
    ``parent`` (a run folder, an HF folder or a GGUF file), ``settings`` as (name, value) pairs, and
    ``extra`` markdown lines (e.g. a table of errors)."""
    parent = Path(parent)
    card = parent / REPORT if parent.is_dir() else None
    lines = [f"# Report card: {Path(out).name}", "", f"- what: {what}", f"- from: `{parent}`"]
    lines += [f"- {name}: {value}" for name, value in settings]
    if card is not None and card.is_file():
        lines.append(f"- the parent's report card (its training and evaluation figures): `{card}`")
    else:
        lines.append("- the parent has no report card")
    return _write_card(Path(out), lines, extra)


# ------------------------------------------------------------------ the eval table


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _parse(block: list[str]) -> dict[tuple[str, str], str]:
    rows: dict[tuple[str, str], str] = {}
    for line in block:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 4 and line.startswith("| ") and cells[0] != "evaluation":
            rows[(cells[0], cells[1])] = line
    return rows


def merge_eval_table(run: str | Path, rows: Iterable[Row]) -> Path | None:
    """Put ``rows`` (evaluation, metric, value, count) into the eval table of ``run``/report.md.
    Returns the report's path, or None when the run has no report card (nothing is written)."""
    path = Path(run) / REPORT
    if not path.is_file():
        return None
    lines = path.read_text(encoding="utf-8").splitlines()
    if BEGIN in lines and END in lines[lines.index(BEGIN):]:
        start = lines.index(BEGIN)
        stop = lines.index(END, start)
        before, block, after = lines[:start], lines[start + 1 : stop], lines[stop + 1 :]
    else:
        before, block, after = lines + ([""] if lines and lines[-1].strip() else []), [], []
    table = _parse(block)
    for name, metric, value, n in rows:
        key = (_cell(name), _cell(metric))
        table[key] = f"| {key[0]} | {key[1]} | {value:.4f} | {'' if n is None else n} |"
    legends = [LEGENDS[name] for name in dict.fromkeys(name for name, _ in table) if name in LEGENDS]
    new = [*before, BEGIN, *_HEADER, *table.values(), *([""] + legends if legends else []), END, *after]
    atomic_write_text(path, "\n".join(new) + "\n")
    return path


def task_rows(name: str, scores: dict[str, dict[str, Any]]) -> list[Row]:
    """Table rows of :func:`~tinyformer.evaluation.tasks.evaluate_items`' result (standard errors left out)."""
    return [(name, metric, value, part["n"]) for part in scores.values() for metric, value in part.items()
            if metric != "n" and not metric.endswith("_stderr")]

