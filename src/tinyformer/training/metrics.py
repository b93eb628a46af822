"""Training metrics: one JSON object per line in ``metrics.jsonl`` (and TensorBoard when installed).

Lines are appended and flushed as training goes, so a crash loses at most the line being
written; on resume the file is cut back (atomically) to the records up to the checkpoint's step,
which the resumed run then continues. Record kinds:

    {"kind": "train", "step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "flops_per_s", "mfu", "time"}
        (MoE models add "moe_balance" and "moe_z", the unweighted auxiliary losses)
    {"kind": "eval",  "step", "val_loss", "val_ppl", "train_loss"}
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from tinyformer.errors import CheckpointError
from tinyformer.utils.io import atomic_write_text, read_utf8

METRICS_FILE = "metrics.jsonl"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics file; a torn last line (from a crash) is skipped."""
    p = Path(path)
    if not p.is_file():
        return []
    records = []
    for line in read_utf8(p, CheckpointError, "metrics file").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


@dataclass
class RunningWindow:
    """The sums behind the logged averages since the last log (``loss``/``steps``: the train record's mean
    loss; ``tokens``/``seconds``: its tokens per second) and since the last evaluation (``eval_loss`` /
    ``eval_steps``: the eval record's train_loss). They are saved with every checkpoint, so that a run
    resumed between two logs logs the same averages as one that was never interrupted."""

    loss: float = 0.0
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    eval_loss: float = 0.0
    eval_steps: int = 0

    def add(self, loss: float, tokens: int, seconds: float) -> None:
        self.loss, self.steps = self.loss + loss, self.steps + 1
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
        self.eval_loss, self.eval_steps = self.eval_loss + loss, self.eval_steps + 1

    def reset_log(self) -> None:
        self.loss, self.steps, self.tokens, self.seconds = 0.0, 0, 0, 0.0

    def reset_eval(self) -> None:
        self.eval_loss, self.eval_steps = 0.0, 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # JSON keeps a float's shortest repr, which reads back to the same double

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RunningWindow:
        """The saved window; an empty one for checkpoints written before windows were saved."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in names})


class MetricsLogger:
    """Appends records to ``run_dir/metrics.jsonl``; a no-op when ``enabled`` is False (ranks > 0)."""

    def __init__(self, run_dir: Path, enabled: bool = True, tensorboard: bool = True) -> None:
        self.path = run_dir / METRICS_FILE
        self.enabled = enabled
        self.tb = None
        self._tb_dir = run_dir / "tensorboard" if enabled and tensorboard else None

    def _tensorboard(self) -> Any:
        """The TensorBoard writer, opened at the first record (a resume that fails before it writes nothing)."""
        if self._tb_dir is not None and self.tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter  # needs the optional tensorboard package

                self.tb = SummaryWriter(log_dir=str(self._tb_dir))
            except ImportError:
                self._tb_dir = None
        return self.tb

    def truncate_after(self, step: int) -> None:
        """Keep only records with ``step <= step`` (a resumed run rewrites what came after its checkpoint)."""
        if not self.enabled or not self.path.is_file():
            return
        kept = [r for r in read_metrics(self.path) if int(r.get("step", 0)) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        # JSON has no NaN/inf; null keeps every line parseable by strict readers
        clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(clean) + "\n")
        tb = self._tensorboard()
        if tb is not None:
            kind, step = record.get("kind", "train"), int(record.get("step", 0))
            for key, value in record.items():
                if key not in ("kind", "step") and isinstance(value, (int, float)) and value is not None:
                    tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
