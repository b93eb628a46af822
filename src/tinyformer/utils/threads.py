"""CPU threads for a machine that may be busy: how many intra-op threads, and how they wait.

PyTorch's default is one OpenMP thread per core, each spinning (busy-waiting) between parallel regions.
On an idle machine that is fastest; when other processes use the cores, the threads of one parallel
region are descheduled in turn and every region waits for its slowest thread, so a step takes several
times longer than with fewer threads (docs/benchmarks/threads.md measures it). The command line therefore
chooses, before any work:

    threads = --threads / train.threads                        when given
            = $OMP_NUM_THREADS                                 when set (torch already obeys it)
            = max(1, min(usable cores, usable cores - round(busy)))   otherwise

minus ``reserve`` cores that the command's own other threads need (``serve`` keeps one for its HTTP
event loop: on 2 idle cores a server with 2 torch threads streamed one client at 150 tokens/s and 16 at
1,043, with 1 thread at 295 and 1,229, docs/benchmarks/serve.md), where ``busy`` is how many cores other
processes keep busy *now*: the machine's non-idle share of CPU
time over 0.1 s (Linux ``/proc/stat``), times its core count; where that cannot be read, the 1-minute
load average. The usable cores are those of the process' CPU affinity. With nothing else running that
is every core, as before. Not the load average first: it decays over a minute, so a command started
right after another one ended (``train --objective sft`` after ``train``, or after ``pip install``)
would see 0.6-1.3 "runnable processes" that are gone, and hold back a core for its whole run; the
README's main command ran 1.6x slower that way.
A long command chooses again at its pauses (:func:`resample_threads`: training at every evaluation), so that
a run started while the cores were busy takes them once they are free; a count the user fixed stays.
The OpenMP wait policy becomes ``passive`` (idle threads sleep instead of spinning) when other processes
keep a core busy at start-up, unless ``$OMP_WAIT_POLICY`` is set; on an idle machine OpenMP's own default
stays (libgomp: spin for a while, then sleep), because a decode step is hundreds of small parallel regions
and a sleeping thread takes tens of microseconds to wake for each: on 2 idle cores, eager int8 / int4
decoding of SmolLM2-135M ran at 28.7 / 31.9 tokens/s with ``passive`` and 64.5 / 68.4 without. The policy
must be in the environment before the OpenMP runtime loads (with torch), so :func:`set_wait_policy` runs
when the command line is imported; its measurement of the busy cores is reused by :func:`choose_threads`.
"""

from __future__ import annotations

import os
from collections.abc import Callable


def set_wait_policy(busy: float | None = None) -> None:
    """Make idle OpenMP threads sleep (``OMP_WAIT_POLICY=PASSIVE``) when other processes keep at least one
    core busy (``busy``, default :func:`busy_cores` now), unless the user chose a policy; an idle machine
    keeps OpenMP's default. Effective only before torch (and with it the OpenMP runtime) is first imported."""
    if "OMP_WAIT_POLICY" in os.environ:
        return
    if busy is None:
        busy = _measured_busy()
    if busy is None or round(busy) >= 1:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


#: /proc/stat's aggregate "cpu" columns that are not busy time, and guest time (already counted in user)
_IDLE_COLUMNS, _GUEST_COLUMNS = (3, 4), (8, 9)
_last_busy: float | None = None


def _cpu_times(path: str = "/proc/stat") -> tuple[int, int, int]:
    """(busy jiffies, total jiffies, number of CPUs) of the whole machine, from ``path``."""
    with open(path, encoding="ascii") as f:
        lines = f.read().splitlines()
    columns = [int(x) for x in lines[0].split()[1:]]
    total = sum(v for i, v in enumerate(columns) if i not in _GUEST_COLUMNS)
    idle = sum(columns[i] for i in _IDLE_COLUMNS if i < len(columns))
    n_cpu = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return total - idle, total, max(1, n_cpu)


def busy_cores(interval: float = 0.1) -> float | None:
    """Cores kept busy over the next ``interval`` seconds by everything on the machine (this process
    sleeps meanwhile): n_cpu * busy jiffies / all jiffies from /proc/stat, sampled twice; None where
    /proc/stat cannot be read (not Linux)."""
    import time

    try:
        busy0, total0, n_cpu = _cpu_times()
        time.sleep(interval)
        busy1, total1, _ = _cpu_times()
    except (OSError, ValueError, IndexError):
        return None
    return n_cpu * (busy1 - busy0) / (total1 - total0) if total1 > total0 else 0.0


_busy_sample: tuple[float, float | None] | None = None  # (time.monotonic(), busy_cores()) for the wait policy


def _measured_busy() -> float | None:
    """:func:`busy_cores` now, kept for :func:`configure_threads` (one 0.1 s sample per command, not two)."""
    import time

    global _busy_sample
    _busy_sample = (time.monotonic(), busy_cores())
    return _busy_sample[1]


def _recent_busy(max_age: float = 5.0) -> float | None:
    """The wait policy's sample if it is at most ``max_age`` seconds old (then forgotten), else None."""
    import time

    global _busy_sample
    sample, _busy_sample = _busy_sample, None
    if sample is None or time.monotonic() - sample[0] > max_age:
        return None
    return sample[1]


def idle_cores(cores: int | None = None, busy: float | None = None) -> int:
    """``cores - round(busy)``, clamped to [1, cores]; ``busy`` defaults to :func:`busy_cores`, else the
    1-minute load average (all cores when neither can be read)."""
    global _last_busy
    cores = usable_cores() if cores is None else cores
    if busy is None:
        busy = busy_cores()
    if busy is None:
        try:
            busy = os.getloadavg()[0]
        except (AttributeError, OSError):
            return cores
    _last_busy = busy
    return max(1, min(cores, cores - round(busy)))


def choose_threads(requested: int | None = None, reserve: int = 0, busy: float | None = None) -> tuple[int, str]:
    """(thread count, where it came from: flag, OMP_NUM_THREADS, load, cores or reserved) by the module's rule;
    ``reserve`` cores are left to the command's other threads (at least one torch thread remains); ``busy``
    as in :func:`idle_cores` (measured now when None)."""
    if requested is not None:
        return requested, "flag"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    cores = usable_cores()
    idle = idle_cores(cores, busy)
    n = max(1, idle - reserve)
    if n < idle:
        return n, "reserved"
    return n, ("load" if n < cores else "cores")


_configured: tuple[int, str] | None = None


def configure_threads(requested: int | None = None, reserve: int = 0) -> tuple[int, str]:
    """Set torch's intra-op thread count by :func:`choose_threads`; returns (count, source)."""
    global _configured
    import torch

    from tinyformer.errors import ConfigError

    if requested is not None and requested < 1:
        raise ConfigError(f"--threads must be >= 1, got {requested}")
    n, source = choose_threads(requested, reserve, _recent_busy())
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    _configured = (n, source)
    return n, source


def resample_threads(sampler: Callable[[], float | None] | None = None) -> tuple[int, int] | None:
    """Choose the thread count again at a pause of a long command (training's evaluations): when the count in
    effect was chosen from the busy cores (not --threads, not $OMP_NUM_THREADS, not a reserve), measure them
    again with ``sampler`` (default :func:`busy_cores`) and set the count they leave now, so that a run started
    while the cores were busy takes them once they are free (and gives them back when they are busy again).
    Returns (old, new) when the count changed, else None."""
    global _configured
    import torch

    if _configured is None or _configured[1] not in ("load", "cores") or torch.get_num_threads() != _configured[0]:
        return None
    busy = (sampler or busy_cores)()
    if busy is None:
        return None
    old, new = _configured[0], idle_cores(None, busy)
    if new == old:
        return None
    torch.set_num_threads(new)
    _configured = (new, "load" if new < usable_cores() else "cores")
    return old, new


def configured_threads() -> str:
    """:func:`describe_threads` of the count in effect (as the last :func:`configure_threads` chose it)."""
    import torch

    n = torch.get_num_threads()
    source = _configured[1] if _configured is not None and _configured[0] == n else "flag"
    return describe_threads(n, source)


def describe_threads(n: int, source: str) -> str:
    """A short phrase for the console: '1 thread (2 cores, 1.0 busy; --threads to change)'."""
    plural = "thread" if n == 1 else "threads"
    if source == "load":
        busy = f", {_last_busy:.1f} busy" if _last_busy is not None else ""
        return f"{n} {plural} ({usable_cores()} cores{busy}; --threads to change)"
    if source == "OMP_NUM_THREADS":
        return f"{n} {plural} ($OMP_NUM_THREADS)"
    if source == "reserved":
        return f"{n} {plural} ({usable_cores()} cores, one kept for the server's other threads; --threads to change)"
    return f"{n} {plural}"
