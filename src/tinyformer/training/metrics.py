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
from pathlib import Path
from typing import Any

from tinyformer.utils.io import atomic_write_text

METRICS_FILE = "metrics.jsonl"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics file; a torn last line (from a crash) is skipped."""
    p = Path(path)
    if not p.is_file():
        return []
    records = []
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _json_value(v: Any) -> Any:
    # JSON has no NaN/inf; null keeps every line parseable by strict readers
    return None if isinstance(v, float) and not math.isfinite(v) else v


class MetricsLogger:
    """Appends records to ``run_dir/metrics.jsonl``; a no-op when ``enabled`` is False (ranks > 0)."""

    def __init__(self, run_dir: Path, enabled: bool = True, tensorboard: bool = True) -> None:
        self.path = run_dir / METRICS_FILE
        self.enabled = enabled
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # needs the optional tensorboard package

                self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
            except ImportError:
                self.tb = None

    def truncate_after(self, step: int) -> None:
        """Keep only records with ``step <= step`` (a resumed run rewrites what came after its checkpoint)."""
        if not self.enabled or not self.path.is_file():
            return
        kept = [r for r in read_metrics(self.path) if int(r.get("step", 0)) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: _json_value(v) for k, v in record.items()}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(clean) + "\n")
        if self.tb is not None:
            kind, step = record.get("kind", "train"), int(record.get("step", 0))
            for key, value in record.items():
                if key not in ("kind", "step") and isinstance(value, (int, float)) and value is not None:
                    self.tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
