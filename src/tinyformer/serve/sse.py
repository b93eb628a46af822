"""Server-sent events: the one streaming loop behind ``/v1/completions`` and ``/v1/chat/completions``.

A streamed response is ``data: <json>\\n\\n`` chunks: opening chunks (an echo, the assistant role), one
chunk per step that produced text (or every step when log-probabilities are asked for), an optional
usage chunk, and ``data: [DONE]``. An error event ends the stream with an error chunk instead.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tinyformer.serve.scheduler import StepEvent
from tinyformer.serve.server import Choice, add_event, event_error

__all__ = ["EventStream", "sse", "stream_choices"]


class EventStream(StreamingResponse):
    """Server-sent events that always watch for the client going away and run ``on_close`` at the end.

    (Starlette's own response only notices a disconnect on the next write under some ASGI versions; a
    request waiting in the queue writes nothing, and its slot must still be freed at once.)
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the socket closed under us: same as a disconnect
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self._on_close()


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def stream_choices(inbox: asyncio.Queue, choices: dict[int, Choice], opening: list[dict[str, Any]],
                         chunk: Callable[[StepEvent, Choice, int], dict[str, Any] | None],
                         usage: Callable[[], dict[str, Any]] | None, every_step: bool) -> AsyncIterator[str]:
    """The SSE lines of one streamed API request: ``opening`` chunks, then ``chunk(event, choice, start)``
    for each event (``start``: the index of the event's first token in ``choice.tokens``) that has text, or
    for every event if ``every_step``, then ``usage()`` (if given) and ``[DONE]``. A ``chunk`` that returns
    None sends nothing (text held back, e.g. the start of a tool call)."""
    for body in opening:
        yield sse(body)
    remaining = len(choices)
    while remaining:
        event = await inbox.get()
        if event.error is not None:
            yield sse(event_error(event).body())
            break
        c = choices[event.index]
        start = len(c.offsets)
        add_event(c, event)
        if event.finish_reason is not None:
            remaining -= 1
        elif not event.text and not every_step:
            continue
        body = chunk(event, c, start)
        if body is not None:
            yield sse(body)
    else:
        if usage is not None:
            yield sse(usage())
    yield sse("[DONE]")
