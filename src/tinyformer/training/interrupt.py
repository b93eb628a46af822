"""Stopping training on Ctrl-C or SIGTERM without losing the work since the last checkpoint.

    1st SIGINT / SIGTERM   noted; the loop finishes the update in progress, saves a checkpoint at that
                           step (atomically, as every checkpoint) and returns; `train` then prints how to resume
    2nd one                the signal's default action: the process ends at once (the checkpoint being
                           written, if any, is a temporary folder that the next resume deletes)

The update in progress is finished rather than abandoned because its half-drawn batches have already
advanced the random streams: a checkpoint taken mid-update would not resume bit for bit.
Signal handlers can only be installed from the main thread; elsewhere :func:`stop_on_signals` does nothing.
A signal that was ignored when training started stays ignored (a shell starts background jobs with SIGINT
ignored, so that Ctrl-C at the terminal does not reach them; Python itself then installs no
KeyboardInterrupt handler either).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Set by the first signal; ``signal_name`` is e.g. ``"SIGINT"`` once asked to stop, else None."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def __bool__(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: object) -> None:
        self.signal_name = signal.Signals(signum).name
        for sig in SIGNALS:  # the next one is not caught: it ends the process at once
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, signal.SIG_DFL)
        print(f"\n{self.signal_name}: saving a checkpoint after the current step (press Ctrl-C again to quit "
              "at once, losing the steps since the last checkpoint)", file=sys.stderr, flush=True)


@contextlib.contextmanager
def stop_on_signals(enabled: bool = True) -> Iterator[StopRequest]:
    """Catch SIGINT and SIGTERM as a :class:`StopRequest` for the duration of the block (main thread only);
    the previous handlers are restored afterwards."""
    request = StopRequest()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN}
    for sig in previous:
        signal.signal(sig, request._handle)
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
