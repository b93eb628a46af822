"""The chat template: one object, built once from a tokenizer, that every chat path renders with.

:class:`ChatTemplate` is what ``chat``, ``generate --chat``, ``serve``'s chat completions, ``eval`` on chat
data and the SFT/DPO objectives share, so a model is trained on exactly the text it is later prompted
with. It holds one of three formats:

* the tokenizer's Jinja template (``tokenizer_config.json``, a GGUF's ``tokenizer.chat_template``),
  compiled once and rendered as Hugging Face ``apply_chat_template(tokenize=False)`` does: a sandboxed
  environment with ``trim_blocks``/``lstrip_blocks`` and the loop-control extension, the variables
  ``messages``, ``tools``, ``add_generation_prompt`` and the special tokens (``bos_token``, ``eos_token``,
  ``pad_token``), and the helpers ``raise_exception``, ``strftime_now`` and ``tojson``;
* ChatML, the template a run trained here gets when post-training starts (:func:`with_chatml`)::

      <|im_start|>system\\n{content}<|im_end|>\\n            (when there is a system message)
      <|im_start|>user\\n{content}<|im_end|>\\n
      <|im_start|>assistant\\n{content}<|im_end|>\\n
      <|im_start|>assistant\\n                                (the generation prompt)

  with ``<|im_start|>`` and ``<|im_end|>`` added as special tokens (ids vocab_size and vocab_size + 1).
  With ``tools`` a system turn lists them (one JSON object per line inside ``<tools>...</tools>``, after the
  system message's own text); an assistant turn's ``tool_calls`` follow its text as
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks (one per call, on their own
  lines), and a ``tool`` message is ``<|im_start|>tool\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>``.
  A conversation without tools renders exactly as before (SFT data can teach tool calls in this format);
  a Jinja template that never reads ``tools`` gets the same text through :func:`tools_as_text`;
* without a template, plain turns a base model can continue (``System: ...`` / ``User: ...`` lines, then
  ``Assistant:``), whose reply ends where the model starts the next ``User:`` line.

A reply ends at the format's stops: the end-of-turn tokens the vocabulary has (``<|im_end|>``,
``<|eot_id|>``, ``<end_of_turn>``, ``<|end|>``) for a template, the string ``"\\nUser:"`` for plain turns;
EOS ends every reply anyway (the generator stops there).

**The assistant-token mask** (SFT and DPO train on it) covers each assistant reply and the end-of-turn
token after it (the model must learn to stop), nothing else. It is found from the template alone, for
any template that renders a conversation's prefixes as prefixes of its rendering (ChatML, Llama 3,
Gemma, ... do): for an assistant message i, its span in the text is

    [len(render(messages[:i], add_generation_prompt=True)),  len(render(messages[:i+1]).rstrip()))

i.e. the reply, its end-of-turn token, without the whitespace the template puts before the next turn.
The text is encoded piece by piece (spans and the text between them), so each token lies wholly inside
or outside a span. A byte-level BPE cuts pieces at the same places as the whole text here: every span
starts after a newline or a special token and ends with a special token (or the end of the text).

**Render limits.** A template is code from whoever published the model, and a sandbox keeps it from the
machine but not from looping or allocating without end. Rendering therefore has a *time limit*
(``timeout_s``, default 5 s; ``--template-timeout`` on ``chat``, ``generate`` and ``serve``) and a *size
limit* (``max_chars``, default 1,000,000 characters): the output, and any one string, list or number
the template builds (about ``max_chars`` decimal digits), may not exceed it, and all the text it builds
along the way (operators, filters, calls, macros, ``{% set %}`` blocks) may total at most
``BUILD_FACTOR`` (16) x ``max_chars``. The checks are cooperative, in the rendering thread: the time is
checked at every loop step, call, filter, operator but ``+``, and output chunk (the clock read at every
``CLOCK_EVERY``-th check); sizes are checked before the operations that can blow up in one step (``**``,
``*``, ``+``, ``~``, ``%``, ``str.replace``/``join``, width arguments, ``tojson``'s indent), since one
such step runs in C and no check interrupts it. Either limit stops the render with a
:class:`TemplateLimitError` that names it. The checks cost an ordinary render a few microseconds per
``+``, loop step, call and filter (each goes through a hook); ``benchmarks/bench_chat_template.py``
measures it against the plain sandbox.
"""

from __future__ import annotations

import contextvars
import json
import math
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tinyformer.errors import ConfigError, DataError, GenerationError, TemplateLimitError

if TYPE_CHECKING:
    from tinyformer.data.tokenizer import Tokenizer

__all__ = ["CHATML_TEMPLATE", "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "ChatTemplate", "format_tool_call",
           "parse_tool_calls", "render_plain", "tools_as_text", "with_chatml"]

CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
# The tool list of a system turn (ChatML's and tools_as_text's wording), one JSON object per line between them.
TOOLS_HEAD = "# Tools\n\nYou may call one or more functions. Their signatures, one JSON object per line:\n<tools>\n"
TOOLS_TAIL = ("</tools>\n\nTo call a function, answer with one block per call:\n<tool_call>\n"
              '{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>')
CHATML_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '" + TOOLS_HEAD + "' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '" + TOOLS_TAIL + "<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>tool\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% if loop.first and message['content'] %}{{ '\n' }}{% endif %}{% if not loop.first %}{{ '\n' }}{% endif %}"
    "{% set args = call['function']['arguments'] %}"
    "{{ '<tool_call>\n{\"name\": ' + call['function']['name'] | tojson + ', \"arguments\": ' "
    "+ (args if args is string else args | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
#: The tool-call format of the ChatML template and of every reply the server parses (Qwen 2.5's and
#: Hermes'): one block per call, the JSON written with ", " and ": " separators, name first.
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
PLAIN_STOP = ("\nUser:",)
# Tokens that end an assistant turn in common templates (ChatML, Llama 3, Gemma, Phi-3).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_CHARS = 1_000_000
BUILD_FACTOR = 16  # all text built while rendering: at most this many times max_chars

Messages = Sequence[dict[str, Any]]


def format_tool_call(name: str, arguments: Any) -> str:
    """One call in the tool-call format: ``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>``;
    ``arguments`` a dict or its JSON text."""
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    return TOOL_CALL_OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + TOOL_CALL_CLOSE


def parse_tool_calls(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(the text before the first call, stripped; [(name, arguments as JSON text)] of every complete
    ``<tool_call>`` block). A block whose JSON does not parse, or has no string ``name``, is left in the
    text (it is no call)."""
    start = text.find(TOOL_CALL_OPEN.rstrip("\n"))
    if start < 0:
        return text, []
    calls: list[tuple[str, str]] = []
    rest = text[start:]
    for m in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", rest, flags=re.S):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        calls.append((obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False)))
    if not calls:
        return text, []
    return text[:start].strip(), calls


def tools_as_text(messages: Messages, tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``messages`` for a template that knows no tools: the tool list joins the system message (the ChatML
    template's wording), an assistant's ``tool_calls`` its content as ``<tool_call>`` blocks, and a ``tool``
    message becomes a user turn holding ``<tool_response>...</tool_response>``."""
    out: list[dict[str, Any]] = []
    if tools:
        listing = TOOLS_HEAD + "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tools) + TOOLS_TAIL
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + listing})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": listing})
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": "<tool_response>\n" + (m.get("content") or "")
                        + "\n</tool_response>"})
        elif m.get("tool_calls"):
            blocks = [format_tool_call(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
            out.append({"role": m["role"], "content": text})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": m.get("content") or ""})
    return out


def render_plain(messages: Messages, add_generation_prompt: bool = True) -> str:
    """``Role: content`` lines, then ``Assistant:`` to be continued."""
    lines = [f"{PLAIN_ROLES.get(m['role'], m['role'].capitalize())}: {m['content']}" for m in messages]
    if add_generation_prompt:
        lines.append("Assistant:")
    return "\n".join(lines)


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


class ChatTemplate:
    """A tokenizer's chat format, built once: ``render`` a conversation, its ``stop_token_ids`` and
    ``stop_strings``, and ``encode_conversation`` (token ids and assistant-token mask) for training.

    ``tokenizer`` needs ``chat_template`` (Jinja source or None for plain turns), the special token
    strings ``bos_token``/``eos_token``/``pad_token``, ``token_to_id`` and ``encode``. ``timeout_s`` and
    ``max_chars`` are the render limits of the module docstring.

    Raises :class:`GenerationError` for a template that does not compile (here, so a broken template is
    reported before the first turn) and for a conversation the template rejects (at render time), and
    :class:`TemplateLimitError` (a GenerationError) when a render hits a limit.
    """

    def __init__(self, tokenizer: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_chars: int = DEFAULT_MAX_CHARS) -> None:
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ConfigError(f"the chat template's time limit must be a positive number of seconds, "
                              f"got {timeout_s!r}")
        if not (isinstance(max_chars, int) and max_chars >= 1):
            raise ConfigError(f"the chat template's size limit must be a positive number of characters, "
                              f"got {max_chars!r}")
        self.tokenizer = tokenizer
        self.source: str | None = getattr(tokenizer, "chat_template", None)
        self.is_plain = self.source is None
        self.timeout_s, self.max_chars = float(timeout_s), max_chars
        self._tokens = {name: getattr(tokenizer, name, None) or "" for name in ("bos_token", "eos_token",
                                                                                "pad_token")}
        # the limited sandbox of _sandbox_class and the compiled template (jinja2 is imported only for templates)
        self._env, self._compiled = (None, None) if self.source is None else _compile(self.source, max_chars)
        # whether the template itself renders tools, tool calls and tool results (HF templates that take tools=)
        self.reads_tools = self.source is not None and "tool" in self.source
        self.stop_strings: tuple[str, ...] = PLAIN_STOP if self.is_plain else ()
        ids = () if self.is_plain else (tokenizer.token_to_id(t) for t in END_OF_TURN_TOKENS)
        self.stop_token_ids: tuple[int, ...] = tuple(i for i in ids if i is not None)

    def render(self, messages: Messages, add_generation_prompt: bool = True,
               tools: Sequence[dict[str, Any]] | None = None) -> str:
        """The conversation as one prompt string; ``add_generation_prompt`` appends what opens the
        assistant's reply; ``tools`` (JSON schemas) is passed to the template as ``apply_chat_template``
        passes it. With ``tools``, a template that never reads them (and plain turns) gets the tools, tool calls
        and tool results as text (:func:`tools_as_text`), so a model always sees what it may call and got."""
        if tools and not self.reads_tools:
            messages, tools = tools_as_text(messages, tools), None
        if self._compiled is None:
            return render_plain(messages, add_generation_prompt)
        variables = {"messages": list(messages), "tools": None if tools is None else list(tools),
                     "add_generation_prompt": add_generation_prompt, **self._tokens}
        try:
            return self._env.render_limited(self._compiled, variables, self.timeout_s)
        except GenerationError:
            raise
        except MemoryError:
            raise TemplateLimitError("the chat template ran out of memory while rendering") from None
        except Exception as exc:  # undefined names, type errors: the template does not fit these messages
            raise GenerationError(f"the chat template failed on this conversation: {exc}") from None

    # ------------------------------------------------------------------ training data
    def encode_conversation(self, messages: Messages, tools: Sequence[dict[str, Any]] | None = None
                            ) -> tuple[list[int], list[int]]:
        """(token ids, mask) of a conversation (with the ``tools`` it may call): mask[t] = 1 when token t
        belongs to an assistant reply (its tool calls and end-of-turn token included; each reply's span found
        as the module docstring says), else 0. Template errors are :class:`DataError`."""
        try:
            text = self.render(messages, False, tools)
            spans = []
            for i, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                before = self.render(messages[:i], True, tools)
                upto = self.render(messages[: i + 1], False, tools)
                if not (text.startswith(before) and text.startswith(upto) and upto.startswith(before)):
                    raise DataError("the chat template does not render a conversation's beginning as the beginning "
                                    "of its rendering, so assistant replies cannot be located for the loss mask")
                spans.append((len(before), len(upto.rstrip())))
        except GenerationError as exc:
            raise DataError(str(exc)) from None
        ids: list[int] = []
        mask: list[int] = []
        pos = 0
        for start, end in [*spans, (len(text), len(text))]:
            for piece, flag in ((text[pos:start], 0), (text[start:end], 1)):
                if piece:
                    piece_ids = self.tokenizer.encode(piece)
                    ids += piece_ids
                    mask += [flag] * len(piece_ids)
            pos = end
        return ids, mask

    def encode_prompt(self, messages: Messages) -> list[int]:
        """Token ids of ``messages`` followed by the generation prompt (what a reply continues)."""
        try:
            return self.tokenizer.encode(self.render(messages, True))
        except GenerationError as exc:
            raise DataError(str(exc)) from None


# ---------------------------------------------------------------------- the limited sandbox
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\d*)(?:\.(\d*))?[hlL]?[diouxXeEfFgGcrsa]")  # width, precision
_DIGITS = re.compile(r"\d+")  # the numbers in a str.format field's spec: width, precision
# A number with max_chars decimal digits has about max_chars * log2(10) bits.
_BITS_PER_DIGIT = math.log2(10)
_SEQUENCE_TYPES = (str, list, tuple)
_SEQUENCES = frozenset(_SEQUENCE_TYPES)  # a set lookup of the exact type first: the hot path of "+"
CLOCK_EVERY = 32  # checks between two readings of the clock (a reading can be a system call on a VM)


class _RenderState:
    """A render in progress: its deadline and time limit, the characters of text built so far, the checks
    since the clock was last read (the first check reads it)."""

    __slots__ = ("deadline", "timeout_s", "built", "ticks")

    def __init__(self, deadline: float, timeout_s: float) -> None:
        self.deadline, self.timeout_s, self.built, self.ticks = deadline, timeout_s, 0, CLOCK_EVERY - 1


# The render in progress in this thread, None outside one (e.g. when Jinja folds constants at compile
# time: nothing is counted then). A context variable is per thread, so one compiled template renders in
# several threads at once (serve's pool), and it is cheaper to read than a threading.local.
_RENDER: contextvars.ContextVar[_RenderState | None] = contextvars.ContextVar("tinyformer_chat_render",
                                                                              default=None)


def _sandbox_class() -> type:
    """The sandbox with the render limits: jinja2's ``ImmutableSandboxedEnvironment`` (no attribute of a
    ``_`` name, no mutation of lists or dicts, ranges of at most 100,000 items) plus hooks that read the
    clock and check sizes. The deadline and the text built so far are per thread, so one compiled
    template can render in several threads at once (serve)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class LimitedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def __init__(self, max_chars: int, **options: Any) -> None:
            super().__init__(**options)
            self.max_chars = max_chars

        # -------------------------------------------------------------- budget
        def tick(self) -> None:
            """Stop the render once past its deadline; the clock is read every CLOCK_EVERY checks."""
            state = _RENDER.get()
            if state is None:
                return
            state.ticks += 1
            if state.ticks % CLOCK_EVERY == 0 and time.monotonic() > state.deadline:
                raise TemplateLimitError(f"the chat template ran past its time limit of {state.timeout_s:g} s "
                                         "(rendering stopped)")

        def built(self, size: int) -> None:
            """Count ``size`` characters of text built; stop past the build budget."""
            state = _RENDER.get()
            if state is None:
                return
            state.built += size
            if state.built > BUILD_FACTOR * self.max_chars:
                raise TemplateLimitError(f"the chat template built more than {BUILD_FACTOR * self.max_chars:,} "
                                         f"characters of text while rendering (its size limit is "
                                         f"{self.max_chars:,} characters)")

        def counted(self, result: Any) -> Any:
            """``result``, counted as text built when it is a string."""
            if isinstance(result, str):
                self.built(len(result))
            return result

        def too_big(self, what: str, size: float) -> None:
            if size > self.max_chars:
                raise TemplateLimitError(f"the chat template would make {what} of about {size:,.0f} characters, "
                                         f"over its size limit of {self.max_chars:,} characters")

        def check_int_args(self, args: Iterable[Any]) -> None:
            """Widths, counts and indents over the size limit would allocate that much in one step."""
            for arg in args:
                if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > self.max_chars:
                    raise TemplateLimitError(f"the chat template passes {arg:,} as a width or count, over its "
                                             f"size limit of {self.max_chars:,} characters")

        def check_format(self, fmt: str, style: str) -> None:
            """The widths and precisions of a ``%`` (printf) or ``{}`` (str.format) format string: a field
            padded to a width over the size limit is that many characters in one step."""
            import string

            if style == "%":
                numbers = [n for field in _PERCENT_FIELD.finditer(fmt) for n in field.groups() if n]
            else:
                try:
                    numbers = [n for _, _, spec, _ in string.Formatter().parse(fmt) if spec
                               for n in _DIGITS.findall(spec)]
                except ValueError:  # not a format string: the call itself will say so
                    return
            for n in numbers:
                if len(n) > len(str(self.max_chars)) or int(n) > self.max_chars:
                    self.too_big("a formatted field", float(n) if len(n) < 300 else math.inf)

        def predict(self, func: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
            """Sizes of the str methods that can multiply their input in one step, checked before the call
            (the arguments come back, an iterable given to join as a list)."""
            func = getattr(func, "__wrapped__", func)  # the sandbox hands out str.format wrapped
            owner = getattr(func, "__self__", None)
            name = getattr(func, "__name__", "")
            if isinstance(owner, str) and name == "replace" and len(args) >= 2 and \
                    isinstance(args[0], str) and isinstance(args[1], str):
                count = owner.count(args[0]) if args[0] else len(owner) + 1
                self.too_big("a string", len(owner) + count * (len(args[1]) - len(args[0])))
            elif isinstance(owner, str) and name == "join" and args:
                items = list(args[0])
                self.too_big("a string", len(owner) * max(len(items) - 1, 0) +
                             sum(len(i) for i in items if isinstance(i, str)))
                args = (items, *args[1:])
            elif isinstance(owner, str) and name in ("format", "format_map"):
                self.check_format(owner, "{}")
            return args

        # -------------------------------------------------------------- jinja2 hooks
        def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:  # every call a template makes
            self.tick()
            if getattr(obj, "__self__", None) is not self:  # not this sandbox's own checked_iter / checked_join
                self.check_int_args((*args, *kwargs.values()))
                args = self.predict(obj, args)
            return self.counted(super().call(context, obj, *args, **kwargs))

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "+":  # the common case first, kept short: string concatenation in every template
                if (type(left) in _SEQUENCES or isinstance(left, _SEQUENCE_TYPES)) and \
                        (type(right) in _SEQUENCES or isinstance(right, _SEQUENCE_TYPES)):  # (clock: loops, output)
                    size = len(left) + len(right)
                    if size > self.max_chars:
                        self.too_big("a string or list", size)
                    state = _RENDER.get()
                    if state is not None:
                        state.built += size
                        if state.built > BUILD_FACTOR * self.max_chars:
                            self.built(0)
                return left + right
            self.tick()
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                self.too_big("a number", right * math.log2(abs(left)) / _BITS_PER_DIGIT)
            elif operator == "*":
                if isinstance(left, int) and isinstance(right, int):
                    self.too_big("a number", (abs(left).bit_length() + abs(right).bit_length()) / _BITS_PER_DIGIT)
                elif isinstance(left, (str, list, tuple)) and isinstance(right, int):
                    self.too_big("a string or list", len(left) * right)
                elif isinstance(right, (str, list, tuple)) and isinstance(left, int):
                    self.too_big("a string or list", len(right) * left)
            elif operator == "%" and isinstance(left, str):
                self.check_format(left, "%")
                if "*" in left:  # a width given as an argument: '%*d' % (width, value)
                    self.check_int_args(right if isinstance(right, tuple) else (right,))
            return self.counted(super().call_binop(context, operator, left, right))

        def concat(self, pieces: Iterable[str], what: str = "a block of text") -> str:
            """The text of a macro, {% set %} or {% filter %} block (and, from checked_join, of ``~``)."""
            self.tick()
            pieces = list(pieces)
            size = sum(len(p) for p in pieces)
            self.too_big(what, size)
            self.built(size)
            return "".join(pieces)

        def checked_iter(self, iterable: Iterable[Any]) -> Iterator[Any]:  # every {% for %} iterates through this
            for item in iterable:
                self.tick()
                yield item

        def checked_join(self, *parts: Any) -> str:  # the ~ operator
            return self.concat([str(p) for p in parts], "a string")

        def guard_filter(self, name: str, func: Any) -> Any:
            """``func`` with the clock read and its width/count arguments checked before it runs."""
            import functools

            from jinja2.utils import _PassArg

            skip = 2 if _PassArg.from_obj(func) is not None else 1  # the context/environment, the value

            @functools.wraps(func)
            def guarded(*args: Any, **kwargs: Any) -> Any:
                self.tick()
                if len(args) > skip or kwargs:  # arguments besides the value (most filters get none)
                    self.check_int_args((*args[skip:], *kwargs.values()))
                    value, rest = args[skip - 1], args[skip:]
                    if name == "replace" and isinstance(value, str) and len(rest) >= 2:
                        self.predict(value.replace, (str(rest[0]), str(rest[1])))
                    elif name == "format" and isinstance(value, str):
                        self.check_format(value, "%")
                return self.counted(func(*args, **kwargs))

            return guarded

        # -------------------------------------------------------------- rendering
        def render_limited(self, template: Any, variables: dict[str, Any], timeout_s: float) -> str:
            """Render through ``template.generate`` with the limits on, checking the output per chunk."""
            token = _RENDER.set(_RenderState(time.monotonic() + timeout_s, timeout_s))
            try:
                pieces, size = [], 0
                for piece in template.generate(**variables):
                    size += len(piece)
                    if size > self.max_chars:
                        raise TemplateLimitError(f"the chat template's output passed its size limit of "
                                                 f"{self.max_chars:,} characters (rendering stopped)")
                    self.tick()
                    pieces.append(piece)
                return "".join(pieces)
            finally:
                _RENDER.reset(token)

    return LimitedSandbox


def _checked_loops(tree: Any) -> Any:
    """The template's syntax tree with every ``{% for %}`` iterating through ``checked_iter`` and every
    ``~`` through ``checked_join`` (environment attributes, which a template cannot rebind)."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    def hook(name: str, args: list[Any], lineno: int) -> Any:
        return nodes.Call(nodes.EnvironmentAttribute(name), args, [], None, None, lineno=lineno)

    class Checked(NodeTransformer):
        def visit_For(self, node: Any) -> Any:
            node = self.generic_visit(node)
            node.iter = hook("checked_iter", [node.iter], node.lineno)
            return node

        def visit_Concat(self, node: Any) -> Any:
            node = self.generic_visit(node)
            return hook("checked_join", list(node.nodes), node.lineno)

    return Checked().visit(tree)


def _compile(source: str, max_chars: int) -> tuple[Any, Any]:
    """(the limited sandbox, the compiled template) of a Jinja chat template's source."""
    try:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
    except ImportError:
        raise GenerationError("the tokenizer has a chat template, which needs jinja2: pip install jinja2") from None

    env = _sandbox_class()(max_chars, trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

    def raise_exception(message: str) -> None:
        raise GenerationError(f"the chat template rejected the conversation: {message}")

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                   sort_keys=sort_keys)
        pieces, size, limit = [], 0, env.max_chars
        for piece in encoder.iterencode(value):  # chunk by chunk, so a huge indent or value stops early
            size += len(piece)
            if size > limit:
                env.too_big("a JSON text", size)
            pieces.append(piece)
        return "".join(pieces)

    def strftime_now(fmt: str) -> str:
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env.filters["tojson"] = tojson
    env.filters = {name: env.guard_filter(name, func) for name, func in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        code = env.compile(_checked_loops(env.parse(source)))
        return env, env.template_class.from_code(env, code, env.make_globals(None), None)
    except TemplateError as exc:
        raise GenerationError(f"the tokenizer's chat template does not compile: {exc}") from None
