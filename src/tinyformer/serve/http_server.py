"""The HTTP layer under the app: uvicorn with a graceful shutdown, a header timeout and a connection cap.

Shutdown (SIGTERM, Ctrl-C), within ``shutdown_timeout`` seconds (S):

    1. stop accepting connections; close the idle keep-alive ones (uvicorn's own first step)
    2. the scheduler drains (:meth:`Scheduler.drain`): queued requests end at once, running ones may finish
       for S - 1 s (at least S / 2); whatever still runs then ends with a final "shutting down" event, so
       every stream ends with an error chunk and ``data: [DONE]``, and every plain request with a 503
    3. the process exits with status 0 (uvicorn would re-raise the signal and die by it)

Slow clients (one header byte a second, 1,000 such sockets) must not hold the server's sockets:

    header timeout (H)   a connection that has not sent a whole request head H seconds after it opened (or
                         after its previous response) gets 408 and is closed
    connection cap (C)   the C+1-th connection closes the oldest one that is still waiting for its request
                         head, or, when every connection carries a request, is answered 503 and closed; the
                         open sockets stay below C + 1, so /health is always reachable

The body timeout (a client that stops sending its body) is in :mod:`tinyformer.serve.guard`.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tinyformer.serve import DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS, DEFAULT_SHUTDOWN_TIMEOUT

log = logging.getLogger("tinyformer.serve")

_TIMEOUT_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_BUSY_503 = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\nretry-after: 1\r\n\r\n"


def connection_cap(requested: int) -> int:
    """``requested``, lowered to leave 64 descriptors of the process's open-file limit for everything else."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested
    return max(1, min(requested, soft - 64))


def guarded_protocol(header_timeout: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the header timeout and the connection cap of the module docstring."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            self._opened = self.loop.time()
            self._arm_header_timer()
            if len(self.connections) > max_connections:
                self._make_room()

        def _waiting_for_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._header_timed_out)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timed_out(self) -> None:
            self._header_timer = None
            if self._waiting_for_head() and not self.transport.is_closing():
                self.transport.write(_TIMEOUT_408)
                self.transport.close()

        def _make_room(self) -> None:
            idle = sorted((c for c in self.connections if c is not self and getattr(c, "_waiting_for_head", None)
                           and c._waiting_for_head() and not c.transport.is_closing()),
                          key=lambda c: c._opened)
            closing = idle[0] if idle else self  # the oldest idle connection, else this one
            closing.transport.write(_TIMEOUT_408 if idle else _BUSY_503)
            closing.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._waiting_for_head():
                self._arm_header_timer()  # a keep-alive connection starting its next request
            super().data_received(data)
            if not self._waiting_for_head():
                self._disarm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

    return GuardedH11Protocol


class GracefulServer(uvicorn.Server):
    """uvicorn's server with the shutdown of the module docstring: ``drain(grace)`` (the scheduler's) is
    called when the shutdown begins, and a signal that asked for it is not re-raised afterwards."""

    def __init__(self, config: uvicorn.Config, drain: Any, shutdown_timeout: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        grace = max(self._shutdown_timeout - 1.0, self._shutdown_timeout / 2)
        log.info("shutting down: running requests have %.1f s to finish", grace)
        self._drain(grace)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()  # a clean stop on SIGTERM exits 0, not by the signal
        await super().shutdown(sockets)


def make_server(app: Any, *, log_level: str = "info", shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
                header_timeout: float = DEFAULT_HEADER_TIMEOUT,
                max_connections: int = DEFAULT_MAX_CONNECTIONS) -> GracefulServer:
    """The uvicorn server for ``app`` (from :func:`~tinyformer.serve.app.create_app`), run with
    ``server.run(sockets=[sock])``."""
    config = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=shutdown_timeout,
                            http=guarded_protocol(header_timeout, connection_cap(max_connections)))
    return GracefulServer(config, app.state.server.scheduler.drain, shutdown_timeout)
