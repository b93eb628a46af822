"""Chat templates for training: ChatML for models trained here, and conversations -> (token ids, loss mask).

Rendering is :func:`tinyformer.generation.chat.render_template` (what ``chat`` and ``serve`` use),
so a model is trained on exactly the text it is later prompted with. A tokenizer without a template
(a run pre-trained here) gets ChatML when post-training starts (:func:`with_chatml`)::

    <|im_start|>system\\n{content}<|im_end|>\\n            (when there is a system message)
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n                                (the generation prompt)

with ``<|im_start|>`` and ``<|im_end|>`` added as special tokens (ids vocab_size and vocab_size + 1).

The loss mask covers each assistant reply and the end-of-turn token after it (the model must learn
to stop), nothing else. It is found from the template alone, for any template that renders a
conversation's prefixes as prefixes of its rendering (ChatML, Llama 3, Gemma, ... do): for an
assistant message i, its span in the text is

    [len(render(messages[:i], add_generation_prompt=True)),  len(render(messages[:i+1]).rstrip()))

i.e. the reply, its end-of-turn token, without the whitespace the template puts before the next turn.
The text is encoded piece by piece (spans and the text between them), so each token lies wholly inside
or outside a span. A byte-level BPE cuts pieces at the same places as the whole text here: every span
starts after a newline or a special token and ends with a special token (or the end of the text).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tinyformer.errors import DataError, GenerationError

if TYPE_CHECKING:
    from tinyformer.data.tokenizer import Tokenizer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHATML_TOKENS = (IM_START, IM_END)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

Messages = Sequence[dict[str, str]]


def with_chatml(tokenizer: Tokenizer) -> Tokenizer:
    """``tokenizer`` itself when it has a chat template; else a copy with the ChatML special tokens
    appended (every existing id unchanged) and ChatML as its template."""
    import tokenizers

    from tinyformer.data.tokenizer import Tokenizer

    if tokenizer.chat_template is not None:
        return tokenizer
    backend = tokenizers.Tokenizer.from_str(tokenizer.to_json())
    backend.add_special_tokens([t for t in CHATML_TOKENS if tokenizer.token_to_id(t) is None])
    return Tokenizer(backend, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
                     pad_token=tokenizer.pad_token, chat_template=CHATML_TEMPLATE)


def renderer(tokenizer: Tokenizer) -> Callable[[Messages, bool], str]:
    """``render(messages, add_generation_prompt) -> str`` with the tokenizer's template (compiled once),
    or the plain ``User: ...`` format of :func:`~tinyformer.generation.chat.render_plain` without one."""
    from tinyformer.serve.chat import ChatTemplate

    template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token)
    return template.render


def assistant_spans(render: Callable[[Messages, bool], str], messages: Messages) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, character spans of its assistant replies), see the module docstring."""
    full = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:i], True)
        upto = render(messages[: i + 1], False)
        if not (full.startswith(before) and full.startswith(upto) and upto.startswith(before)):
            raise DataError("the chat template does not render a conversation's beginning as the beginning of "
                            "its rendering, so assistant replies cannot be located for the loss mask")
        spans.append((len(before), len(upto.rstrip())))
    return full, spans


def encode_conversation(tokenizer: Tokenizer, messages: Messages,
                        render: Callable[[Messages, bool], str] | None = None) -> tuple[list[int], list[int]]:
    """(token ids, mask) of a conversation: mask[t] = 1 when token t belongs to an assistant reply
    (its end-of-turn token included), else 0."""
    render = render or renderer(tokenizer)
    try:
        text, spans = assistant_spans(render, messages)
    except GenerationError as exc:
        raise DataError(str(exc)) from None
    ids: list[int] = []
    mask: list[int] = []
    pos = 0
    for start, end in [*spans, (len(text), len(text))]:
        for piece, flag in ((text[pos:start], 0), (text[start:end], 1)):
            if piece:
                piece_ids = tokenizer.encode(piece)
                ids += piece_ids
                mask += [flag] * len(piece_ids)
        pos = end
    return ids, mask


def encode_prompt(tokenizer: Tokenizer, messages: Messages,
                  render: Callable[[Messages, bool], str] | None = None) -> list[int]:
    """Token ids of ``messages`` followed by the template's generation prompt (what a reply continues)."""
    render = render or renderer(tokenizer)
    try:
        return tokenizer.encode(render(messages, True))
    except GenerationError as exc:
        raise DataError(str(exc)) from None


def encode_reply(tokenizer: Tokenizer, prompt: Messages, reply: str,
                 render: Callable[[Messages, bool], str] | None = None) -> tuple[list[int], list[int]]:
    """(token ids, mask) of ``prompt`` answered by the assistant ``reply``; mask = the reply's tokens."""
    return encode_conversation(tokenizer, [*prompt, {"role": "assistant", "content": reply}], render)


def stop_token_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids that end an assistant reply: the end-of-turn tokens the tokenizer has, and EOS."""
    from tinyformer.generation.chat import END_OF_TURN_TOKENS

    ids = [tokenizer.token_to_id(t) for t in END_OF_TURN_TOKENS] + [tokenizer.eos_id]
    return tuple(i for i in ids if i is not None)
