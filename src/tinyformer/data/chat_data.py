"""Chat and preference data: the JSONL formats people have, read into one shape.

A *conversation* is a list of messages ``{"role": "system" | "user" | "assistant", "content": str}``.
Three row formats are read; the format is detected from a file's first row, and every row of the
file must then have that format:

    openai     {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...],
                "tools": [...] (optional)}
    sharegpt   {"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...]}
    alpaca     {"instruction": str, "input": str (optional), "output": str, "system": str (optional)}

(ShareGPT's ``user``/``assistant`` spellings of ``from`` are accepted too.) OpenAI rows may teach tool
calls as OpenAI's API writes them: an assistant message with ``tool_calls`` (``[{"id", "type": "function",
"function": {"name", "arguments"}}]``, arguments a JSON object or its text; ``content`` may then be null),
a ``tool`` message with the result (``content``, ``tool_call_id``), and the row's ``tools`` (the function
declarations the prompt lists); the chat template renders them (data/chat_template.py's tool format).
An Alpaca row becomes ``[system?, user: instruction + "\\n\\n" + input (when not empty), assistant: output]``.

A *preference pair* is ``{"prompt": str | "messages": [...], "chosen": str, "rejected": str}``:
the prompt is a user message (or a conversation ending with a user turn) and the two strings are
two assistant replies to it, the first preferred.

A row that fits no format, or is not a JSON object, is a :class:`DataError` naming the file and
line. A row that is well-formed but unusable (an empty conversation, one without an assistant turn,
a pair whose chosen and rejected replies are equal) is skipped and counted in ``skipped``.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinyformer.errors import DataError

ROLES = ("system", "user", "assistant")
OPENAI_ROLES = (*ROLES, "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}

Message = dict[str, Any]


def is_heldout(key: str, fraction: float) -> bool:
    """Whether the example keyed by ``key`` is in the held-out split: sha1(key) as a fraction of 2^32 < fraction.
    A hash, not a position, so the same question is held out by SFT and DPO and in any file order."""
    return int(hashlib.sha1(key.encode("utf-8")).hexdigest()[:8], 16) / 2**32 < fraction


@dataclass
class Conversation:
    """The messages of one row, and where the row came from (``file:line``)."""

    messages: list[Message]
    source: str
    tools: list[dict[str, Any]] | None = None


@dataclass
class PreferencePair:
    """A prompt (messages ending with a user turn), a preferred and a dispreferred assistant reply."""

    prompt: list[Message]
    chosen: str
    rejected: str
    source: str


@dataclass
class ChatFile:
    """What a chat file held: its format, the usable conversations and the skipped rows by reason."""

    format: str
    conversations: list[Conversation]
    skipped: Counter = field(default_factory=Counter)


@dataclass
class PreferenceFile:
    pairs: list[PreferencePair]
    skipped: Counter = field(default_factory=Counter)


def read_jsonl_rows(path: Path) -> list[tuple[int, Any]]:
    """(line number, parsed JSON) of every non-blank line of a JSONL data file (chat, preference or prompt rows)."""
    from tinyformer.data.corpus import jsonl_rows

    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    rows = list(jsonl_rows(path, "data file"))
    if not rows:
        raise DataError(f"data file {path} holds no rows")
    return rows


def row_format(row: Any) -> str | None:
    """"openai", "sharegpt", "alpaca", "preference" or None, from the keys of one row."""
    if not isinstance(row, dict):
        return None
    if "chosen" in row and "rejected" in row and ("prompt" in row or "messages" in row):
        return "preference"
    if "messages" in row:
        return "openai"
    if "conversations" in row:
        return "sharegpt"
    if "instruction" in row and "output" in row:
        return "alpaca"
    return None


def file_kind(path: str | Path) -> str | None:
    """The format of a JSONL file's first row (see :func:`row_format`); None when it is not chat data."""
    with open(path, encoding="utf-8-sig") as f:  # the first row only: a corpus file may be large
        for line in f:
            if line.strip():
                try:
                    return row_format(json.loads(line))
                except json.JSONDecodeError:
                    return None
    return None


def _text(value: Any, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: {what} must be a string, got {type(value).__name__}")
    return value


def _messages(items: Any, where: str, role_key: str, text_key: str, roles: dict[str, str],
              tools: bool = False) -> list[Message]:
    """The messages of a row, roles renamed by ``roles``; with ``tools`` (OpenAI rows) an assistant's
    ``tool_calls`` (its content may then be null) and a tool result's ``tool_call_id`` too."""
    if not isinstance(items, list):
        raise DataError(f"{where}: expected a list of messages, got {type(items).__name__}")
    out = []
    for i, item in enumerate(items):
        calls = item.get("tool_calls") if tools and isinstance(item, dict) else None
        if not isinstance(item, dict) or role_key not in item or (text_key not in item and not calls):
            raise DataError(f"{where}: message {i} must be an object with {role_key!r} and {text_key!r}")
        role = item[role_key]
        if role not in roles:
            raise DataError(f"{where}: message {i} has {role_key} {role!r}; known: {', '.join(roles)}")
        content = item.get(text_key)
        text = "" if content is None and calls else _text(content, where, f"message {i} {text_key!r}")
        message: Message = {"role": roles[role], "content": text}
        if calls:
            if role != "assistant":
                raise DataError(f"{where}: message {i}: only assistant messages have 'tool_calls'")
            message["tool_calls"] = _tool_calls(calls, where, i)
        if tools and role == "tool" and item.get("tool_call_id") is not None:
            message["tool_call_id"] = str(item["tool_call_id"])
        out.append(message)
    return out


def _tool_calls(calls: Any, where: str, i: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, arguments as objects."""
    if not isinstance(calls, list) or not calls:
        raise DataError(f"{where}: message {i} 'tool_calls' must be a non-empty list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise DataError(f"{where}: message {i} tool call {j} must be {{\"function\": {{\"name\", \"arguments\"}}}}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise DataError(f"{where}: message {i} tool call {j} arguments are not JSON text") from None
        if not isinstance(args, dict):
            raise DataError(f"{where}: message {i} tool call {j} arguments must be a JSON object")
        out.append({"id": str(call.get("id") or f"call_{i}_{j}"), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def parse_conversation(row: dict[str, Any], fmt: str, where: str) -> list[Message]:
    """The messages of a row of format ``fmt`` (malformed content is a DataError naming ``where``)."""
    if fmt == "openai":
        return _messages(row["messages"], where, "role", "content", {r: r for r in OPENAI_ROLES}, tools=True)
    if fmt == "sharegpt":
        return _messages(row["conversations"], where, "from", "value", SHAREGPT_ROLES)
    instruction = _text(row["instruction"], where, "'instruction'")
    extra = _text(row.get("input") or "", where, "'input'")
    messages = [{"role": "system", "content": _text(row["system"], where, "'system'")}] if row.get("system") else []
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return [*messages, {"role": "user", "content": user},
            {"role": "assistant", "content": _text(row["output"], where, "'output'")}]


def _unusable(messages: list[Message]) -> str | None:
    """Why a well-formed conversation cannot be trained on, or None."""
    if not messages or not any(m["content"].strip() for m in messages):
        return "empty conversation"
    if not any(m["role"] == "assistant" and (m["content"].strip() or m.get("tool_calls")) for m in messages):
        return "no assistant turn"
    return None


def _format_error(path: Path, lineno: int, row: Any, expected: str | None) -> DataError:
    keys = sorted(row) if isinstance(row, dict) else type(row).__name__
    want = ("one of: OpenAI {\"messages\": [...]}, ShareGPT {\"conversations\": [...]}, Alpaca "
            "{\"instruction\", \"input\", \"output\"}, or a preference {\"prompt\"|\"messages\", \"chosen\", "
            "\"rejected\"}") if expected is None else f"{expected} like the file's first row"
    return DataError(f"{path}:{lineno}: row fits no chat format (keys {keys}); expected {want}")


def read_chat_file(path: str | Path) -> ChatFile:
    """The conversations of a JSONL chat file (OpenAI, ShareGPT or Alpaca rows, detected from the first row)."""
    p = Path(path)
    rows = read_jsonl_rows(p)
    fmt = row_format(rows[0][1])
    if fmt == "preference":
        raise DataError(f"{p} holds preference pairs (chosen/rejected); it is data for --objective dpo, not sft")
    if fmt is None:
        raise _format_error(p, rows[0][0], rows[0][1], None)
    out = ChatFile(fmt, [])
    for lineno, row in rows:
        if row_format(row) != fmt:
            raise _format_error(p, lineno, row, fmt)
        where = f"{p}:{lineno}"
        messages = parse_conversation(row, fmt, where)
        why = _unusable(messages)
        if why is not None:
            out.skipped[why] += 1
            continue
        tools = row.get("tools") if fmt == "openai" else None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise DataError(f"{where}: 'tools' must be a list of objects")
        out.conversations.append(Conversation(messages, where, tools or None))
    return out


def read_preference_file(path: str | Path) -> PreferenceFile:
    """The pairs of a JSONL preference file; pairs whose two replies are equal are skipped and counted."""
    p = Path(path)
    rows = read_jsonl_rows(p)
    out = PreferenceFile([])
    for lineno, row in rows:
        where = f"{p}:{lineno}"
        if row_format(row) != "preference":
            if row_format(row) is not None:
                raise DataError(f"{where}: a {row_format(row)} conversation, not a preference pair; --objective "
                                "dpo needs rows {\"prompt\"|\"messages\", \"chosen\", \"rejected\"}")
            raise _format_error(p, lineno, row, "a preference pair {\"prompt\"|\"messages\", \"chosen\", \"rejected\"}")
        if "messages" in row:
            prompt = _messages(row["messages"], where, "role", "content", {r: r for r in ROLES})
        else:
            prompt = [{"role": "user", "content": _text(row["prompt"], where, "'prompt'")}]
        chosen = _text(row["chosen"], where, "'chosen'")
        rejected = _text(row["rejected"], where, "'rejected'")
        if not prompt or prompt[-1]["role"] != "user":
            out.skipped["prompt does not end with a user turn"] += 1
        elif not chosen.strip() or not rejected.strip():
            out.skipped["empty reply"] += 1
        elif chosen == rejected:
            out.skipped["chosen == rejected"] += 1
        else:
            out.pairs.append(PreferencePair(prompt, chosen, rejected, where))
    return out


def describe_skipped(skipped: Counter) -> str:
    """"3 skipped (2 no assistant turn, 1 empty conversation)", or "" when none were."""
    if not skipped:
        return ""
    parts = ", ".join(f"{n} {why}" for why, n in skipped.most_common())
    return f"{sum(skipped.values())} skipped ({parts})"
