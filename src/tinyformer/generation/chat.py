"""Multi-turn chat on top of the :class:`~tinyformer.generation.generator.Generator`.

A conversation is a list of messages ``{"role": "system" | "user" | "assistant", "content": str}``.
Each turn renders the whole conversation into one prompt with the run's
:class:`~tinyformer.data.chat_template.ChatTemplate` (the tokenizer's Jinja template, or plain
``User:`` / ``Assistant:`` turns without one), so the model sees everything said so far, and the reply
ends at the template's stops (an end-of-turn token, the next ``User:`` line) or EOS.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from tinyformer.data.chat_template import ChatTemplate
from tinyformer.errors import GenerationError
from tinyformer.generation.generator import Generator
from tinyformer.generation.sampling import SamplingParams

__all__ = ["ChatSession"]

DEFAULT_MAX_NEW_TOKENS = 256


class ChatSession:
    """A conversation with one model: ``send(text)`` streams the assistant's reply and, once the stream
    is consumed, adds both turns to the history; ``reset()`` forgets everything but the system prompt.
    ``template`` defaults to the generator's tokenizer's, with the default render limits."""

    def __init__(self, generator: Generator, system: str | None = None, template: ChatTemplate | None = None) -> None:
        if generator.tokenizer is None:
            raise GenerationError("chat needs a tokenizer")
        self.generator = generator
        self.template = template or ChatTemplate(generator.tokenizer)  # a broken template fails here
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def stop_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` plus the stops that end an assistant turn in this format."""
        return dataclasses.replace(params, stop_strings=tuple(params.stop_strings) + self.template.stop_strings,
                                   stop_token_ids=tuple(params.stop_token_ids) + self.template.stop_token_ids)

    def send(self, text: str, params: SamplingParams, max_new_tokens: int | None = None) -> Iterator[str]:
        """Stream the reply to ``text``. Errors (the conversation no longer fits the context, a character
        the tokenizer lacks, a render limit) are raised here, before anything is generated, and leave the
        history as it was. ``max_new_tokens`` None means 256, capped to the room left in the context
        (policy error)."""
        gen = self.generator
        messages = [*self.messages, {"role": "user", "content": text}]
        ids = gen.encode(self.template.render(messages))
        if max_new_tokens is None:
            room = gen.max_seq_len - len(ids)
            max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, room) if gen.context_policy == "error" and room > 0 \
                else DEFAULT_MAX_NEW_TOKENS
        params = self.stop_params(dataclasses.replace(params, max_new_tokens=max_new_tokens))
        stream = gen.stream(ids, params, logprobs=False)

        def pieces() -> Iterator[str]:
            yield from stream
            self.messages = [*messages, {"role": "assistant", "content": stream.result.text.strip()}]

        return pieces()
