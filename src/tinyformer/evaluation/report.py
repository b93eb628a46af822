"""The evaluation table of a run's report card (``RUN/report.md``).

`tinyformer eval` adds its figures to the report card when the run has one: one Markdown table
between two HTML comments, one row per (evaluation, metric), the latest value of each kept and the
others left as they were. The rest of the file is not touched; the file is replaced atomically.

    <!-- tinyformer eval -->
    ## Evaluation
    | evaluation | metric | value | n |
    |---|---|---|---|
    | task builtin | acc | 0.3100 | 100 |
    <!-- /tinyformer eval -->
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tinyformer.utils.io import atomic_write_text

__all__ = ["REPORT", "add_builtin_accuracy", "merge_eval_table", "task_rows"]

REPORT = "report.md"
BEGIN, END = "<!-- tinyformer eval -->", "<!-- /tinyformer eval -->"
_HEADER = ["## Evaluation", "", "| evaluation | metric | value | n |", "|---|---|---|---|"]

Row = tuple[str, str, float, int | None]


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
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
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
    new = [*before, BEGIN, *_HEADER, *table.values(), END, *after]
    atomic_write_text(path, "\n".join(new) + "\n")
    return path


def task_rows(name: str, scores: dict[str, dict[str, Any]]) -> list[Row]:
    """Table rows of :func:`~tinyformer.evaluation.tasks.evaluate_items`' result (standard errors left out)."""
    return [(name, metric, value, part["n"]) for part in scores.values() for metric, value in part.items()
            if metric != "n" and not metric.endswith("_stderr")]


def add_builtin_accuracy(run: str | Path, model: Any, tokenizer: Any, questions: int = 100, batch_size: int = 8,
                         stdlib_dir: str | Path | None = None) -> Path | None:
    """Score the built-in task and put its accuracy into ``run``'s report card (if it has one): what a
    training recipe calls at its end so that its report card shows an accuracy beside the loss."""
    from tinyformer.evaluation.tasks import BUILTIN, builtin_task, evaluate_items

    if not (Path(run) / REPORT).is_file():
        return None
    scores = evaluate_items(model, tokenizer, builtin_task(questions, stdlib_dir=stdlib_dir), batch_size=batch_size)
    return merge_eval_table(run, task_rows(f"task {BUILTIN}", scores))
