"""Chat messages -> one prompt string, rendered exactly as `tinyformer chat` does.

The rendering itself lives in :mod:`tinyformer.generation.chat` (the tokenizer's Jinja chat template,
rendered like Hugging Face ``apply_chat_template``, or plain ``User: ...`` / ``Assistant:`` turns when
the tokenizer has none). This wrapper compiles the template once at startup, so a broken template is
reported before the first request rather than on every one, and says which stops end a reply:
the next ``User:`` line for the plain format, end-of-turn tokens (``<|im_end|>``, ``<|eot_id|>``, ...)
for templates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tinyformer.errors import GenerationError
from tinyformer.generation.chat import END_OF_TURN_TOKENS, PLAIN_STOP, _compile_template, render_plain


class ChatTemplate:
    """``render(messages) -> str``. ``template`` None means the plain format (no Jinja needed).

    Raises :class:`GenerationError` for a template that does not compile (at construction) and for a
    conversation the template rejects (at render time).
    """

    def __init__(self, template: str | None, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None) -> None:
        self.source = template
        self.is_plain = template is None
        self._tokens = {"bos_token": bos_token or "", "eos_token": eos_token or "", "pad_token": pad_token or ""}
        self._compiled: Any = None
        if template is not None:
            try:
                self._compiled = _compile_template(template)
            except ImportError:
                raise GenerationError("the tokenizer has a chat template, which needs jinja2: pip install jinja2") \
                    from None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Stop strings that end an assistant reply in this format."""
        return PLAIN_STOP if self.is_plain else ()

    def stop_token_ids(self, token_to_id: Any) -> tuple[int, ...]:
        """Ids of the end-of-turn tokens this tokenizer has (templates only)."""
        if self.is_plain:
            return ()
        ids = (token_to_id(t) for t in END_OF_TURN_TOKENS)
        return tuple(i for i in ids if i is not None)

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self._compiled is None:
            return render_plain(messages, add_generation_prompt)
        try:
            return self._compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         **self._tokens)
        except GenerationError:
            raise
        except Exception as exc:  # jinja2 errors (undefined names, type errors) in a user-supplied template
            raise GenerationError(f"the chat template failed on these messages: {exc}") from None
