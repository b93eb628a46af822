"""report.md: a run's report card, readable without running anything.

Written by the trainer at the end of every ``fit()`` (and rewritten by a resumed run), from
metrics.jsonl and the objective: the run's objective, steps and tokens; the last train loss and
the validation figures of the last evaluation (for language modelling the validation loss and
perplexity = exp(loss); for SFT the held-out assistant-token loss); then what the objective adds
(:meth:`~tinyformer.training.objectives.Objective.report`): SFT answers 5 held-out questions, DPO
gives the held-out preference accuracy before and after training.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from tinyformer.training.metrics import read_metrics
from tinyformer.utils.io import atomic_write_text

if TYPE_CHECKING:
    from tinyformer.training.objectives import Objective

REPORT_FILE = "report.md"


def report_text(run_dir: Path, objective: Objective, model: nn.Module, device: torch.device) -> str:
    """The markdown of the report card (see the module docstring)."""
    records = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    cfg = objective.cfg
    lines = [f"# Report card: {run_dir.name}", "",
             f"- objective: `{cfg.objective}`" + (f", from `{cfg.init_from}`" if cfg.init_from else ""),
             f"- data: {cfg.data or 'built-in'}"]
    if train:
        last = train[-1]
        lines.append(f"- steps: {last['step']}, tokens: {last.get('tokens', 0):,}, "
                     f"training time: {last.get('time', 0.0):.1f} s")
        lines.append(f"- last train loss: {last['loss']:.4f}")
    label = objective.loss_label
    key = objective.val_loss_key
    if evals and evals[-1].get(key) is not None:
        val = evals[-1][key]
        ppl = f" (perplexity {math.exp(min(val, 700.0)):.2f})" if objective.loss_is_nll else ""
        lines.append(f"- {label} (step {evals[-1]['step']}): {val:.4f}{ppl}")
    elif evals:
        lines.append(f"- {label}: none (no validation split)")
    extra = objective.report(model, device)
    if extra:
        lines += ["", *extra]
    return "\n".join(lines) + "\n"


def write_report(run_dir: Path, objective: Objective, model: nn.Module, device: torch.device) -> Path:
    path = Path(run_dir) / REPORT_FILE
    atomic_write_text(path, report_text(Path(run_dir), objective, model, device))
    return path
