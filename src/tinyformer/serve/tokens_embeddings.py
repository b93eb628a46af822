"""The routes every served run has besides generation: tokens, embeddings, and the app around an encoder.

    POST /tokenize        {"content": str, "add_special": bool} -> {"tokens": [int], "pieces": [str]}
    POST /detokenize      {"tokens": [int]} -> {"content": str}          (the names llama.cpp's server uses)
    POST /v1/embeddings   OpenAI's request and response (encoder runs: BERT, sentence-transformers imports)

A piece is the text a token stands for (generation/token_pieces.py): a special token's name, and for a token
that is part of a UTF-8 character its bytes written ``\\xNN``. ``/detokenize`` keeps special tokens, so
detokenizing what ``/tokenize`` gave returns the content.

Embeddings are :func:`~tinyformer.models.sentence_embeddings.embed_ids` of the texts' tokens, exactly
what ``tinyformer embed`` prints: the run's pooling, L2-normalised (unit vectors, as OpenAI's are).
``encoding_format: "base64"`` (what the official client asks for by default) sends each vector as the
base64 of its little-endian float32 bytes. The forward passes run in a worker thread, one request at a
time, so the event loop keeps answering.

An encoder run's app (:func:`~tinyformer.serve.app.create_app`) has these routes, the playground (its
sentence-similarity view), ``/props``, ``/v1/models`` and ``/health``,
behind the same guard and error shapes as the decoder app (:func:`new_app`, which also answers
``GET /v1/models`` with the context length); the generation routes answer 400 there.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
from functools import cache
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinyformer.generation.token_pieces import token_pieces
from tinyformer.serve import DEFAULT_HEADER_TIMEOUT
from tinyformer.serve import protocol as P
from tinyformer.serve.guard import RequestGuard, is_loopback_host
from tinyformer.serve.protocol import APIError
from tinyformer.serve.server import Server, check_token_ids

__all__ = ["EncoderServer", "add_token_routes", "new_app"]

log = logging.getLogger("tinyformer.serve")

#: the playground's files (serve/static/), served at / and /static/<name>: plain files, no build step
STATIC_FILES = {"index.html": "text/html; charset=utf-8", "playground.js": "text/javascript; charset=utf-8",
                "playground.css": "text/css; charset=utf-8"}


@cache
def _static(name: str) -> str:
    return resources.files("tinyformer.serve").joinpath("static", name).read_text(encoding="utf-8")


def new_app(server: Server, *, max_body_bytes: int, bind_host: str, allowed_origins: tuple[str, ...],
            body_timeout: float | None = DEFAULT_HEADER_TIMEOUT, lifespan: Any = None) -> FastAPI:
    """The FastAPI app of ``server`` (``app.state.server``) with what every served run has: the request guard,
    the OpenAI-shaped error answers, the playground (GET /, /static/<name>, and GET /props, what it reads of
    the server), GET /v1/models (the one model served, with its context length), GET /health (with the
    scheduler's counters where there is one) and the token routes (:func:`add_token_routes`)."""
    app = FastAPI(title="tinyformer", version="0.1.0", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.server = server
    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes, local_only=server.api_key is None,
                       bound_to_loopback=is_loopback_host(bind_host), allowed_origins=allowed_origins,
                       body_timeout=body_timeout)

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
        return HTMLResponse(_static("index.html"), headers={"Cache-Control": "no-cache"})

    @app.get("/static/{name}", include_in_schema=False)
    async def static_file(name: str) -> Response:
        if name not in STATIC_FILES:
            raise APIError(404, f"GET /static/{name}: no such file", code="not_found")
        return Response(_static(name), media_type=STATIC_FILES[name], headers={"Cache-Control": "no-cache"})

    @app.get("/props")
    async def props(request: Request) -> dict[str, Any]:
        """What the playground shows and chooses by (llama.cpp's /props, in tinyformer's own fields): the
        model, its arch ("decoder" chats, "encoder" embeds), the context length, and the chat template's
        format ("jinja" with its source, or "plain" turns; none for an encoder)."""
        server.authorize(request)
        template = getattr(server, "template", None)
        return {"model": server.model_name, "arch": "encoder" if isinstance(server, EncoderServer) else "decoder",
                "context_length": server.context,
                "chat_format": None if template is None else "plain" if template.is_plain else "jinja",
                "chat_template": None if template is None else template.source}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        server.authorize(request)
        return {"object": "list", "data": [P.model_card(server.model_name, server.created, server.context)]}

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str, request: Request) -> dict[str, Any]:
        server.authorize(request)
        server.check_model(model_id)
        return P.model_card(server.model_name, server.created, server.context)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        stats = {} if isinstance(server, EncoderServer) else server.scheduler.stats()
        return {"status": "ok", "model": server.model_name, **stats}

    add_token_routes(app, server)
    return app


class EncoderServer(Server):
    """The state behind an encoder run's handlers: the model, tokenizer, limits and authentication (the
    checks and encoding of :class:`Server`, without a scheduler: an encoder generates nothing)."""

    def __init__(self, model: Any, tokenizer: Any, *, model_name: str, api_key: str | None = None,
                 max_len: int | None = None) -> None:
        from tinyformer.models.sentence_embeddings import embedding_limit

        self._serve(model, tokenizer, model_name, api_key)
        self.model = model
        self.context = embedding_limit(model, max_len)
        self._forward = threading.Lock()  # one batch of forward passes at a time

    def embed(self, rows: list[list[int]]) -> Any:
        from tinyformer.models.sentence_embeddings import embed_ids

        with self._forward:
            return embed_ids(self.model, rows, self.tokenizer.pad_id)


def _vector(values: Any, encoding_format: str) -> Any:
    """A (d,) float tensor as OpenAI sends it: a list of floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(values.float().numpy().astype("<f4").tobytes()).decode("ascii")
    return values.tolist()


def _embedding_rows(server: EncoderServer, given: Any) -> list[list[int]]:
    """Token ids per input, from any of the four accepted ``input`` shapes."""
    from tinyformer.models.sentence_embeddings import encode_texts

    inputs = [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else list(given)
    if not inputs:
        raise APIError(400, "'input' must not be empty", param="input")
    if len(inputs) > P.MAX_EMBEDDING_INPUTS:
        raise APIError(400, f"'input' holds {len(inputs)} items; at most {P.MAX_EMBEDDING_INPUTS} are accepted",
                       param="input")
    if isinstance(inputs[0], str):
        empty = next((i for i, text in enumerate(inputs) if not text), None)
        if empty is not None:
            raise APIError(400, f"'input.{empty}' is an empty string", param="input")
        try:
            return encode_texts(server.model, server.tokenizer, inputs, server.context)
        except Exception as exc:  # DataError for an unknown character; `tokenizers` raises bare Exceptions
            raise APIError(400, f"Invalid value for 'input': {exc}", param="input") from None
    for i, ids in enumerate(inputs):
        if not ids:
            raise APIError(400, f"'input.{i}' is an empty list of token ids", param="input")
        check_token_ids(ids, server.vocab_size, "input")
        if len(ids) > server.context:
            raise APIError(400, f"'input.{i}' has {len(ids)} tokens; this model reads at most {server.context}",
                           param="input", code="context_length_exceeded")
    return [list(ids) for ids in inputs]


def add_token_routes(app: FastAPI, server: Server) -> None:
    """POST /tokenize, /detokenize and /v1/embeddings on ``app`` (embeddings: an :class:`EncoderServer`)."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        server.authorize(request)
        req: P.TokenizeRequest = P.parse_request(P.TokenizeRequest, await request.body())
        ids = server.encode(req.content, "content", req.add_special)
        return {"tokens": ids, "pieces": [p.text for p in token_pieces(server.tokenizer, ids)]}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        server.authorize(request)
        req: P.DetokenizeRequest = P.parse_request(P.DetokenizeRequest, await request.body())
        check_token_ids(req.tokens, server.tokenizer.vocab_size, "tokens", "the tokenizer's vocabulary")
        try:
            return {"content": server.tokenizer.decode(req.tokens)}
        except Exception as exc:  # a gap in a foreign vocabulary
            raise APIError(400, f"Invalid value for 'tokens': {exc}", param="tokens") from None

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict[str, Any]:
        server.authorize(request)
        req: P.EmbeddingRequest = P.parse_request(P.EmbeddingRequest, await request.body())
        server.check_model(req.model)
        if not isinstance(server, EncoderServer):
            raise APIError(400, f"'{server.model_name}' is a decoder language model; /v1/embeddings needs an "
                                "encoder run (arch 'encoder': BERT, a sentence-transformers import)", param="model")
        dim = server.model.cfg.d_model
        if req.dimensions is not None and req.dimensions != dim:
            raise APIError(400, f"this model's embeddings have {dim} dimensions, not {req.dimensions}",
                           param="dimensions")
        rows = _embedding_rows(server, req.input)
        vectors = await asyncio.to_thread(server.embed, rows)
        return P.embedding_body(server.model_name, [_vector(v, req.encoding_format) for v in vectors],
                                sum(map(len, rows)))
