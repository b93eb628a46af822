"""The server's state behind the HTTP handlers: the model's scheduler, the tokenizer, the chat template,
limits and authentication, and how a handler's API request becomes scheduler requests and their events
come back to the event loop.

Each API request becomes one :class:`GenerationRequest` per choice (``n`` per prompt). The handler
submits them to the scheduler thread and awaits their :class:`StepEvent`s on an ``asyncio.Queue`` that
the scheduler feeds through ``loop.call_soon_threadsafe`` (one wake-up per step, see ``_Mailbox``); the
event loop never runs torch, nor a chat template: templates render in a small thread pool of their own
(``render_chat``), under the template's time and size limits, so a template that loops or grows holds
one of those threads until its limit and the loop keeps answering everything else.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from tinyformer.data.chat_template import DEFAULT_TIMEOUT_S, ChatTemplate
from tinyformer.errors import TinyformerError
from tinyformer.generation.constraint import Grammar, Matcher, TokenVocabulary
from tinyformer.generation.sampling import SamplingParams
from tinyformer.generation.speculative import DEFAULT_DRAFT_TOKENS, SpeculativeConfig
from tinyformer.generation.streaming import TokenBytes
from tinyformer.serve import protocol as P
from tinyformer.serve.protocol import APIError
from tinyformer.serve.scheduler import GenerationRequest, QueueFull, Scheduler, StepEvent, TokenInfo

__all__ = ["Choice", "Server", "add_event", "check_token_ids", "collect", "event_error"]

TEMPLATE_THREADS = 4  # chat templates rendering at once; more requests wait for a thread


@dataclass
class Choice:
    """What one choice has produced so far (non-streaming responses are assembled from these)."""

    text: list[str] = field(default_factory=list)
    tokens: list[TokenInfo] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    length: int = 0  # characters emitted so far (for text_offset)
    finish_reason: str | None = None
    completion_tokens: int = 0
    complete: bool | None = None  # with a grammar: whether the text completed it


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


class Server:
    """Everything a request handler needs: the model's scheduler, tokenizer, chat template, limits."""

    def __init__(self, model: Any, tokenizer: Any, *, model_name: str, max_batch: int = 16, max_queue: int = 64,
                 request_timeout: float | None = 600.0, api_key: str | None = None,
                 max_len: int | None = None, compile: bool = False, prefill_chunk: int | None = 256,
                 prefix_cache_mb: float = 0, template_timeout: float = DEFAULT_TIMEOUT_S,
                 speculative: SpeculativeConfig | None = None, draft_model: Any = None) -> None:
        self._serve(model, tokenizer, model_name, api_key)
        self.request_timeout = request_timeout if request_timeout and request_timeout > 0 else None
        # requests may speculate whatever the server's default: K drafts at most (the server's, else the default)
        self.speculative = None if speculative is None else speculative.validate()
        self.max_draft_tokens = DEFAULT_DRAFT_TOKENS if speculative is None else speculative.draft_tokens
        self.has_draft_model = draft_model is not None
        self.scheduler = Scheduler(model, self.text_bytes, max_batch=max_batch, max_queue=max_queue,
                                   max_len=max_len, compile=compile, prefill_chunk=prefill_chunk,
                                   prefix_cache_mb=prefix_cache_mb, max_draft_tokens=self.max_draft_tokens,
                                   draft_model=draft_model)
        self.context = self.scheduler.max_len
        self.template = ChatTemplate(tokenizer, timeout_s=template_timeout)
        self.template_pool = ThreadPoolExecutor(max_workers=TEMPLATE_THREADS, thread_name_prefix="tinyformer-template")
        self._box: _Mailbox | None = None

    def _serve(self, model: Any, tokenizer: Any, model_name: str, api_key: str | None) -> None:
        """The fields of every served run (a decoder's or an encoder's) that the checks and encoding read."""
        self.tokenizer, self.model_name, self.created = tokenizer, model_name, P.now()
        self.api_key = api_key or None
        self.vocab_size = int(model.cfg.vocab_size)
        # shown text leaves special tokens out; log-probability entries name every token (raw bytes)
        self.text_bytes = TokenBytes(tokenizer)
        self._token_text: dict[int, str] = {}

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
            raw = self.text_bytes.raw(token_id)  # special tokens included
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: shown as its bytes, like OpenAI does
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._token_text[token_id] = text
        return text

    async def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The chat prompt of ``messages`` (and ``tools``), rendered off the event loop; a template that rejects
        them or hits a render limit is a 400 naming the reason."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.template_pool, self.template.render, messages, True, tools)
        except TinyformerError as exc:
            raise APIError(400, str(exc), param="messages") from None

    # ------------------------------------------------------------------ building scheduler requests
    def speculative_of(self, req: P._SamplingRequest) -> SpeculativeConfig | None:
        """The request's ``"speculative"`` field as a config: absent or null, the server's (``serve
        --speculative``); false, off; true, the server's or else prompt lookup; an object, its method and
        draft_tokens (at most the server's ``--draft-tokens``)."""
        opt = req.speculative
        if opt is None or opt is False:
            return self.speculative if opt is None else None
        if opt is True:
            return self.speculative or SpeculativeConfig("ngram", self.max_draft_tokens)
        k = self.max_draft_tokens if opt.draft_tokens is None else opt.draft_tokens
        if k > self.max_draft_tokens:
            raise APIError(400, f"'speculative.draft_tokens' is at most {self.max_draft_tokens} on this server "
                                f"(serve --draft-tokens), got {k}", param="speculative")
        if opt.method == "draft" and not self.has_draft_model:
            raise APIError(400, "'speculative.method' \"draft\" needs a server started with --draft-model",
                           param="speculative")
        return SpeculativeConfig(opt.method, k).validate()

    def build(self, req: P._SamplingRequest, prompts: list[list[int]], max_tokens: int | None, default_max: int | None,
              top_logprobs: int, extra_stop: tuple[str, ...] = (),
              extra_stop_ids: tuple[int, ...] = (), logprobs: bool = True, grammar: Grammar | None = None
              ) -> tuple[list[GenerationRequest], asyncio.Queue]:
        """One GenerationRequest per (prompt, choice), all feeding one asyncio.Queue; ``logprobs`` False when
        the API request does not return log-probabilities (the engine then skips computing them); ``grammar``
        the language every choice's text must belong to (each choice gets its own matcher)."""
        stops = req.stop_strings()
        stops += [s for s in extra_stop if s not in stops]
        stop_ids = [] if req.ignore_eos or self.tokenizer.eos_id is None else [self.tokenizer.eos_id]
        stop_ids += [i for i in extra_stop_ids if i not in stop_ids]
        n_total = len(prompts) * req.n
        if n_total > self.scheduler.max_batch + self.scheduler.max_queue:
            raise APIError(400, f"this request asks for {n_total} sequences; the server takes at most "
                                f"{self.scheduler.max_batch + self.scheduler.max_queue} at once", param="n")
        inbox: asyncio.Queue[StepEvent] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        if self._box is None or self._box.loop is not loop:
            self._box = _Mailbox(loop)
        sink = functools.partial(self._box.post, inbox)
        deadline = time.monotonic() + self.request_timeout if self.request_timeout else None
        speculative = self.speculative_of(req)
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
                asked = (f"the prompt alone has {len(ids)} tokens, which leaves no room for a completion. Please "
                         f"reduce the prompt to at most {self.context - 1} tokens" if room < 1 else
                         f"you requested {len(ids) + wanted} tokens ({len(ids)} in the prompt, {wanted} for the "
                         f"completion). Please reduce the prompt, or max_tokens to at most {room}")
                raise APIError(
                    400, f"This model's maximum context length is {self.context} tokens. However, {asked}.",
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
                    matcher = None if grammar is None else \
                        Matcher(grammar, TokenVocabulary.of(self.tokenizer, self.vocab_size, stop_ids))
                except TinyformerError as exc:
                    raise APIError(400, str(exc)) from None
                params.constraint = grammar
                out.append(GenerationRequest(list(ids), params, sink, index=index, top_logprobs=top_logprobs,
                                             deadline=deadline, logprobs=logprobs, speculative=speculative,
                                             constraint=matcher))
        return out, inbox

    def submit(self, reqs: list[GenerationRequest]) -> None:
        try:
            self.scheduler.submit(reqs)
        except QueueFull as exc:
            raise APIError(429, str(exc), type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None

    def cancel(self, reqs: list[GenerationRequest]) -> None:
        self.scheduler.cancel([r.id for r in reqs])


def check_token_ids(ids: list[int], limit: int, param: str, vocabulary: str = "the vocabulary") -> None:
    """A 400 naming the first of ``ids`` outside [0, ``limit``), the ``vocabulary`` of the request's ``param``."""
    bad = next((t for t in ids if not 0 <= t < limit), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} in '{param}' is outside {vocabulary} [0, {limit})", param=param)


def event_error(event: StepEvent) -> APIError:
    if event.finish_reason == "timeout":
        return APIError(504, event.error or "the request timed out", type="timeout", code="timeout")
    if event.finish_reason == "shutdown":
        return APIError(503, event.error or "the server is shutting down", type="server_error",
                        code="server_shutting_down")
    if event.finish_reason == "model_error":  # the model, not the server, failed: no 500 and no garbage text
        return APIError(503, event.error or "the model's output is not usable", type="server_error",
                        code="model_error")
    return APIError(500, event.error or "generation failed", type="server_error", code="internal_error")


async def collect(request: Request, server: Server, reqs: list[GenerationRequest],
                   inbox: asyncio.Queue) -> list[Choice]:
    """Wait for every choice to finish; a 499 APIError if the client disconnected first."""
    choices = {r.index: Choice() for r in reqs}
    remaining = len(reqs)
    try:
        while remaining:
            try:
                event = await asyncio.wait_for(inbox.get(), timeout=0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    raise APIError(499, "client disconnected") from None
                continue
            if event.error is not None:
                raise event_error(event)
            add_event(choices[event.index], event)
            if event.finish_reason is not None:
                remaining -= 1
    finally:
        server.cancel(reqs)  # no-op for finished requests; frees the slots otherwise
    return [choices[i] for i in sorted(choices)]


def add_event(choice: Choice, event: StepEvent) -> None:
    for tok in event.tokens:
        choice.tokens.append(tok)
        choice.offsets.append(choice.length)
    choice.text.append(event.text)
    choice.length += len(event.text)
    choice.finish_reason = event.finish_reason
    choice.completion_tokens = event.completion_tokens
    if event.complete is not None:
        choice.complete = event.complete
