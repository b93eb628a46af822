"""Structured output and tool calls through the official ``openai`` client against an in-process server:
``response_format`` replies validate with ``jsonschema`` (an independent validator), ``parse`` fills a
pydantic model, tool calls round-trip with the tool-result turn, streamed tool calls assemble from their
deltas, and bad requests are 400s that say what is wrong."""

from __future__ import annotations

import json
import string

import pytest
import torch

pytest.importorskip("llguidance")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")
httpx = pytest.importorskip("httpx")

from serve_helpers import BackgroundServer  # noqa: E402

from tinyformer.config import ModelConfig  # noqa: E402
from tinyformer.data.chat_template import ChatTemplate, with_chatml  # noqa: E402
from tinyformer.data.tokenizer import build_tokenizer  # noqa: E402
from tinyformer.models.decoder import DecoderLM  # noqa: E402
from tinyformer.serve.app import create_app  # noqa: E402

NAME = "tiny-structured"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 4}},
                                       "required": ["zone"], "additionalProperties": False}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def tok():
    return with_chatml(build_tokenizer("char", string.printable))  # ChatML: the template runs trained here get


@pytest.fixture(scope="module")
def server(tok):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: a second thread only stalls on a busy machine
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=1, n_head=2, d_ff=64, max_seq_len=2048)
    with BackgroundServer(create_app(DecoderLM(cfg).eval(), tok, model_name=NAME, max_batch=8)) as srv:
        yield srv
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)


def ask(content: str = "hi") -> list[dict]:
    return [{"role": "user", "content": content}]


def test_chat_response_format_json_schema_replies_validate(client):
    r = client.chat.completions.create(
        model=NAME, messages=ask(), n=8, max_tokens=200, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), PERSON)


def test_chat_and_completions_json_object_replies_parse(client):
    r = client.chat.completions.create(model=NAME, messages=ask(), n=4, max_tokens=150, seed=2,
                                       response_format={"type": "json_object"})
    c = client.completions.create(model=NAME, prompt="x", n=4, max_tokens=150, seed=3,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "p", "schema": PERSON}}})
    for choice in r.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
    for choice in c.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), PERSON)


def test_parse_fills_a_pydantic_model(client):
    class Pet(pydantic.BaseModel):
        kind: str = pydantic.Field(max_length=5)
        legs: int = pydantic.Field(ge=0, le=8)

    class Owner(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=6)
        pets: list[Pet] = pydantic.Field(max_length=2)

    r = client.chat.completions.parse(model=NAME, messages=ask(), response_format=Owner, max_tokens=300, seed=4)
    owner = r.choices[0].message.parsed
    assert isinstance(owner, Owner) and all(isinstance(p, Pet) for p in owner.pets)
    assert Owner.model_validate_json(r.choices[0].message.content) == owner


def test_a_schema_that_cannot_finish_in_max_tokens_ends_with_length_and_says_so(client):
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 50}}, "required": ["s"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "long", "schema": schema}}
    r = client.chat.completions.with_raw_response.create(model=NAME, messages=ask(), max_tokens=10,
                                                         response_format=fmt)
    choice = r.http_response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["incomplete_details"]["reason"] == "max_tokens"
    assert "incomplete" in choice["incomplete_details"]["message"]
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice["message"]["content"])
    with pytest.raises(openai.LengthFinishReasonError):  # parse refuses it too
        client.chat.completions.parse(model=NAME, messages=ask(), max_tokens=10, response_format=fmt)


def _check_calls(calls, names=None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_required_and_named_tool_choice_give_valid_calls(client):
    for seed in range(3):
        r = client.chat.completions.create(model=NAME, messages=ask("weather?"), tools=[WEATHER, TIME],
                                           tool_choice="required", max_tokens=1000, seed=seed)
        assert r.choices[0].finish_reason == "tool_calls"  # parallel calls: one or more
        _check_calls(r.choices[0].message.tool_calls)
        named = client.chat.completions.create(
            model=NAME, messages=ask("time?"), tools=[WEATHER, TIME], max_tokens=300, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
        assert named.choices[0].finish_reason == "tool_calls"
        assert len(named.choices[0].message.tool_calls) == 1
        _check_calls(named.choices[0].message.tool_calls, {"get_time"})


def test_a_tool_round_trip_renders_the_call_and_its_result_back(client, tok):
    messages = ask("Weather in Oslo?")
    first = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER],
                                           tool_choice="required", max_tokens=300, seed=7)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=5, seed=8)
    assert second.choices[0].message.tool_calls is None
    # the prompt the server built holds the call and the result, as the template renders them
    expected = [messages[0],
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": call.id, "type": "function",
                     "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    prompt = ChatTemplate(tok).render(expected, True, [WEATHER])
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {call.function.arguments}}}\n</tool_call>' in prompt
    assert second.usage.prompt_tokens == len(tok.encode(prompt))


def test_streamed_tool_calls_assemble_from_deltas_into_the_unstreamed_reply(client):
    kwargs = dict(model=NAME, messages=ask("both?"), tools=[WEATHER, TIME], tool_choice="required",
                  max_tokens=1000, seed=11, parallel_tool_calls=True)
    whole = client.chat.completions.create(**kwargs)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            if d.id:
                entry["id"] = d.id
            if d.function and d.function.name:
                entry["name"] += d.function.name
            if d.function and d.function.arguments:
                entry["arguments"] += d.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    expected = whole.choices[0].message.tool_calls
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in expected]
    assert all(c["id"] for c in calls.values())
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])


def test_auto_tool_choice_replies_are_text_or_valid_calls(client):
    r = client.chat.completions.create(model=NAME, messages=ask(), tools=[WEATHER], n=8, max_tokens=40, seed=5)
    for c in r.choices:
        if c.message.tool_calls:
            _check_calls(c.message.tool_calls)
        else:
            assert "<tool_call>" not in (c.message.content or "")


@pytest.mark.parametrize("body, status, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     400, "foo"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, 400, "uniqueItems"),
    ({"response_format": {"type": "xml"}}, 400, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch"}}}, 400, "launch"),
    ({"tools": [{"type": "function"}]}, 400, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400, "tools"),
    ({"tools": "get_weather"}, 400, "tools"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, 400, "declared twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}]}, 400, "not"),
])
def test_bad_structured_requests_are_400s_naming_the_problem(server, body, status, needle):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": NAME, "messages": ask(), "max_tokens": 5, **body})
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    assert client_error_raises(server, body)


def client_error_raises(server, body) -> bool:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
    try:
        c.chat.completions.create(model=NAME, messages=ask(), max_tokens=5, extra_body=body)
    except openai.BadRequestError:
        return True
    return False


def test_tool_call_deltas_of_any_split_assemble_to_the_parsed_reply():
    from tinyformer.data.chat_template import format_tool_call, parse_tool_calls
    from tinyformer.serve.structured import ToolCallDeltas

    text = ("Let me check <tool and then:\n" + format_tool_call("get_weather", {"city": "Oslo", "note": "a}b"})
            + "\n" + format_tool_call("get_time", {"zone": "UTC"}))
    want_content, want_calls = parse_tool_calls(text)
    rng = torch.Generator().manual_seed(0)
    for _ in range(20):
        cuts = sorted(torch.randint(0, len(text), (12,), generator=rng).tolist())
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        d = ToolCallDeltas()
        parts = [p for piece in pieces for p in d.feed(piece)] + d.close()
        content = "".join(p.get("content", "") for p in parts)
        calls: dict[int, list[str]] = {}
        for p in parts:
            for t in p.get("tool_calls", []):
                entry = calls.setdefault(t["index"], ["", ""])
                entry[0] += t["function"].get("name", "")
                entry[1] += t["function"].get("arguments", "")
        assert content.strip() == want_content
        assert [tuple(v) for _, v in sorted(calls.items())] == want_calls
