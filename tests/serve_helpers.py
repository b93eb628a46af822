"""Test helpers for the HTTP server."""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI
from torch import nn


class BackgroundServer:
    """Run an app with uvicorn in a background thread, e.g. from a notebook, a test or a benchmark::

        with BackgroundServer(create_app(model, tok, model_name="m")) as srv:
            openai.OpenAI(base_url=srv.url + "/v1", api_key="-").completions.create(...)

    ``port=0`` picks a free port; ``url`` is known once the ``with`` block starts.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app, self.host, self.port = app, host, port
        self.url = ""
        self._server: Any = None
        self._thread: Any = None

    def __enter__(self) -> BackgroundServer:
        import socket
        import threading

        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        self.url = f"http://{self.host}:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False,
                                                     timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="tinyformer-http")
        self._thread.start()
        # a guard against a server that never starts, not a timing check: an app made with compile=True
        # compiles its decode steps before it starts serving, minutes on a loaded 2-core machine
        deadline = time.monotonic() + 600
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)


class SlowModel(nn.Module):
    """The model with a fixed pause per forward pass, so that requests overlap in time, a slot is reliably
    still busy when a test cancels or queues behind it, and a reply is still streaming when a test looks."""

    def __init__(self, inner: nn.Module, delay: float) -> None:
        super().__init__()
        self.inner, self.delay, self.cfg = inner, delay, inner.cfg

    def new_cache(self, *args, **kwargs):
        return self.inner.new_cache(*args, **kwargs)

    def forward(self, *args, **kwargs):
        time.sleep(self.delay)
        return self.inner(*args, **kwargs)
