"""Structured output and tool calls in the OpenAI API: requests -> grammars, replies -> ``tool_calls``.

``response_format`` (chat and completions) becomes a :class:`~tinyformer.generation.constraint.Grammar`
that every choice decodes under (:func:`response_grammar`); a schema that is invalid, or uses a keyword
the grammar engine cannot enforce, is a 400 naming it, never a reply with the schema ignored.

``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (chat, :func:`tool_setup`): the tools reach the
prompt through the chat template (``tools=``; data/chat_template.py), and the reply is constrained to the
tool-call format of data/chat_template.py, one ``<tool_call>`` block per call, name among the declared
functions and arguments valid under its ``parameters``:

==================  ======================================================================================
``tool_choice``     the reply
==================  ======================================================================================
``"none"``          text, unconstrained (the tools are still shown, as OpenAI does)
``"auto"``          text, or text then calls; constrained from the moment ``<tool_call>`` is written
(default)
``"required"``      one call (one or more with ``parallel_tool_calls``), any declared function
``{"function":      one call (or more) of that function
{"name": F}}``
==================  ======================================================================================

The reply's text is parsed back (:func:`reply_message`): ``message.tool_calls`` (``id``, ``type``,
``function.name``, ``function.arguments`` as JSON text), ``content`` the text before the calls (None when
empty), ``finish_reason`` "tool_calls". Streams send the same as OpenAI's deltas (:class:`ToolCallDeltas`):
content deltas for the text, then per call a delta with its ``index``, ``id``, ``type`` and ``name`` and
``arguments`` "", then ``arguments`` pieces as they are generated.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from tinyformer.data.chat_template import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, parse_tool_calls
from tinyformer.errors import GenerationError
from tinyformer.generation import constraint
from tinyformer.generation.constraint import Grammar
from tinyformer.serve import protocol as P
from tinyformer.serve.protocol import APIError

__all__ = ["ToolCallDeltas", "chat_messages", "incomplete_details", "reply_message", "response_grammar",
           "tool_setup"]


def response_grammar(fmt: P.ResponseFormat | None) -> Grammar | None:
    """The grammar of a ``response_format`` (None for text); a 400 naming the problem otherwise."""
    if fmt is None or fmt.type == "text":
        return None
    try:
        if fmt.type == "json_object":
            return constraint.json_object()
        if fmt.json_schema is None:
            raise APIError(400, "'response_format' of type 'json_schema' needs 'json_schema': {\"name\", \"schema\"}",
                           param="response_format.json_schema")
        schema = fmt.json_schema.schema_
        return constraint.json_schema({} if schema is None else schema)
    except GenerationError as exc:
        raise APIError(400, f"Invalid 'response_format': {exc}", param="response_format.json_schema.schema",
                       code="invalid_json_schema") from None


def chat_messages(messages: list[P.ChatMessage]) -> list[dict[str, Any]]:
    """The API messages as the chat template reads them: ``tool_calls`` with their arguments as objects (as
    Hugging Face templates expect), ``tool_call_id`` on tool results."""
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                try:
                    args = json.loads(c.function.arguments)
                except json.JSONDecodeError:
                    raise APIError(400, f"Invalid value for 'messages.{i}.tool_calls.{j}.function.arguments': not "
                                        "JSON text", param=f"messages.{i}.tool_calls.{j}.function.arguments") from None
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                           "arguments": args}})
            d["tool_calls"] = calls
        out.append(d)
    return out


def tool_setup(req: P.ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, Grammar | None]:
    """(the tools for the chat template, the grammar of the reply) of a chat request; 400s for a malformed
    tool list, a ``tool_choice`` naming an undeclared function, a ``tool_choice`` without tools."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):  # an empty list, or none at all
            raise APIError(400, "'tool_choice' needs a non-empty 'tools' list" if req.tools is not None else
                           "'tool_choice' is only allowed when 'tools' are specified", param="tool_choice")
        return None, None
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise APIError(400, f"Invalid 'tools': the function name '{dup}' is declared twice", param="tools")
    tools = [t.model_dump(by_alias=True, exclude_none=True) for t in req.tools]
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if choice == "none":
        return tools, None
    functions = [(t.function.name, t.function.parameters) for t in req.tools]
    if isinstance(choice, P.NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(400, f"Invalid 'tool_choice': the function '{choice.function.name}' is not among the "
                                f"declared tools ({', '.join(names)})", param="tool_choice")
        functions = [f for f in functions if f[0] == choice.function.name]
    try:
        grammar = constraint.tool_calls(functions, required=choice != "auto", parallel=req.parallel_tool_calls)
    except GenerationError as exc:
        raise APIError(400, f"Invalid 'tools': {exc}", param="tools") from None
    return tools, grammar


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def reply_message(text: str, finish_reason: str | None, tools_on: bool) -> tuple[dict[str, Any], str | None]:
    """(the assistant ``message``, the ``finish_reason``) of a reply's text: with tools, its complete
    ``<tool_call>`` blocks become ``tool_calls`` and the finish reason "tool_calls"."""
    if tools_on:
        content, calls = parse_tool_calls(text)
        if calls:
            return ({"role": "assistant", "content": content or None,
                     "tool_calls": [{"id": _call_id(), "type": "function",
                                     "function": {"name": name, "arguments": args}} for name, args in calls]},
                    "tool_calls" if finish_reason == "stop" else finish_reason)
    return {"role": "assistant", "content": text}, finish_reason


def incomplete_details(grammar: Grammar | None, complete: bool | None) -> dict[str, Any]:
    """The ``incomplete_details`` a choice that ran out of tokens before completing the structure of ``grammar``
    (``complete`` False) carries, as the OpenAI Responses API's: the text is a prefix of valid output, not valid
    output; {} for any other choice."""
    if grammar is None or complete is not False:
        return {}
    return {"incomplete_details": {
        "reason": "max_tokens",
        "message": f"max_tokens ran out before the output completed {grammar.describe()}; the text is an "
                   "incomplete prefix, not valid output"}}


_HEAD = '{"name": '
_ARGS = ', "arguments": '
_TAIL = "}" + TOOL_CALL_CLOSE


class ToolCallDeltas:
    """A streamed reply's text -> OpenAI chat deltas: ``feed(text)`` returns the deltas the new text
    completes (``{"content": ...}`` and ``{"tool_calls": [...]}``), ``close()`` the rest. Text that may be
    the start of ``<tool_call>`` is held back until it is known not to be; a call's arguments stream as they
    come, without the ``}`` and closing tag that end the block (the grammar writes the format exactly)."""

    def __init__(self) -> None:
        self.buf = ""
        self.state = "text"  # text -> head (name) -> args -> between -> head ...
        self.index = -1
        self.calls = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.buf += text
        out: list[dict[str, Any]] = []
        while True:
            if self.state in ("text", "between"):
                at = self.buf.find(TOOL_CALL_OPEN)
                if at >= 0:
                    if self.state == "text" and self.buf[:at]:
                        out.append({"content": self.buf[:at]})
                    self.buf, self.state = self.buf[at + len(TOOL_CALL_OPEN):], "head"
                    continue
                if self.state == "text":
                    keep = next((k for k in range(min(len(TOOL_CALL_OPEN) - 1, len(self.buf)), 0, -1)
                                 if TOOL_CALL_OPEN.startswith(self.buf[-k:])), 0)
                    if len(self.buf) > keep:
                        out.append({"content": self.buf[: len(self.buf) - keep]})
                        self.buf = self.buf[len(self.buf) - keep:]
                return out
            if self.state == "head":
                at = self.buf.find(_ARGS)
                if not self.buf.startswith(_HEAD[: len(self.buf)]) or at < 0:
                    return out
                try:
                    name = json.loads(self.buf[len(_HEAD):at])
                except json.JSONDecodeError:
                    return out
                self.index += 1
                out.append({"tool_calls": [{"index": self.index, "id": _call_id(), "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
                self.buf, self.state = self.buf[at + len(_ARGS):], "args"
                continue
            # args: everything up to the block's end, minus what may be its "}" and closing tag
            at = self.buf.find(_TAIL)
            piece = self.buf[:at] if at >= 0 else self.buf[: max(0, len(self.buf) - len(_TAIL))]
            if piece:
                out.append({"tool_calls": [{"index": self.index, "function": {"arguments": piece}}]})
            self.buf = self.buf[len(piece):]
            if at < 0:
                return out
            self.buf, self.state = self.buf[len(_TAIL):], "between"
            self.calls += 1

    def close(self) -> list[dict[str, Any]]:
        """The text still held back, as content (a reply cut short inside a call keeps what it has)."""
        rest, self.buf = self.buf, ""
        if self.state == "text" and rest:
            return [{"content": rest}]
        if self.state == "args" and rest:
            return [{"tool_calls": [{"index": self.index, "function": {"arguments": rest}}]}]
        return []
