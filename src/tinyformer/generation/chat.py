"""Multi-turn chat on top of the :class:`~tinyformer.generation.engine.Generator`.

A conversation is a list of messages ``{"role": "system" | "user" | "assistant", "content": str}``.
Each turn renders the whole conversation into one prompt, so the model sees everything said so far:

* with the tokenizer's chat template (Jinja, from ``tokenizer_config.json``), rendered as Hugging
  Face ``apply_chat_template`` does: a sandboxed environment with ``trim_blocks``/``lstrip_blocks``
  and the loop-control extension, the variables ``messages``, ``add_generation_prompt`` and the
  special tokens (``bos_token``, ``eos_token``, ``pad_token``), and the helpers ``raise_exception``,
  ``strftime_now`` and ``tojson``. The reply ends at EOS or a known end-of-turn token;
* without one, as plain turns a base model can continue::

      System: You are terse.
      User: Hello
      Assistant: Hi.
      User: How are you?
      Assistant:

  and the reply ends where the model starts the next ``User:`` line.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from typing import Any

from tinyformer.errors import GenerationError
from tinyformer.generation.engine import Generator
from tinyformer.generation.sampling import SamplingParams

__all__ = ["ChatSession", "render_plain", "render_template"]

PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
PLAIN_STOP = ("\nUser:",)
# Tokens that end an assistant turn in common templates (ChatML, Llama 3, Gemma, Phi-3).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")
DEFAULT_MAX_NEW_TOKENS = 256


def render_plain(messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """``Role: content`` lines, then ``Assistant:`` to be continued."""
    lines = [f"{PLAIN_ROLES.get(m['role'], m['role'].capitalize())}: {m['content']}" for m in messages]
    if add_generation_prompt:
        lines.append("Assistant:")
    return "\n".join(lines)


def _compile_template(source: str) -> Any:
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise GenerationError(f"the chat template rejected the conversation: {message}")

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise GenerationError(f"the tokenizer's chat template does not compile: {exc}") from None


def render_template(source: str, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True,
                    **special_tokens: str | None) -> str:
    """Render a Jinja chat template like ``transformers``' ``apply_chat_template(tokenize=False)``."""
    template = _compile_template(source)
    try:
        return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                               **{k: v or "" for k, v in special_tokens.items()})
    except GenerationError:
        raise
    except Exception as exc:  # undefined names, type errors: the template does not fit these messages
        raise GenerationError(f"the chat template failed on this conversation: {exc}") from None


class ChatSession:
    """A conversation with one model: ``send(text)`` streams the assistant's reply and, once the stream
    is consumed, adds both turns to the history; ``reset()`` forgets everything but the system prompt."""

    def __init__(self, generator: Generator, system: str | None = None) -> None:
        if generator.tokenizer is None:
            raise GenerationError("chat needs a tokenizer")
        self.generator = generator
        self.tokenizer = generator.tokenizer
        self.template: str | None = getattr(self.tokenizer, "chat_template", None)
        if self.template is not None:
            _compile_template(self.template)  # a broken template is reported before the first turn
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        if self.template is None:
            return render_plain(messages)
        tok = self.tokenizer
        return render_template(self.template, messages, True, bos_token=tok.bos_token, eos_token=tok.eos_token,
                               pad_token=tok.pad_token)

    def stop_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` plus the stops that end an assistant turn in this format."""
        if self.template is None:
            return dataclasses.replace(params, stop_strings=tuple(params.stop_strings) + PLAIN_STOP)
        ids = [self.tokenizer.token_to_id(t) for t in END_OF_TURN_TOKENS]
        return dataclasses.replace(params, stop_token_ids=tuple(params.stop_token_ids) +
                                   tuple(i for i in ids if i is not None))

    def send(self, text: str, params: SamplingParams, max_new_tokens: int | None = None) -> Iterator[str]:
        """Stream the reply to ``text``. Errors (the conversation no longer fits the context, a character
        the tokenizer lacks) are raised here, before anything is generated, and leave the history as it
        was. ``max_new_tokens`` None means 256, capped to the room left in the context (policy error)."""
        gen = self.generator
        messages = [*self.messages, {"role": "user", "content": text}]
        ids = gen.encode(self.render(messages))
        if max_new_tokens is None:
            room = gen.max_seq_len - len(ids)
            max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, room) if gen.context_policy == "error" and room > 0 \
                else DEFAULT_MAX_NEW_TOKENS
        params = self.stop_params(dataclasses.replace(params, max_new_tokens=max_new_tokens)).validate()
        stream = gen.stream(ids, params, logprobs=False)

        def pieces() -> Iterator[str]:
            yield from stream
            self.messages = [*messages, {"role": "assistant", "content": stream.result.text.strip()}]

        return pieces()
