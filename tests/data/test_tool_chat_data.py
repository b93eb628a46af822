"""Tool calls in SFT data and in the ChatML template: rows with ``tool_calls``, ``tool`` messages and
``tools`` are read, render as Hugging Face ``apply_chat_template`` renders the same template, and the loss
mask covers the assistant's calls; replies parse back into the calls they hold."""

from __future__ import annotations

import json
import string

import pytest

from tinyformer.data.chat_data import read_chat_file
from tinyformer.data.chat_template import (
    CHATML_TEMPLATE,
    ChatTemplate,
    format_tool_call,
    parse_tool_calls,
    with_chatml,
)
from tinyformer.data.tokenizer import build_tokenizer
from tinyformer.errors import DataError

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ROW = {"tools": TOOLS, "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "assistant", "content": "Sunny."}]}


@pytest.fixture
def chat_file(tmp_path):
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                       {"role": "assistant", "content": "yo"}]}) + "\n")
    return path


def test_rows_with_tool_calls_and_tool_results_are_read(chat_file):
    chat = read_chat_file(chat_file)
    assert not chat.skipped and len(chat.conversations) == 2
    conv = chat.conversations[0]
    assert conv.tools == TOOLS and conv.messages[2]["content"] == ""
    assert conv.messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert conv.messages[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert chat.conversations[1].tools is None


@pytest.mark.parametrize("bad, message", [
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}, "not JSON"),
    ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, "name"),
    ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}, "only assistant"),
    ({"role": "robot", "content": "x"}, "robot"),
])
def test_malformed_tool_messages_are_errors_naming_the_line(tmp_path, bad, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, bad]}) + "\n")
    with pytest.raises(DataError, match=message) as info:
        read_chat_file(path)
    assert f"{path}:1" in str(info.value)


def test_chatml_with_tools_renders_like_transformers_and_masks_the_calls(chat_file):
    transformers = pytest.importorskip("transformers")
    tok = with_chatml(build_tokenizer("char", string.printable))
    conv = read_chat_file(chat_file).conversations[0]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend, chat_template=CHATML_TEMPLATE)
    template = ChatTemplate(tok)
    for add in (True, False):
        assert template.render(conv.messages, add, TOOLS) == hf.apply_chat_template(
            conv.messages, tools=TOOLS, tokenize=False, add_generation_prompt=add)
    ids, mask = template.encode_conversation(conv.messages, conv.tools)
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    call = format_tool_call("get_weather", {"city": "Oslo"})
    assert trained == call + "<|im_end|>" + "Sunny.<|im_end|>"
    # without tools the conversation renders as the plain ChatML it always was
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert template.render(plain, False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"


def test_a_template_that_knows_no_tools_gets_them_as_text():
    tok = build_tokenizer("char", string.printable)
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    conv = ROW["messages"][:4]
    text = ChatTemplate(tok).render([{**m, "content": m["content"] or ""} for m in conv], True, TOOLS)
    assert text.startswith("[system] Be brief.\n\n# Tools") and json.dumps(TOOLS[0]) in text
    assert "[assistant] " + format_tool_call("get_weather", {"city": "Oslo"}) in text
    assert "[user] <tool_response>\nsunny\n</tool_response>" in text


def test_parse_tool_calls_reads_back_what_format_tool_call_writes():
    text = "Checking.\n" + format_tool_call("a", {"x": [1, "é"]}) + "\n" + format_tool_call("b", {})
    content, calls = parse_tool_calls(text)
    assert content == "Checking."
    assert [(n, json.loads(a)) for n, a in calls] == [("a", {"x": [1, "é"]}), ("b", {})]
    assert parse_tool_calls("no calls <tool_call>\n{broken\n</tool_call>") == (
        "no calls <tool_call>\n{broken\n</tool_call>", [])


def test_a_data_file_that_is_not_utf8_is_one_data_error_naming_it_a_data_file(tmp_path):
    from tinyformer.errors import DataError

    path = tmp_path / "chat.jsonl"
    path.write_bytes('{"messages": [{"role": "user", "content": "café"}]}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"^data file .*chat\.jsonl is not UTF-8: byte 0xe9"):
        read_chat_file(path)
