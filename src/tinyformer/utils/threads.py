"""CPU threads for a machine that may be busy: how many intra-op threads, and how they wait.

PyTorch's default is one OpenMP thread per core, each spinning (busy-waiting) between parallel regions.
On an idle machine that is fastest; when other processes use the cores, the threads of one parallel
region are descheduled in turn and every region waits for its slowest thread, so a step takes several
times longer than with fewer threads (docs/benchmarks/threads.md measures it). The command line therefore
chooses, before any work:

    threads = --threads / train.threads                        when given
            = $OMP_NUM_THREADS                                 when set (torch already obeys it)
            = max(1, min(usable cores, usable cores - floor(load)))   otherwise

where ``load`` is the 1-minute load average (runnable processes, ``os.getloadavg``) and the usable
cores are those of the process' CPU affinity. With nothing else running that is every core, as before.
The load is rounded down, not to the nearest: the average decays over a minute, so a command started
right after another one finished (an install, say) still sees a load of 0.5-0.9 from it, and one core
held back for a whole training run on that account made the README's main command 1.6x slower.
The OpenMP wait policy becomes ``passive`` (idle threads sleep instead of spinning) unless
``$OMP_WAIT_POLICY`` is set: it must be in the environment before the OpenMP runtime loads (with
torch), so :func:`set_wait_policy` runs when the command line is imported.
"""

from __future__ import annotations

import math
import os

#: Where the chosen count came from, for the message a command prints.
SOURCES = ("flag", "OMP_NUM_THREADS", "load", "cores")


def set_wait_policy() -> None:
    """Make idle OpenMP threads sleep (``OMP_WAIT_POLICY=PASSIVE``) unless the user chose a policy.
    Effective only before torch (and with it the OpenMP runtime) is first imported."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def idle_cores(cores: int | None = None, load: float | None = None) -> int:
    """``cores - floor(load)``, clamped to [1, cores]; ``load`` defaults to the 1-minute load average
    (all cores when the OS does not report one)."""
    cores = usable_cores() if cores is None else cores
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            return cores
    return max(1, min(cores, cores - math.floor(load)))


def choose_threads(requested: int | None = None) -> tuple[int, str]:
    """(thread count, where it came from: one of :data:`SOURCES`) following the rule in the module docstring."""
    if requested is not None:
        return requested, "flag"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    cores = usable_cores()
    n = idle_cores(cores)
    return n, ("load" if n < cores else "cores")


_configured: tuple[int, str] | None = None


def configure_threads(requested: int | None = None) -> tuple[int, str]:
    """Set torch's intra-op thread count by :func:`choose_threads`; returns (count, source)."""
    global _configured
    import torch

    from tinyformer.errors import ConfigError

    if requested is not None and requested < 1:
        raise ConfigError(f"--threads must be >= 1, got {requested}")
    n, source = choose_threads(requested)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    _configured = (n, source)
    return n, source


def configured_threads() -> str:
    """:func:`describe_threads` of the count in effect (as the last :func:`configure_threads` chose it)."""
    import torch

    n = torch.get_num_threads()
    source = _configured[1] if _configured is not None and _configured[0] == n else "flag"
    return describe_threads(n, source)


def describe_threads(n: int, source: str) -> str:
    """A short phrase for the console: '1 thread (2 cores, load 1.3)'."""
    plural = "thread" if n == 1 else "threads"
    if source == "load":
        try:
            load = f", load {os.getloadavg()[0]:.1f}"
        except (AttributeError, OSError):
            load = ""
        return f"{n} {plural} ({usable_cores()} cores{load}; --threads to change)"
    if source == "OMP_NUM_THREADS":
        return f"{n} {plural} ($OMP_NUM_THREADS)"
    return f"{n} {plural}"
