"""The one chat template object: the same text as Hugging Face ``apply_chat_template``, compiled once,
its stops, clear errors, the sandbox, and the render limits against hostile templates."""

from __future__ import annotations

import string

import pytest

from tinyformer.data.chat_template import CHATML_TEMPLATE, ChatTemplate, with_chatml
from tinyformer.data.tokenizer import Tokenizer, build_tokenizer
from tinyformer.errors import ConfigError, GenerationError, TemplateLimitError

pytest.importorskip("jinja2")

# ChatML with the whitespace control, loop variables and checks real templates use
CHATML = """{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if loop.first and message['role'] != 'system' %}{{ bos_token }}{% endif %}
    {{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>' + '\n' }}
{% endfor %}
{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""

MESSAGES = [
    {"role": "user", "content": "  Hello there!  "},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Two {braces} and a \"quote\"\nnew line"},
]


def tokenizer(template: str | None) -> Tokenizer:
    """A char tokenizer over printable ASCII (bos <|bos|>, eos <|eos|>, pad <|pad|>) with ``template``."""
    tok = build_tokenizer("char", string.printable)
    tok.chat_template = template
    return tok


def test_template_renders_like_transformers_apply_chat_template():
    transformers = pytest.importorskip("transformers")
    tok = tokenizer(CHATML)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend, bos_token="<|bos|>",
                                              eos_token="<|eos|>", chat_template=CHATML)
    ours = ChatTemplate(tok)
    for add in (True, False):
        expected = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add)
        assert ours.render(MESSAGES, add_generation_prompt=add) == expected
    assert ours.stop_strings == ()


def test_tools_reach_the_template_as_apply_chat_template_passes_them():
    transformers = pytest.importorskip("transformers")
    template = ("{% if tools is not none %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
                "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    tok = tokenizer(template)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend, chat_template=template)
    ours = ChatTemplate(tok)
    for given in (tools, None):  # without tools the template sees none, as in transformers
        assert ours.render(MESSAGES, False, tools=given) == hf.apply_chat_template(
            MESSAGES, tools=given, tokenize=False, add_generation_prompt=False)


def test_end_of_turn_stop_ids_are_the_chatml_tokens_appended_to_the_vocabulary():
    base = build_tokenizer("char", string.printable)
    tok = with_chatml(base)
    template = ChatTemplate(tok)
    # with_chatml appends <|im_start|>, <|im_end|>: ids vocab_size and vocab_size + 1 of the base
    assert template.stop_token_ids == (base.vocab_size + 1,) and template.stop_strings == ()
    assert template.source == CHATML_TEMPLATE


def test_without_a_template_turns_are_plain_lines_ending_at_the_next_user_line():
    plain = ChatTemplate(tokenizer(None))
    text = plain.render([{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}])
    assert text == "System: Be kind.\nUser: Hi\nAssistant:"
    assert plain.stop_strings == ("\nUser:",) and plain.stop_token_ids == ()


def test_the_template_is_compiled_once_not_at_every_render(monkeypatch):
    import jinja2

    template = ChatTemplate(tokenizer(CHATML))
    first = template.render(MESSAGES)

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(jinja2.Environment, "compile", no_compiling)
    monkeypatch.setattr(jinja2.Environment, "from_string", no_compiling)
    assert [template.render(MESSAGES) for _ in range(3)] == [first] * 3


def test_template_errors_are_generation_errors():
    with pytest.raises(GenerationError, match="does not compile"):
        ChatTemplate(tokenizer("{% for m in messages %}"))
    with pytest.raises(GenerationError, match="rejected.*unknown role tool"):
        ChatTemplate(tokenizer(CHATML)).render([{"role": "tool", "content": "x"}])
    with pytest.raises(GenerationError, match="failed on this conversation"):
        ChatTemplate(tokenizer("{{ messages[0]['content'] + 1 }}")).render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_a_time_limit_that_is_no_positive_number_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="time limit must be a positive number"):
        ChatTemplate(tokenizer(CHATML), timeout_s=bad)


# ---------------------------------------------------------------------- the sandbox
ESCAPES = {  # each reaches for Python objects (classes, globals, os) or mutates the caller's data
    "subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "int base": "{{ (1).__class__.__base__.__subclasses__() }}",
    "cycler globals": "{{ cycler.__init__.__globals__.os.system('touch CANARY') }}",
    "joiner globals": "{{ joiner.__init__.__globals__['os'].system('touch CANARY') }}",
    "namespace globals": "{{ namespace.__init__.__globals__ }}",
    "helper globals": "{{ raise_exception.__globals__ }}",
    "format attribute": "{{ '{0.__class__.__mro__}'.format('') }}",
    "attr filter": "{{ (messages | attr('__class__')).__subclasses__() }}",
    "mutation": "{{ messages.append({'role': 'user', 'content': 'x'}) }}{{ messages[0].update({'role': 'x'}) }}",
}


@pytest.mark.parametrize("source", ESCAPES.values(), ids=ESCAPES.keys())
def test_the_sandbox_blocks_template_escapes(source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    try:
        text = ChatTemplate(tokenizer(source)).render(messages)
    except GenerationError:
        text = ""
    assert "<" not in text  # no repr of a class, function or module leaked into the prompt
    assert not (tmp_path / "CANARY").exists()
    assert messages == [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------------- render limits
TIME_BOMBS = {
    "nested range loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested loops over strings": "{% for i in 'a' * 100000 %}{% for j in 'a' * 100000 %}{% endfor %}{% endfor %}",
}
SIZE_BOMBS = {
    "huge integer power": "{% set n = messages | length %}{{ (n + 8) ** 99999999 }}",
    "tojson with a huge indent": "{{ messages | tojson(indent=10**9) }}",
    "string repetition": "{{ 'a' * 10**10 }}",
    "list repetition": "{{ ([1] * 10**9) | length }}",
    "doubling with ~": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s | length }}",
    "doubling with +": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
                       "{% endfor %}{{ ns.s | length }}",
    "doubling safe text with +": "{% set ns = namespace(s='ab' | safe) %}{% for i in range(60) %}"
                                 "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
    "text built with + in a set block": "{% set big = 'a' * 900000 %}{% set s %}{% for i in range(100000) %}"
                                        "{{ big + '' }}{% endfor %}{% endset %}{{ s | length }}",
    "squaring a number": "{% set ns = namespace(x=3) %}{% for i in range(100) %}{% set ns.x = ns.x * ns.x %}"
                         "{% endfor %}{{ 1 }}",
    "a padding filter": "{{ 'a' | center(10**10) }}",
    "a padding method": "{{ 'a'.ljust(10**10) }}",
    "replace that multiplies": "{% set s = 'a' * 1000000 %}{{ s.replace('a', s) }}",
    "a wide format field": "{{ '%9999999999d' % 1 }}",
    "a width given to %": "{{ '%*d' % (10**10, 1) }}",
    "a wide str.format field": "{{ '{:>9999999999}'.format('x') }}",
    "a wide format filter field": "{{ '%-9999999999s' | format('x') }}",
    "text built in a set block": "{% set s %}{% for i in range(100000) %}{{ 'a' * 900000 }}{% endfor %}{% endset %}"
                                 "{{ s | length }}",
    "long output": "{% for i in range(100000) %}{{ 'a' * 100 }}{% endfor %}",
}


@pytest.mark.parametrize("source", TIME_BOMBS.values(), ids=TIME_BOMBS.keys())
def test_a_template_that_loops_for_ever_stops_at_the_time_limit(source):
    with pytest.raises(TemplateLimitError, match=r"ran past its time limit of 0\.2 s"):
        ChatTemplate(tokenizer(source), timeout_s=0.2).render(MESSAGES)


@pytest.mark.parametrize("source", SIZE_BOMBS.values(), ids=SIZE_BOMBS.keys())
def test_a_template_that_grows_without_bound_stops_at_the_size_limit(source):
    import tracemalloc

    template = ChatTemplate(tokenizer(source), timeout_s=60)  # the size checks must stop these, not the clock
    tracemalloc.start()
    try:
        with pytest.raises(TemplateLimitError, match="size limit of 1,000,000|size limit is 1,000,000"):
            template.render(MESSAGES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 * 2**20  # stopped before the gigabytes, not after


def test_long_numbers_in_text_that_is_formatted_are_no_widths():
    template = ("{{ 'order 123456789012: %s' % messages[0]['content'] }} {{ 'id 98765432101 {}'.format('x') }} "
                "{{ '%5.2f of 10000000000' | format(3.14159) }}")
    assert ChatTemplate(tokenizer(template)).render(MESSAGES) == \
        "order 123456789012:   Hello there!   id 98765432101 x  3.14 of 10000000000"


def test_the_limits_leave_an_ordinary_render_and_its_size_alone():
    big = [{"role": "user", "content": "x" * 300_000}, {"role": "assistant", "content": "y" * 300_000}]
    text = ChatTemplate(tokenizer(CHATML_TEMPLATE)).render(big)
    assert text == ("<|im_start|>user\n" + "x" * 300_000 + "<|im_end|>\n<|im_start|>assistant\n"
                    + "y" * 300_000 + "<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(TemplateLimitError, match="over its size limit of 100,000 characters"):
        ChatTemplate(tokenizer(CHATML_TEMPLATE), max_chars=100_000).render(big)
