"""Chat template rendering: the same text as Hugging Face ``apply_chat_template``; clear errors."""

from __future__ import annotations

import string

import pytest

from tinyformer.data.tokenizer import build_tokenizer
from tinyformer.errors import GenerationError
from tinyformer.serve.chat import ChatTemplate

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


def test_template_renders_like_transformers_apply_chat_template():
    pytest.importorskip("jinja2")
    transformers = pytest.importorskip("transformers")
    tok = build_tokenizer("char", string.printable)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend, bos_token="<|bos|>",
                                              eos_token="<|eos|>", chat_template=CHATML)
    ours = ChatTemplate(CHATML, bos_token="<|bos|>", eos_token="<|eos|>")
    for add in (True, False):
        expected = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add)
        assert ours.render(MESSAGES, add_generation_prompt=add) == expected
    assert ours.stop_strings == ()
    assert ours.stop_token_ids({"<|im_end|>": 7}.get) == (7,)  # end-of-turn tokens the vocabulary has


def test_without_a_template_turns_are_plain_lines_ending_at_the_next_user_line():
    plain = ChatTemplate(None)
    text = plain.render([{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}])
    assert text == "System: Be kind.\nUser: Hi\nAssistant:"
    assert plain.stop_strings == ("\nUser:",) and plain.stop_token_ids({"<|im_end|>": 7}.get) == ()


def test_template_errors_are_generation_errors():
    pytest.importorskip("jinja2")
    with pytest.raises(GenerationError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(GenerationError, match="rejected.*unknown role tool"):
        ChatTemplate(CHATML).render([{"role": "tool", "content": "x"}])
    with pytest.raises(GenerationError, match="failed on these messages"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"role": "user", "content": "x"}])
