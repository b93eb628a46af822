"""Shared test fixtures: small configs and deterministic seeds."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

# Tests run on 2 cores; more threads than cores only adds contention.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """One intra-op thread for a test of tiny models: a second thread only adds synchronisation (and
    stalls badly on a busy machine). Restores the thread count afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def cli_env() -> dict[str, str]:
    """Environment for subprocess runs of the CLI from the source tree."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    return env


PYTHON = sys.executable
