"""Thread count and OpenMP wait policy on a busy machine (utils/threads.py)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from tinyformer.utils import threads


@pytest.mark.parametrize("cores, load, want", [(2, 0.0, 2), (2, 0.4, 2), (2, 0.9, 2), (2, 1.2, 1), (2, 11.7, 1),
                                               (16, 3.6, 13), (16, 0.0, 16), (1, 0.0, 1)])
def test_idle_cores_is_cores_minus_the_load_rounded_down_clamped(cores, load, want):
    # rounded down: the decaying load of a command that just ended (0.5-0.9) does not cost a core
    assert threads.idle_cores(cores, load) == want == max(1, min(cores, cores - math.floor(load)))


def test_flag_then_environment_then_load(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    monkeypatch.setattr(os, "getloadavg", lambda: (2.2, 0.0, 0.0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.choose_threads() == (2, "load")
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.0, 0.0))
    assert threads.choose_threads() == (4, "cores")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.choose_threads() == (3, "OMP_NUM_THREADS")
    assert threads.choose_threads(1) == (1, "flag")


def test_configure_sets_torch_threads_and_rejects_zero(monkeypatch):
    import torch

    from tinyformer.errors import ConfigError

    before = torch.get_num_threads()
    try:
        assert threads.configure_threads(1) == (1, "flag") and torch.get_num_threads() == 1
        with pytest.raises(ConfigError, match="--threads must be >= 1"):
            threads.configure_threads(0)
    finally:
        torch.set_num_threads(before)


def test_the_command_line_sets_a_passive_wait_policy_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = ("import sys, os; import tinyformer.cli.main; "
            "print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["False", "PASSIVE"], out.stderr
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # a user's choice stays
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["False", "ACTIVE"], out.stderr
