"""The prepared GPU check (benchmarks/gpu_check.sh) runs end to end on CPU in its --tiny mode, also where the
optional packages are missing, and reports MFU from sizing's FLOP formula; the peak-FLOP/s table matches
device names as whole tokens."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tinyformer.sizing import training_flops_per_token
from tinyformer.training.device import peak_flops_for

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300

# Hides packages the GPU image may lack, as if they were not installed (find_spec returns None).
HIDE_PACKAGES = '''
import sys

HIDDEN = {"numpy", "safetensors", "tokenizers", "yaml", "tqdm"}


class _Hide:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [_Hide(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
'''


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_without_optional_packages_passes_and_reports_mfu_from_the_formula(tmp_path: Path) -> None:
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_PACKAGES, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PYTHONPATH"] = str(hide)  # the script itself adds src/: nothing is installed
    env["PYTHON"] = sys.executable
    out = tmp_path / "result.json"
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--device", "cpu", "--tiny", "--peak-flops", "1e11",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "distributed smoke skipped: numpy, safetensors, tqdm not installed" in proc.stdout
    lines = proc.stdout.strip().splitlines()
    results = json.loads(out.read_text())
    assert lines[-1] == f"checks: {len(results['checks'])} of {len(results['checks'])} passed"
    assert len(results["checks"]) == 6 and all(r["ok"] for r in results["checks"])

    shapes = load_gpu_check().shapes(tiny=True)
    assert [r["shape"] for r in results["train"]] == list(shapes)
    for r in results["train"]:
        cfg = shapes[r["shape"]]["cfg"]
        assert r["flops_per_token"] == training_flops_per_token(cfg, r["seq"])
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * r["flops_per_token"] / 1e11, rel=1e-9)
        row = next(line for line in lines if line.startswith(r["shape"]))  # the table, printed last
        assert row.split()[-1] == f"{100 * r['mfu']:.1f}%"
    assert [r["batch"] for r in results["decode"]] == [1, 16] and all(r["tokens_per_s"] > 0 for r in results["decode"])


def test_distributed_smoke_resumes_bit_exactly_on_cpu(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--tiny",
                           "--skip", "parity,train,decode", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = json.loads(out.read_text())["checks"]
    assert [c["what"].split(",")[0] for c in checks] == ["fsdp", "ddp"]
    assert all(c["ok"] and c["value"] == 0.0 for c in checks)


@pytest.mark.parametrize(("name", "flops"), [
    ("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H100 PCIe", 756.5e12), ("NVIDIA H100 NVL", 835.5e12),
    ("NVIDIA H200", 989.4e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A10G", 70e12), ("NVIDIA A10", 125e12),
    ("NVIDIA L4", 121e12), ("NVIDIA L40S", 362.05e12), ("NVIDIA GeForce RTX 4090", 165.2e12), ("Tesla T4", 65e12),
    ("NVIDIA L40", None), ("Some Future GPU", None),
])
def test_peak_flops_table_matches_device_names_as_whole_tokens(name: str, flops: float | None) -> None:
    assert peak_flops_for(name) == flops
