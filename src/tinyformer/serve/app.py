"""The HTTP server: an OpenAI-compatible API over the continuous-batching scheduler, plus a playground.

    GET  /                      the playground (static/: a chat that shows the prompt, its tokens and each
                                token's probability; serve/tokens_embeddings.py serves it)
    GET  /props                 what the playground needs to know: arch, context length, chat template
    GET  /health                {"status": "ok", active/waiting slots, counters}
    GET  /v1/models             the one model served
    POST /v1/completions        prompt -> text       (stream: server-sent events, ending with data: [DONE])
    POST /v1/chat/completions   messages -> message  (chat template from the tokenizer, or a plain default)
    POST /apply-template        messages -> {"prompt": the exact text a chat completion feeds} (llama.cpp's name)
    POST /tokenize, /detokenize, /v1/embeddings   tokens and embeddings (serve/tokens_embeddings.py)

The handlers are thin: :class:`~tinyformer.serve.server.Server` turns a request into scheduler requests
and :func:`~tinyformer.serve.sse.stream_choices` streams their events; the event loop never runs torch.
When the client goes away (or the handler is cancelled) the requests are cancelled and their slots freed.

``top_logprobs`` (completions: ``logprobs: N``; chat: ``logprobs: true, top_logprobs: N``) returns the
N most probable next tokens of every step, which the playground shows as a probability table.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request

from tinyformer.data.chat_template import DEFAULT_TIMEOUT_S
from tinyformer.serve import DEFAULT_HEADER_TIMEOUT
from tinyformer.serve import protocol as P
from tinyformer.serve.guard import DEFAULT_MAX_BODY_BYTES
from tinyformer.serve.protocol import APIError
from tinyformer.serve.scheduler import GenerationRequest, TokenInfo
from tinyformer.serve.server import Choice, Server, check_token_ids, collect
from tinyformer.serve.sse import EventStream, stream_choices
from tinyformer.serve.structured import (
    ToolCallDeltas,
    chat_messages,
    incomplete_details,
    reply_message,
    response_grammar,
    tool_setup,
)
from tinyformer.serve.tokens_embeddings import EncoderServer, new_app

__all__ = ["Server", "create_app"]

log = logging.getLogger("tinyformer.serve")

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


def _completion_logprobs(server: Server, tokens: list[TokenInfo], offsets: list[int]) -> dict[str, Any]:
    return {"tokens": [server.token_text(t.token_id) for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{server.token_text(i): lp for i, lp in t.top} for t in tokens], "text_offset": offsets}


def _chat_logprobs(server: Server, tokens: list[TokenInfo]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": server.token_text(token_id), "logprob": logprob,
                "bytes": list(server.text_bytes.raw(token_id))}

    return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                        for t in tokens]}


async def _respond(request: Request, server: Server, req: Any, reqs: list[GenerationRequest], inbox: asyncio.Queue,
                   body: Callable[..., dict[str, Any]], choices: dict[int, Choice], opening: list[dict[str, Any]],
                   chunk: Callable[..., dict[str, Any] | None], every_step: bool,
                   final: Callable[[int, Choice], dict[str, Any]]) -> Any:
    """Submit ``reqs`` (the choices of one API request) and answer: streamed, ``opening``, then ``chunk`` per
    event into ``choices`` (:func:`~tinyformer.serve.sse.stream_choices`) and the usage chunk when
    ``stream_options.include_usage`` asks for it; else ``final(index, choice)`` of every finished choice. Each
    prompt counts once in ``usage``, not once per choice."""
    prompt_tokens = sum(len(r.prompt_ids) for r in reqs[:: req.n])

    def usage(done: Iterable[Choice]) -> dict[str, int]:
        return P.usage(prompt_tokens, sum(c.completion_tokens for c in done))

    server.submit(reqs)
    if req.stream:
        def usage_chunk() -> dict[str, Any]:
            return body([], usage(choices.values()), chunk=True)

        wanted = req.stream_options is not None and req.stream_options.include_usage
        events = stream_choices(inbox, choices, opening, chunk, usage_chunk if wanted else None, every_step)
        return EventStream(events, on_close=lambda: server.cancel(reqs))
    done = await collect(request, server, reqs, inbox)
    return body([final(i, c) for i, c in enumerate(done)], usage(done))


def create_app(model: Any, tokenizer: Any, *, model_name: str, max_batch: int = 16, max_queue: int = 64,
               request_timeout: float | None = 600.0, api_key: str | None = None,
               max_len: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               bind_host: str = "127.0.0.1", allowed_origins: tuple[str, ...] = (), compile: bool = False,
               prefill_chunk: int | None = 256, prefix_cache_mb: float = 0,
               template_timeout: float = DEFAULT_TIMEOUT_S,
               body_timeout: float | None = DEFAULT_HEADER_TIMEOUT,
               speculative: Any = None, draft_model: Any = None) -> FastAPI:
    """The FastAPI app serving ``model`` (a decoder LM, eval mode) with ``tokenizer``; an encoder's app
    (:class:`~tinyformer.serve.tokens_embeddings.EncoderServer`) embeds and tokenizes, ``max_len`` capping the
    tokens a text keeps (default: the model's limit).

    The scheduler thread starts with the app (lifespan) and stops with it. ``app.state.server`` is the
    :class:`Server` (its ``scheduler`` has the slot counters). Every request passes
    :class:`~tinyformer.serve.guard.RequestGuard` first: bodies over ``max_body_bytes`` get 413 and, without
    an ``api_key``, cross-site browser requests (and, bound to loopback ``bind_host``, foreign Host names)
    get 403. ``compile`` decodes with the compiled step; ``prefill_chunk`` is the most prompt tokens a request
    feeds per step, ``prefix_cache_mb`` the prefix cache's size (0: none); see
    :class:`~tinyformer.serve.scheduler.Scheduler`. ``template_timeout`` is the chat template's time limit
    (:class:`~tinyformer.data.chat_template.ChatTemplate`); templates render off the event loop.
    ``speculative`` (a :class:`~tinyformer.generation.speculative.SpeculativeConfig`) is every request's
    default, which a request's ``"speculative"`` field overrides; ``draft_model`` serves method "draft".
    """
    if model.cfg.arch == "encoder":  # embeddings and tokens, no generation
        encoder = EncoderServer(model, tokenizer, model_name=model_name, api_key=api_key, max_len=max_len)
        app = new_app(encoder, max_body_bytes=max_body_bytes, bind_host=bind_host, allowed_origins=allowed_origins,
                      body_timeout=body_timeout)

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def no_generation(request: Request) -> None:
            encoder.authorize(request)
            raise APIError(400, f"'{encoder.model_name}' is an encoder: it embeds text and does not generate it; "
                                "use POST /v1/embeddings")

        return app
    server = Server(model, tokenizer, model_name=model_name, max_batch=max_batch, max_queue=max_queue,
                    request_timeout=request_timeout, api_key=api_key, max_len=max_len, compile=compile,
                    prefill_chunk=prefill_chunk, prefix_cache_mb=prefix_cache_mb, template_timeout=template_timeout,
                    speculative=speculative, draft_model=draft_model)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.scheduler.start()
        try:
            yield
        finally:
            server.scheduler.stop()
            server.template_pool.shutdown(wait=False, cancel_futures=True)

    app = new_app(server, max_body_bytes=max_body_bytes, bind_host=bind_host, allowed_origins=allowed_origins,
                  body_timeout=body_timeout, lifespan=lifespan)

    @app.post("/apply-template")
    async def apply_template(request: Request) -> dict[str, Any]:
        """The exact prompt text /v1/chat/completions feeds for these messages (llama.cpp's name and shape);
        POST /tokenize of it (``add_special`` false) gives the prompt's tokens."""
        server.authorize(request)
        req: P.ApplyTemplateRequest = P.parse_request(P.ApplyTemplateRequest, await request.body())
        tools = [t.model_dump(by_alias=True, exclude_none=True) for t in req.tools] if req.tools else None
        return {"prompt": await server.render_chat(chat_messages(req.messages), tools)}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        server.authorize(request)
        req: P.CompletionRequest = P.parse_request(P.CompletionRequest, await request.body())
        server.check_model(req.model)
        grammar = response_grammar(req.response_format)
        texts, prompts = _completion_prompts(server, req.prompt)
        want_logprobs = req.logprobs is not None
        reqs, inbox = server.build(req, prompts, req.max_tokens, DEFAULT_COMPLETION_TOKENS, req.logprobs or 0,
                                   logprobs=want_logprobs, grammar=grammar)
        echoes = [texts[r.index // req.n] if req.echo else "" for r in reqs]  # by index: reqs[i].index == i
        body = functools.partial(P.completion_body, False, P.new_id("cmpl"), P.now(), req.model)
        opening = [body([{"index": i, "text": echo, "logprobs": None, "finish_reason": None}], None, chunk=True)
                   for i, echo in enumerate(echoes) if echo]

        def chunk(event: Any, c: Choice, start: int) -> dict[str, Any]:
            lp = _completion_logprobs(server, c.tokens[start:], c.offsets[start:]) if want_logprobs else None
            choice = {"index": event.index, "text": event.text, "logprobs": lp,
                      "finish_reason": event.finish_reason, **incomplete_details(grammar, event.complete)}
            return body([choice], None, chunk=True)

        def final(index: int, c: Choice) -> dict[str, Any]:
            offsets = [o + len(echoes[index]) for o in c.offsets]
            return {"index": index, "text": echoes[index] + "".join(c.text),
                    "logprobs": _completion_logprobs(server, c.tokens, offsets) if want_logprobs else None,
                    "finish_reason": c.finish_reason, **incomplete_details(grammar, c.complete)}

        choices = {i: Choice(length=len(echo)) for i, echo in enumerate(echoes)}
        return await _respond(request, server, req, reqs, inbox, body, choices, opening, chunk, want_logprobs, final)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        server.authorize(request)
        req: P.ChatCompletionRequest = P.parse_request(P.ChatCompletionRequest, await request.body())
        server.check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        tools, tool_grammar = tool_setup(req)
        grammar = response_grammar(req.response_format)
        if grammar is not None and tool_grammar is not None:
            raise APIError(400, "'response_format' together with 'tools' needs 'tool_choice': 'none' (the reply is "
                                "either tool calls or the formatted answer)", param="response_format")
        grammar = grammar or tool_grammar
        tools_on = tool_grammar is not None
        ids = server.encode(await server.render_chat(chat_messages(req.messages), tools), "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else 0
        reqs, inbox = server.build(req, [ids], max_tokens, None, top, extra_stop=server.template.stop_strings,
                                   extra_stop_ids=server.template.stop_token_ids,
                                   logprobs=bool(req.logprobs), grammar=grammar)
        body = functools.partial(P.completion_body, True, P.new_id("chatcmpl"), P.now(), req.model)
        deltas = {r.index: ToolCallDeltas() for r in reqs} if tools_on else {}
        opening = [body([{"index": r.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}], None, chunk=True) for r in reqs]

        def chunk(event: Any, c: Choice, start: int) -> dict[str, Any] | None:
            lp = _chat_logprobs(server, event.tokens) if req.logprobs else None
            finish = event.finish_reason
            if tools_on:
                d = deltas[event.index]
                parts = d.feed(event.text) + (d.close() if finish is not None else [])
                delta = _merge_deltas(parts)
                if finish == "stop" and d.calls:
                    finish = "tool_calls"
                if not delta and finish is None and lp is None:
                    return None  # held back: part of a tool call's head
            else:
                delta = {"content": event.text} if event.text else {}
            choice = {"index": event.index, "delta": delta, "logprobs": lp, "finish_reason": finish,
                      **incomplete_details(grammar, event.complete)}
            return body([choice], None, chunk=True)

        def final(index: int, c: Choice) -> dict[str, Any]:
            message, finish = reply_message("".join(c.text), c.finish_reason, tools_on)
            return {"index": index, "message": message,
                    "logprobs": _chat_logprobs(server, c.tokens) if req.logprobs else None,
                    "finish_reason": finish, **incomplete_details(grammar, c.complete)}

        choices = {r.index: Choice() for r in reqs}
        return await _respond(request, server, req, reqs, inbox, body, choices, opening, chunk, bool(req.logprobs),
                              final)

    return app


def _merge_deltas(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One chunk's delta from the pieces of ToolCallDeltas: the content joined, the tool-call pieces in
    order (a client assembles them by index, as from OpenAI)."""
    delta: dict[str, Any] = {}
    for p in parts:
        if "content" in p:
            delta["content"] = delta.get("content", "") + p["content"]
        else:
            delta.setdefault("tool_calls", []).extend(p["tool_calls"])
    return delta


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
        check_token_ids(ids, server.vocab_size, "prompt")
    texts = [server.tokenizer.decode(ids) for ids in batches]
    return texts, [list(ids) for ids in batches]
