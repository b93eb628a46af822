"""The OpenAI wire format: request schemas, the error shape, and response/chunk bodies.

Requests are validated strictly (``"5"`` is not an integer, ``true`` is not a number) and every
problem becomes the OpenAI error body ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
status, so the official client raises its usual exception types (BadRequestError for 400,
AuthenticationError 401, NotFoundError 404, RateLimitError 429).

Non-standard fields, accepted as vLLM does: ``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``. Unknown fields are ignored. ``response_format`` (both endpoints) and ``tools`` /
``tool_choice`` / ``parallel_tool_calls`` (chat) are enforced token by token (serve/structured.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tinyformer.generation.sampling import DEFAULT_MIN_P, DEFAULT_TOP_K, OPENAI_TEMPERATURE, OPENAI_TOP_P

MAX_LOGPROBS = 20


class APIError(Exception):
    """An error answered in the OpenAI shape with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---------------------------------------------------------------------------------------------- requests
class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class SpeculativeOptions(_Strict):
    """The request body's ``"speculative"`` object (non-standard): ``method`` "ngram" (prompt lookup) or "draft"
    (the server's ``--draft-model``), ``draft_tokens`` K per step (default: the server's)."""

    method: Literal["ngram", "draft"] = "ngram"
    draft_tokens: int | None = Field(None, ge=1, le=64)


class _SamplingRequest(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    # the OpenAI API's defaults (generation/sampling.py)
    temperature: float = Field(OPENAI_TEMPERATURE, ge=0.0)
    top_p: float = Field(OPENAI_TOP_P, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # non-standard (vLLM-compatible) sampler fields
    top_k: int = Field(DEFAULT_TOP_K, ge=0)
    min_p: float = Field(DEFAULT_MIN_P, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    # non-standard: speculative decoding of this request (None: the server's setting; false: off; true: on)
    speculative: Union[bool, SpeculativeOptions, None] = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise APIError(400, f"'stop' holds at most 4 strings, got {len(stops)}", param="stop")
        if any(s == "" for s in stops):
            raise APIError(400, "'stop' strings must not be empty", param="stop")
        return stops


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. ``prompt``: a string, a list of strings, token ids, or lists of token ids."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    response_format: ResponseFormat | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class JSONSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: Union[dict[str, Any], bool, None] = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict", "description"}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ApplyTemplateRequest(_Strict):
    """POST /apply-template (llama.cpp's server): the prompt a chat completion of ``messages`` would feed."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None  # rendered into the prompt as the chat completion renders them


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True


_HINTS = {
    "prompt": "'prompt' must be a string, a list of strings, a list of token ids or a list of lists of token ids",
    "input": "'input' must be a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "'stop' must be a string or a list of strings",
    "content": "message 'content' must be a string or a list of {\"type\": \"text\", \"text\": ...} parts",
    "tools": "'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\", \"description\", "
             "\"parameters\"}}",
    "tool_choice": "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                   "\"function\": {\"name\": ...}}",
    "response_format": "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                       "{\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\", \"strict\"}}",
}


def parse_request(model_cls: type[_Strict], body: bytes) -> Any:
    """Validate a JSON body into ``model_cls``; raise :class:`APIError` (400) naming the bad field."""
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as exc:
        raise _to_api_error(exc) from None


def _to_api_error(exc: ValidationError) -> APIError:
    err = exc.errors(include_url=False)[0]
    kind = err["type"]
    if kind == "json_invalid":
        return APIError(400, f"We could not parse the JSON body of your request: {err['msg']}. "
                             "The body must be a JSON object.", code="invalid_json")
    if not err["loc"]:
        return APIError(400, f"The request body must be a JSON object: {err['msg']}", code="invalid_json")
    # union members appear in the location as type names ('str', 'list[int]'); keep fields and indices
    parts = [str(p) for p in err["loc"] if isinstance(p, int) or ("[" not in p and p not in _TYPE_TAGS)]
    param = ".".join(parts)
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    field = parts[-1] if parts and not parts[-1].isdigit() else parts[0] if parts else ""
    hint = _HINTS.get(field) or _HINTS.get(parts[0] if parts else "")
    got = repr(err.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    if hint is not None and (kind.endswith("_type") or kind == "literal_error"):
        message = f"Invalid value for '{param}': {hint}; got {got}."
    else:
        message = f"Invalid value for '{param}': {err['msg']}; got {got}."
    return APIError(400, message, param=param, code="invalid_value" if not kind.endswith("_type") else "invalid_type")


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


# ---------------------------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_card(model_id: str, created: int, context_length: int | None = None) -> dict[str, Any]:
    """OpenAI's model object, plus ``context_length``: the most tokens a request may hold (prompt and
    completion together; an encoder's input)."""
    card: dict[str, Any] = {"id": model_id, "object": "model", "created": created, "owned_by": "tinyformer"}
    if context_length is not None:
        card["context_length"] = context_length
    return card


def completion_body(chat: bool, rid: str, created: int, model: str, choices: list[dict[str, Any]],
                    usage_: dict[str, int] | None, chunk: bool = False) -> dict[str, Any]:
    """A (chat) completion or one chunk of its stream; a chunk carries ``usage`` only when given one."""
    body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model}
    if chat:
        body.update(object="chat.completion.chunk" if chunk else "chat.completion", system_fingerprint=None)
    body["choices"] = choices
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


# ---------------------------------------------------------------------------------------------- tokens, embeddings
class TokenizeRequest(_Strict):
    """POST /tokenize (llama.cpp's server): ``add_special`` applies the tokenizer's post-processor."""

    content: str
    add_special: bool = False


class DetokenizeRequest(_Strict):
    """POST /detokenize (llama.cpp's server)."""

    tokens: list[int]


#: OpenAI's limit on the inputs of one embeddings request
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(_Strict):
    """POST /v1/embeddings. ``input``: a string, a list of strings, token ids, or lists of token ids;
    ``encoding_format`` "base64" sends each vector as the base64 of its little-endian float32 bytes."""

    model: str
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


def embedding_body(model: str, vectors: list[Any], prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's embeddings response: one ``{"object": "embedding", "index", "embedding"}`` per input."""
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
