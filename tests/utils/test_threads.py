"""Thread count and OpenMP wait policy on a busy machine (utils/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tinyformer.utils import threads


@pytest.mark.parametrize("cores, busy, want", [(2, 0.0, 2), (2, 0.4, 2), (2, 0.9, 1), (2, 1.2, 1), (2, 11.7, 1),
                                               (16, 3.6, 12), (16, 0.0, 16), (1, 0.0, 1)])
def test_idle_cores_is_cores_minus_the_busy_cores_rounded_clamped(cores, busy, want):
    assert threads.idle_cores(cores, busy) == want == max(1, min(cores, cores - round(busy)))


def test_busy_cores_is_the_non_idle_share_of_cpu_time_between_two_readings(monkeypatch):
    # /proc/stat columns: user nice system idle iowait irq softirq steal guest guest_nice
    snapshots = iter([(1000 + 100, 1000 + 400, 3),   # (busy, total, n_cpu) as _cpu_times returns them
                      (1000 + 250, 1000 + 700, 3)])
    monkeypatch.setattr(threads, "_cpu_times", lambda: next(snapshots))
    assert threads.busy_cores(0.0) == pytest.approx(3 * 150 / 300)


def test_cpu_times_reads_busy_total_and_cpus_from_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 1 5 100 4 2 3 0 7 0\ncpu0 5 0 2 50 2 1 1 0 3 0\ncpu1 5 1 3 50 2 1 2 0 4 0\n"
                    "intr 12345\n")
    total = 10 + 1 + 5 + 100 + 4 + 2 + 3 + 0  # guest columns left out: user already counts them
    assert threads._cpu_times(str(stat)) == (total - 100 - 4, total, 2)


def test_busy_cores_sees_a_process_that_spins_now():
    if threads.busy_cores(0.0) is None:
        pytest.skip("no /proc/stat here")
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        time.sleep(0.3)  # let it start spinning
        assert threads.busy_cores(0.3) >= 0.8  # one core at least: the spinner (the machine's other work adds)
    finally:
        spinner.kill()
        spinner.wait()


def test_flag_then_environment_then_load(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    monkeypatch.setattr(threads, "busy_cores", lambda: 2.2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.choose_threads() == (2, "load")
    assert "2.2 busy" in threads.describe_threads(2, "load")
    monkeypatch.setattr(threads, "busy_cores", lambda: 0.1)
    assert threads.choose_threads() == (4, "cores")
    monkeypatch.setattr(threads, "busy_cores", lambda: None)  # no /proc/stat: the load average
    monkeypatch.setattr(os, "getloadavg", lambda: (3.1, 0.0, 0.0))
    assert threads.choose_threads() == (1, "load")
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


def test_the_command_line_chooses_the_wait_policy_before_torch_loads():
    """Importing the command line decides the policy before torch is imported: PASSIVE where a core is busy
    (here: a spinning process next to it), and a user's choice stays."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = ("import sys, os; import tinyformer.cli.main; "
            "print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'))")
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 30: pass"])
    try:
        time.sleep(0.3)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    finally:
        spinner.kill()
        spinner.wait()
    assert out.stdout.split() == ["False", "PASSIVE"], out.stderr
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # a user's choice stays
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["False", "ACTIVE"], out.stderr


def test_the_wait_policy_is_passive_only_when_a_core_is_busy(monkeypatch):
    """Sleeping OpenMP threads protect a busy machine; an idle one keeps OpenMP's default (spinning a while
    between the many small parallel regions of a decode step: 2.2x the eager decoding speed on 2 cores)."""
    for busy, want in ((0.0, None), (0.4, None), (0.6, "PASSIVE"), (1.8, "PASSIVE"), (None, "PASSIVE")):
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        monkeypatch.setattr(threads, "busy_cores", lambda b=busy: b)
        threads.set_wait_policy()
        assert os.environ.get("OMP_WAIT_POLICY") == want, busy
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    threads.set_wait_policy(busy=3.0)
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_the_thread_count_reuses_the_wait_policys_sample_once(monkeypatch):
    """One 0.1 s sample serves both decisions of a command; a later choice measures again."""
    calls = []
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # set_wait_policy must not matter here
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    monkeypatch.setattr(threads, "busy_cores", lambda: calls.append(1) or 1.0)
    threads._measured_busy()
    assert threads.choose_threads(busy=threads._recent_busy()) == (3, "load") and len(calls) == 1
    assert threads._recent_busy() is None  # used once
    assert threads.choose_threads() == (3, "load") and len(calls) == 2


def test_a_reserve_leaves_cores_to_the_commands_other_threads(monkeypatch):
    """serve keeps one core for its event loop: 4 idle cores -> 3 torch threads, 2 -> 1, 1 -> still 1;
    a flag or $OMP_NUM_THREADS is taken as given."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "busy_cores", lambda: 0.0)
    for cores, want in ((4, 3), (2, 1), (1, 1)):
        monkeypatch.setattr(threads, "usable_cores", lambda c=cores: c)
        n, source = threads.choose_threads(reserve=1)
        assert n == want
        assert source == ("reserved" if want < cores else "cores")
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    monkeypatch.setattr(threads, "busy_cores", lambda: 2.0)  # 2 idle, one of them reserved
    assert threads.choose_threads(reserve=1) == (1, "reserved")
    assert "one kept for the server" in threads.describe_threads(1, "reserved")
    assert threads.choose_threads(2, reserve=1) == (2, "flag")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.choose_threads(reserve=1) == (2, "OMP_NUM_THREADS")


def test_resample_raises_the_count_when_the_cores_free_up_and_leaves_a_fixed_one(monkeypatch):
    import torch

    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    before = torch.get_num_threads()
    try:
        assert threads.configure_threads(None) is not None  # a real choice first, then the state under test
        torch.set_num_threads(1)
        monkeypatch.setattr(threads, "_configured", (1, "load"))  # started with 3 of 4 cores busy
        assert threads.resample_threads(lambda: 0.2) == (1, 4) and torch.get_num_threads() == 4
        assert threads.resample_threads(lambda: 0.1) is None  # no change: nothing to do
        assert threads.resample_threads(lambda: 2.0) == (4, 2) and torch.get_num_threads() == 2
        assert threads.resample_threads(lambda: None) is None  # nothing measured: the count stays
        monkeypatch.setattr(threads, "_configured", (2, "flag"))  # --threads: the user's count stays
        assert threads.resample_threads(lambda: 0.0) is None and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_training_takes_the_freed_cores_at_its_evaluations(monkeypatch, tmp_path, capsys):
    """A run started while 3 of 4 cores are busy trains on 1 thread, and on 4 once they are free: the busy
    cores are measured again at each evaluation (a fake sampler stands for /proc/stat)."""
    import torch

    from tinyformer.cli.main import main

    readings = iter([3.0] + [0.0] * 10)  # busy at start-up, idle afterwards
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    monkeypatch.setattr(threads, "busy_cores", lambda interval=0.1: next(readings))
    monkeypatch.setattr(threads, "_busy_sample", None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. the dog ran home.\n" * 200, encoding="utf-8")
    before = torch.get_num_threads()
    try:
        assert main(["train", "--data", str(corpus), "--tokenizer", "char", "--out", str(tmp_path / "run"),
                     "--steps", "4", "--eval-interval", "2", "--eval-iters", "1", "--model.d_model", "32",
                     "--model.n_layer", "1", "--model.n_head", "2", "--model.n_kv_head", "2", "--model.d_ff", "64",
                     "--model.max_seq_len", "16", "--batch-size", "2", "--sample-tokens", "0", "--warmup-steps",
                     "1", "--no-progress"]) == 0
        out = capsys.readouterr().out
        assert "device cpu, float32, 1 thread (4 cores, 3.0 busy; --threads to change)" in out
        assert "threads: 1 -> 4 threads" in out
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)
