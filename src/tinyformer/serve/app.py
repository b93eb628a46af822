"""The HTTP server: an OpenAI-compatible API over the continuous-batching scheduler, plus a playground.

    GET  /                      the playground (static/index.html)
    GET  /health                {"status": "ok", active/waiting slots, counters}
    GET  /v1/models             the one model served
    POST /v1/completions        prompt -> text       (stream: server-sent events, ending with data: [DONE])
    POST /v1/chat/completions   messages -> message  (chat template from the tokenizer, or a plain default)

Each API request becomes one :class:`GenerationRequest` per choice (``n`` per prompt). The handler
submits them to the scheduler thread and awaits their :class:`StepEvent`s on an ``asyncio.Queue`` that
the scheduler feeds through ``loop.call_soon_threadsafe`` (one wake-up per step, see ``_Mailbox``); the
event loop never runs torch. When the client goes away (or the handler is cancelled) the requests are
cancelled and their slots freed.

``top_logprobs`` (completions: ``logprobs: N``; chat: ``logprobs: true, top_logprobs: N``) returns the
N most probable next tokens of every step, which the playground shows as a probability table.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from tinyformer.errors import TinyformerError
from tinyformer.generation.sampling import SamplingParams
from tinyformer.serve import protocol as P
from tinyformer.serve.chat import ChatTemplate
from tinyformer.serve.guard import DEFAULT_MAX_BODY_BYTES, RequestGuard, is_loopback_host
from tinyformer.serve.protocol import APIError
from tinyformer.serve.scheduler import GenerationRequest, QueueFull, Scheduler, StepEvent, TokenInfo

log = logging.getLogger("tinyformer.serve")

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class _Choice:
    """What one choice has produced so far (non-streaming responses are assembled from these)."""

    text: list[str] = field(default_factory=list)
    tokens: list[TokenInfo] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    length: int = 0  # characters emitted so far (for text_offset)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _EventStream(StreamingResponse):
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


class _Mailbox:
    """Hands events from the scheduler thread to the event loop's queues with one wake-up per batch.

    ``loop.call_soon_threadsafe`` per event would wake the loop (a write to its self-pipe) once per
    request per step; here the first event of a step schedules one drain and the rest just queue up.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: list[tuple[asyncio.Queue, StepEvent]] = []
        self._lock = threading.Lock()

    def post(self, queue: asyncio.Queue, event: StepEvent) -> None:  # scheduler thread
        with self._lock:
            self._pending.append((queue, event))
            if len(self._pending) > 1:
                return  # a drain is already scheduled
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:  # event loop
        with self._lock:
            items, self._pending = self._pending, []
        for queue, event in items:
            queue.put_nowait(event)


def _sse(data: dict[str, Any] | str) -> str:
    import json

    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class Server:
    """Everything a request handler needs: the model's scheduler, tokenizer, chat template, limits."""

    def __init__(self, model: Any, tokenizer: Any, *, model_name: str, max_batch: int = 16, max_queue: int = 64,
                 request_timeout: float | None = 600.0, api_key: str | None = None,
                 max_len: int | None = None, compile: bool = False, prefill_chunk: int | None = 256) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.created = P.now()
        self.api_key = api_key or None
        self.request_timeout = request_timeout if request_timeout and request_timeout > 0 else None
        self.vocab_size = int(model.cfg.vocab_size)
        self.scheduler = Scheduler(model, self.token_bytes, max_batch=max_batch, max_queue=max_queue,
                                   max_len=max_len, compile=compile, prefill_chunk=prefill_chunk)
        self.context = self.scheduler.max_len
        self.template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token,
                                     tokenizer.pad_token)
        added = tokenizer.backend.get_added_tokens_decoder()
        self.hidden_ids = frozenset(i for i, tok in added.items() if tok.special)
        self._token_text: dict[int, str] = {}
        self._box: _Mailbox | None = None

    def token_bytes(self, token_id: int) -> bytes:
        """A token's bytes; ids the model has but the tokenizer lacks (padded vocabularies) are empty."""
        try:
            return self.tokenizer.token_bytes(token_id)
        except TinyformerError:
            return b""

    # ------------------------------------------------------------------ checks
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'.",
                           param="model", code="model_not_found")

    def encode(self, text: str, param: str, add_special_tokens: bool = False) -> list[int]:
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as exc:  # DataError for an unknown character; `tokenizers` raises bare Exceptions
            raise APIError(400, f"Invalid value for '{param}': {exc}", param=param) from None

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            raw = self.token_bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: shown as its bytes, like OpenAI does
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._token_text[token_id] = text
        return text

    # ------------------------------------------------------------------ building scheduler requests
    def build(self, req: P._SamplingRequest, prompts: list[list[int]], max_tokens: int | None, default_max: int | None,
              top_logprobs: int, extra_stop: tuple[str, ...] = (),
              extra_stop_ids: tuple[int, ...] = ()) -> tuple[list[GenerationRequest], asyncio.Queue]:
        """One GenerationRequest per (prompt, choice), all feeding one asyncio.Queue."""
        stops = req.stop_strings()
        stops += [s for s in extra_stop if s not in stops]
        stop_ids = [] if req.ignore_eos or self.tokenizer.eos_id is None else [self.tokenizer.eos_id]
        stop_ids += [i for i in extra_stop_ids if i not in stop_ids]
        n_total = len(prompts) * req.n
        if n_total > self.scheduler.max_batch + self.scheduler.max_queue:
            raise APIError(400, f"this request asks for {n_total} sequences; the server takes at most "
                                f"{self.scheduler.max_batch + self.scheduler.max_queue} at once", param="n")
        inbox: asyncio.Queue[StepEvent] = asyncio.Queue()
        mailbox = self._mailbox()

        def sink(event: StepEvent) -> None:
            mailbox.post(inbox, event)

        deadline = time.monotonic() + self.request_timeout if self.request_timeout else None
        out = []
        for p, ids in enumerate(prompts):
            if not ids:
                if self.tokenizer.bos_id is None:
                    raise APIError(400, "The prompt is empty and the tokenizer has no BOS token to start from.",
                                   param="prompt")
                ids = [self.tokenizer.bos_id]
            room = self.context - len(ids)
            wanted = max_tokens if max_tokens is not None else min(default_max or room, room)
            if room < 1 or len(ids) + wanted > self.context:
                raise APIError(
                    400, f"This model's maximum context length is {self.context} tokens. However, you requested "
                         f"{len(ids) + wanted} tokens ({len(ids)} in the prompt, {wanted} for the completion). "
                         "Please reduce the prompt or max_tokens.",
                    param="messages" if isinstance(req, P.ChatCompletionRequest) else "prompt",
                    code="context_length_exceeded")
            for j in range(req.n):
                index = p * req.n + j
                params = SamplingParams(
                    temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p,
                    repetition_penalty=req.repetition_penalty, frequency_penalty=req.frequency_penalty,
                    presence_penalty=req.presence_penalty, max_new_tokens=wanted,
                    seed=None if req.seed is None else (req.seed + index) % 2**64,
                    stop_token_ids=stop_ids, stop_strings=stops)
                try:
                    params.validate()
                except TinyformerError as exc:
                    raise APIError(400, str(exc)) from None
                out.append(GenerationRequest(list(ids), params, sink, index=index, top_logprobs=top_logprobs,
                                             deadline=deadline, hidden_token_ids=self.hidden_ids))
        return out, inbox

    def _mailbox(self) -> _Mailbox:
        loop = asyncio.get_running_loop()
        if self._box is None or self._box.loop is not loop:
            self._box = _Mailbox(loop)
        return self._box

    def submit(self, reqs: list[GenerationRequest]) -> None:
        try:
            self.scheduler.submit(reqs)
        except QueueFull as exc:
            raise APIError(429, str(exc), type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None

    def cancel(self, reqs: list[GenerationRequest]) -> None:
        self.scheduler.cancel([r.id for r in reqs])


def _event_error(event: StepEvent) -> APIError:
    if event.finish_reason == "timeout":
        return APIError(504, event.error or "the request timed out", type="timeout", code="timeout")
    if event.finish_reason == "model_error":  # the model, not the server, failed: no 500 and no garbage text
        return APIError(503, event.error or "the model's output is not usable", type="server_error",
                        code="model_error")
    return APIError(500, event.error or "generation failed", type="server_error", code="internal_error")


async def _collect(request: Request, server: Server, reqs: list[GenerationRequest],
                   inbox: asyncio.Queue) -> list[_Choice] | None:
    """Wait for every choice to finish; None if the client disconnected first."""
    choices = {r.index: _Choice() for r in reqs}
    remaining = len(reqs)
    try:
        while remaining:
            try:
                event = await asyncio.wait_for(inbox.get(), timeout=0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    return None
                continue
            if event.error is not None:
                raise _event_error(event)
            _add(choices[event.index], event)
            if event.finish_reason is not None:
                remaining -= 1
    finally:
        server.cancel(reqs)  # no-op for finished requests; frees the slots otherwise
    return [choices[i] for i in sorted(choices)]


def _add(choice: _Choice, event: StepEvent) -> None:
    for tok in event.tokens:
        choice.tokens.append(tok)
        choice.offsets.append(choice.length)
    choice.text.append(event.text)
    choice.length += len(event.text)
    choice.finish_reason = event.finish_reason
    choice.prompt_tokens, choice.completion_tokens = event.prompt_tokens, event.completion_tokens


def _completion_logprobs(server: Server, tokens: list[TokenInfo], offsets: list[int]) -> dict[str, Any]:
    return {
        "tokens": [server.token_text(t.token_id) for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{server.token_text(i): lp for i, lp in t.top} for t in tokens],
        "text_offset": offsets,
    }


def _chat_logprobs(server: Server, tokens: list[TokenInfo]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": server.token_text(token_id), "logprob": logprob,
                "bytes": list(server.token_bytes(token_id))}

    return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                        for t in tokens]}


def _total_usage(choices: list[_Choice], prompt_lengths: list[int]) -> dict[str, int]:
    return P.usage(sum(prompt_lengths), sum(c.completion_tokens for c in choices))


def create_app(model: Any, tokenizer: Any, *, model_name: str, max_batch: int = 16, max_queue: int = 64,
               request_timeout: float | None = 600.0, api_key: str | None = None,
               max_len: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               bind_host: str = "127.0.0.1", allowed_origins: tuple[str, ...] = (), compile: bool = False,
               prefill_chunk: int | None = 256) -> FastAPI:
    """The FastAPI app serving ``model`` (a decoder LM, eval mode) with ``tokenizer``.

    The scheduler thread starts with the app (lifespan) and stops with it. ``app.state.server`` is the
    :class:`Server` (its ``scheduler`` has the slot counters). Every request passes
    :class:`~tinyformer.serve.guard.RequestGuard` first: bodies over ``max_body_bytes`` get 413 and, without
    an ``api_key``, cross-site browser requests (and, bound to loopback ``bind_host``, foreign Host names)
    get 403. ``compile`` decodes with the compiled step; ``prefill_chunk`` is the most prompt tokens a request
    feeds per step (see :class:`~tinyformer.serve.scheduler.Scheduler`).
    """
    server = Server(model, tokenizer, model_name=model_name, max_batch=max_batch, max_queue=max_queue,
                    request_timeout=request_timeout, api_key=api_key, max_len=max_len, compile=compile,
                    prefill_chunk=prefill_chunk)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.scheduler.start()
        try:
            yield
        finally:
            server.scheduler.stop()

    app = FastAPI(title="tinyformer", version="0.1.0", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.server = server
    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes, local_only=server.api_key is None,
                       bound_to_loopback=is_loopback_host(bind_host), allowed_origins=allowed_origins)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(P.error_body(message, code=code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(P.error_body(f"Invalid request: {exc.errors()[0].get('msg')}"), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(P.error_body(f"internal server error: {type(exc).__name__}", type="server_error"),
                            status_code=500)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground() -> HTMLResponse:
        page = resources.files("tinyformer.serve").joinpath("static/index.html").read_text(encoding="utf-8")
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": server.model_name, **server.scheduler.stats()}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        server.authorize(request)
        return {"object": "list", "data": [P.model_card(server.model_name, server.created)]}

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str, request: Request) -> dict[str, Any]:
        server.authorize(request)
        server.check_model(model_id)
        return P.model_card(server.model_name, server.created)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        server.authorize(request)
        req: P.CompletionRequest = P.parse_request(P.CompletionRequest, await request.body())
        server.check_model(req.model)
        texts, prompts = _completion_prompts(server, req.prompt)
        top = req.logprobs or 0
        reqs, inbox = server.build(req, prompts, req.max_tokens, DEFAULT_COMPLETION_TOKENS, top)
        prompt_lengths = [len(r.prompt_ids) for r in reqs[:: req.n]]  # the prompt counts once, not per choice
        rid, created = P.new_id("cmpl"), P.now()
        want_logprobs = req.logprobs is not None
        server.submit(reqs)

        def echo_of(index: int) -> str:
            return texts[index // req.n] if req.echo else ""

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def events() -> AsyncIterator[str]:
                choices = {r.index: _Choice() for r in reqs}
                for r in reqs:
                    if echo_of(r.index):
                        choices[r.index].length = len(echo_of(r.index))
                        yield _sse(P.completion_body(rid, created, req.model, [
                            {"index": r.index, "text": echo_of(r.index), "logprobs": None, "finish_reason": None}
                        ], None, chunk=True))
                remaining = len(reqs)
                while remaining:
                    event = await inbox.get()
                    if event.error is not None:
                        yield _sse(_event_error(event).body())
                        break
                    c = choices[event.index]
                    start = len(c.offsets)
                    _add(c, event)
                    if event.finish_reason is not None:
                        remaining -= 1
                    elif not event.text and not want_logprobs:
                        continue
                    lp = _completion_logprobs(server, c.tokens[start:], c.offsets[start:]) if want_logprobs else None
                    yield _sse(P.completion_body(rid, created, req.model, [
                        {"index": event.index, "text": event.text, "logprobs": lp,
                         "finish_reason": event.finish_reason}], None, chunk=True))
                else:
                    if include_usage:
                        yield _sse(P.completion_body(rid, created, req.model, [],
                                                     _total_usage(list(choices.values()), prompt_lengths), chunk=True))
                yield _sse("[DONE]")

            return _EventStream(events(), on_close=lambda: server.cancel(reqs))

        choices = await _collect(request, server, reqs, inbox)
        if choices is None:
            return JSONResponse(P.error_body("client disconnected"), status_code=499)
        body = []
        for index, c in enumerate(choices):
            echo = echo_of(index)
            offsets = [o + len(echo) for o in c.offsets]
            body.append({"index": index, "text": echo + "".join(c.text),
                         "logprobs": _completion_logprobs(server, c.tokens, offsets) if want_logprobs else None,
                         "finish_reason": c.finish_reason})
        return P.completion_body(rid, created, req.model, body, _total_usage(choices, prompt_lengths))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        server.authorize(request)
        req: P.ChatCompletionRequest = P.parse_request(P.ChatCompletionRequest, await request.body())
        server.check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in req.messages]
        try:
            prompt = server.template.render(messages, add_generation_prompt=True)
        except TinyformerError as exc:
            raise APIError(400, str(exc), param="messages") from None
        ids = server.encode(prompt, "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else 0
        reqs, inbox = server.build(req, [ids], max_tokens, None, top, extra_stop=server.template.stop_strings,
                                   extra_stop_ids=server.template.stop_token_ids(server.tokenizer.token_to_id))
        prompt_lengths = [len(reqs[0].prompt_ids)]
        rid, created = P.new_id("chatcmpl"), P.now()
        server.submit(reqs)

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def events() -> AsyncIterator[str]:
                choices = {r.index: _Choice() for r in reqs}
                for r in reqs:
                    yield _sse(P.chat_body(rid, created, req.model, [
                        {"index": r.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}], None, chunk=True))
                remaining = len(reqs)
                while remaining:
                    event = await inbox.get()
                    if event.error is not None:
                        yield _sse(_event_error(event).body())
                        break
                    _add(choices[event.index], event)
                    if event.finish_reason is not None:
                        remaining -= 1
                    elif not event.text and not req.logprobs:
                        continue
                    lp = _chat_logprobs(server, event.tokens) if req.logprobs else None
                    delta = {"content": event.text} if event.text else {}
                    yield _sse(P.chat_body(rid, created, req.model, [
                        {"index": event.index, "delta": delta, "logprobs": lp,
                         "finish_reason": event.finish_reason}], None, chunk=True))
                else:
                    if include_usage:
                        yield _sse(P.chat_body(rid, created, req.model, [],
                                               _total_usage(list(choices.values()), prompt_lengths), chunk=True))
                yield _sse("[DONE]")

            return _EventStream(events(), on_close=lambda: server.cancel(reqs))

        choices = await _collect(request, server, reqs, inbox)
        if choices is None:
            return JSONResponse(P.error_body("client disconnected"), status_code=499)
        body = [{"index": i, "message": {"role": "assistant", "content": "".join(c.text)},
                 "logprobs": _chat_logprobs(server, c.tokens) if req.logprobs else None,
                 "finish_reason": c.finish_reason} for i, c in enumerate(choices)]
        return P.chat_body(rid, created, req.model, body, _total_usage(choices, prompt_lengths))

    return app


def _completion_prompts(server: Server, prompt: Any) -> tuple[list[str], list[list[int]]]:
    """(texts, token ids) per prompt from any of the four accepted prompt shapes."""
    # As `tinyformer generate` does: a foreign (hf) tokenizer's post-processor adds e.g. Llama's BOS;
    # the tokenizers trained here have none. (Chat templates write their special tokens themselves.)
    special = getattr(server.tokenizer, "kind", "hf") == "hf"
    if isinstance(prompt, str):
        return [prompt], [server.encode(prompt, "prompt", special)]
    if not prompt:
        raise APIError(400, "'prompt' must not be an empty list", param="prompt")
    if isinstance(prompt[0], str):
        return list(prompt), [server.encode(p, f"prompt.{i}", special) for i, p in enumerate(prompt)]
    batches = [prompt] if isinstance(prompt[0], int) else prompt
    for ids in batches:
        bad = next((t for t in ids if not 0 <= t < server.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} in 'prompt' is outside the vocabulary [0, {server.vocab_size})",
                           param="prompt")
    texts = [server.tokenizer.decode(ids) for ids in batches]
    return texts, [list(ids) for ids in batches]


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
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
