"""Limits every HTTP request meets before the API sees it: a body-size cap and, without an API key, the
browser-safety checks that keep a local server local.

Body cap (``max_body_bytes``, B): a request whose ``Content-Length`` exceeds B is answered 413 before a
byte of its body is read; a body without a length (chunked) is counted as it arrives and answered 413 at
the first chunk that takes the total past B, so at most B bytes plus one chunk are ever held.

Browser safety, applied only when the server has no API key (a key is something a web page cannot know):

    Host check (DNS rebinding)   bound to a loopback address, only Host: localhost / 127.x.y.z / [::1]
                                 (any port) is served; a page at evil.example re-pointed to 127.0.0.1
                                 sends Host: evil.example and gets 403
    Origin check (cross-site)    a request carrying an Origin (browsers send it on every cross-site and
                                 every POST request) must come from this server itself (Origin's
                                 host:port = Host), from a loopback origin while bound to loopback, or from
                                 an origin named with --allow-origin; else 403. This is what stops a
                                 ``text/plain`` POST (a "simple" request, sent without a CORS preflight)
                                 from another site; ``Sec-Fetch-Site: cross-site`` without an Origin is
                                 refused the same way.

Clients that are not browsers (curl, the openai package) send no Origin and are unaffected.

Body timeout (``body_timeout``, T): each part of a request body must arrive within T seconds of the last
(a client that stops mid-body gets 408), so a stalled upload cannot hold a handler forever.

Lingering close: an answer sent before the request body was read (the 413, a 403, a 408) would otherwise
be followed by closing the socket while the client is still uploading, and the kernel then resets the
connection: the client sees "connection reset" instead of the answer. So the answer's last part waits
while the rest of the body is read and discarded, for at most ``LINGER_SECONDS`` (and ``LINGER_IDLE``
seconds without data), as nginx's ``lingering_close`` does; the client then reads the answer.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tinyformer.serve import DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_BODY_BYTES
from tinyformer.serve.protocol import APIError


def is_loopback_host(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1 (with or without brackets)."""
    host = host.strip().strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _split_host(value: str) -> tuple[str, str]:
    """('host', 'port') of a Host header or an origin's netloc; the port may be ''."""
    parts = urlsplit("//" + value)
    try:
        port = str(parts.port or "")
    except ValueError:
        port = "?"
    return (parts.hostname or ""), port


LINGER_SECONDS = 10.0  # the longest an answer waits for the unread rest of a request body
LINGER_IDLE = 2.0  # ... and for each part of it


class _Body:
    """Whether the request body has been read to its end (or the client is gone)."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.done = "content-length" not in headers and "transfer-encoding" not in headers  # GET: no body

    def saw(self, message: Message) -> None:
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            self.done = True


class RequestGuard:
    """ASGI middleware: the body cap, the body timeout and the lingering close for every request, and the
    Host/Origin checks when ``local_only``."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, local_only: bool = True,
                 bound_to_loopback: bool = True, allowed_origins: Iterable[str] = (),
                 body_timeout: float | None = DEFAULT_HEADER_TIMEOUT) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.local_only = local_only
        self.bound_to_loopback = bound_to_loopback
        self.allowed_origins = {o.rstrip("/").lower() for o in allowed_origins}
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        body = _Body(headers)
        send = self.lingering(send, receive, body)
        receive = self.timed(receive, body)
        refusal = self.refusal(headers)
        if refusal is not None:
            await _answer(send, refusal)
            return
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                await _answer(send, APIError(400, f"Invalid Content-Length header {length!r}"))
                return
            if int(length) > self.max_body_bytes:
                await _answer(send, self.too_large(int(length)))
                return
        await self.app(scope, receive, send)

    # ------------------------------------------------------------------ checks
    def refusal(self, headers: dict[str, str]) -> APIError | None:
        """The 403 a request gets from the Host/Origin checks, or None when it may go on."""
        if not self.local_only:
            return None
        host_header = headers.get("host", "")
        host, port = _split_host(host_header)
        if self.bound_to_loopback and not is_loopback_host(host):
            return APIError(403, f"Host {host_header!r} is not served: this server is bound to a loopback address "
                                 "and answers only Host: localhost or 127.0.0.1 (DNS-rebinding protection). "
                                 "Start it with --api-key to serve other names.", code="forbidden_host")
        origin = headers.get("origin")
        if origin is not None:
            if self.origin_allowed(origin, host, port):
                return None
            return APIError(403, f"Origin {origin!r} may not use this server: cross-site browser requests are "
                                 "refused without an API key (start it with --api-key, or name the site with "
                                 "--allow-origin).", code="forbidden_origin")
        if headers.get("sec-fetch-site", "").lower() == "cross-site":
            return APIError(403, "Cross-site browser requests are refused without an API key.",
                            code="forbidden_origin")
        return None

    def origin_allowed(self, origin: str, host: str, port: str) -> bool:
        if origin.rstrip("/").lower() in self.allowed_origins:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False  # "null" (sandboxed frames, file://) and other schemes
        o_host, o_port = _split_host(parts.netloc)
        default = "443" if parts.scheme == "https" else "80"
        same = o_host == host and (o_port or default) == (port or default)
        return same or (self.bound_to_loopback and is_loopback_host(o_host))

    def too_large(self, size: int | None) -> APIError:
        got = f" ({size:,} bytes)" if size is not None else ""
        return APIError(413, f"Request body too large{got}: the limit is {self.max_body_bytes:,} bytes "
                             "(tinyformer serve --max-body-bytes).", code="request_too_large")

    def timed(self, receive: Receive, body: _Body) -> Receive:
        """``receive`` that raises a 413 APIError once the body grows past the cap (bodies without a length),
        notes the end of the body and, until then, answers 408 when a part of it takes longer than
        ``body_timeout``; afterwards (a stream waiting for the client to go away) it waits."""
        seen = 0

        async def wrapped() -> Message:
            nonlocal seen
            if body.done or self.body_timeout is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), self.body_timeout)
                except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11 on)
                    raise APIError(408, f"the request body stopped arriving: no data for {self.body_timeout:g} s "
                                        "(tinyformer serve --header-timeout)", code="request_timeout") from None
                body.saw(message)
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise self.too_large(None)
            return message

        return wrapped

    def lingering(self, send: Send, receive: Receive, body: _Body) -> Send:
        """``send`` that holds back the last part of an answer until the request body is read (and discarded)
        to its end, within ``LINGER_SECONDS``: see the module docstring."""

        async def wrapped(message: Message) -> None:
            if message["type"] != "http.response.body" or message.get("more_body", False) or body.done:
                await send(message)
                return
            await send({**message, "more_body": True})
            loop = asyncio.get_running_loop()
            deadline = loop.time() + LINGER_SECONDS
            while not body.done and (left := deadline - loop.time()) > 0:
                try:
                    body.saw(await asyncio.wait_for(receive(), min(left, LINGER_IDLE)))
                except asyncio.TimeoutError:
                    break
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        return wrapped


async def _answer(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
