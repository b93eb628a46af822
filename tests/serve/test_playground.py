"""The playground page (`tinyformer serve`'s /) in a real headless browser: Debian's Chromium driven by playwright.

A tiny random decoder with a char tokenizer and a Jinja chat template, and a tiny random encoder, are served
in-process on loopback ports. What the page shows is compared with independent references: the prompt with
the template rendered by jinja2 itself and encoded by the tokenizer, each token and its alternatives with a
cache-free greedy loop over the model (softmax of its logits), the similarity matrix with torch's cosine of
the run's embeddings. Requests the page sends are read off the wire (playwright's routing) and compared with
OpenAI's request shapes. A screenshot of each view is saved under the test's tmp_path.
"""

from __future__ import annotations

import colorsys
import json
import math
import os
import re
import shutil
import string

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
jinja2 = pytest.importorskip("jinja2")

from playwright import sync_api  # noqa: E402  (the test extra: the tests skip only without a Chromium binary)
from serve_helpers import BackgroundServer, SlowModel  # noqa: E402

from tinyformer.config import ModelConfig  # noqa: E402
from tinyformer.data.tokenizer import build_tokenizer  # noqa: E402
from tinyformer.models.decoder import DecoderLM  # noqa: E402
from tinyformer.models.encoder import EncoderModel  # noqa: E402
from tinyformer.serve.app import create_app  # noqa: E402

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
# no browser download, no network: Debian's Chromium, headless, with its background fetches off
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}<assistant>{% endif %}"
NAME = "tiny-chat"
TOP = 5
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}



@pytest.fixture(scope="module")
def browser():
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set CHROMIUM)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def chat_run():
    tok = build_tokenizer("char", string.printable)
    tok.chat_template = TEMPLATE
    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=tok.vocab_size, d_model=64, n_layer=2, n_head=4, n_kv_head=2,
                                  max_seq_len=160, init_std=0.3)).eval()
    with BackgroundServer(create_app(SlowModel(model, 0.02), tok, model_name=NAME)) as srv:
        yield srv, model, tok


@pytest.fixture(scope="module")
def encoder_run():
    from tinyformer.presets import get_preset

    tok = build_tokenizer("char", string.ascii_lowercase + " ")
    cfg = get_preset("bert-base", vocab_size=tok.vocab_size, d_model=32, n_layer=2, n_head=2, d_ff=64, max_seq_len=48)
    torch.manual_seed(0)
    model = EncoderModel(cfg).eval()
    with BackgroundServer(create_app(model, tok, model_name="tiny-encoder")) as srv:
        yield srv, model, tok


def open_page(browser, url: str):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.goto(url + "/")
    page.wait_for_function("document.body.dataset.state === 'ready'", timeout=10_000)
    return page, errors


def reference_reply(model, tok, prompt: str, n: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Cache-free greedy decoding up to EOS: (token, its probability, the top-TOP (token, probability))."""
    ids = tok.encode(prompt, add_special_tokens=False)
    out = []
    with torch.no_grad():
        for _ in range(n):
            probs = torch.softmax(model(torch.tensor([ids]))[0, -1].double(), dim=-1)
            values, top = probs.topk(TOP)
            token = int(top[0])
            out.append((token, float(probs[token]), list(zip(top.tolist(), values.tolist()))))
            if token == tok.eos_id:
                break
            ids.append(token)
    return out


def shown(text: str) -> str:
    """How the page writes a piece in a table: spaces, newlines and tabs made visible."""
    return text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥")


def shown_percent(text: str) -> float:
    return float(text.strip().rstrip("%"))


def set_controls(page, **values) -> None:
    for name, value in values.items():
        page.fill(f"#{name}", str(value))


def send(page, text: str) -> None:
    page.fill("#user_input", text)
    page.press("#user_input", "Enter")


def test_a_chat_turn_streams_greedy_tokens_with_their_probabilities_and_alternatives(chat_run, browser, tmp_path):
    srv, model, tok = chat_run
    prompt = jinja2.Template(TEMPLATE).render(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    want = reference_reply(model, tok, prompt, 12)
    page, errors = open_page(browser, srv.url)
    try:
        assert NAME in page.text_content("#model")
        set_controls(page, temperature=0, max_tokens=12, top_logprobs=TOP)
        send(page, "hi")
        # streaming: tokens are on the page while the request still runs
        page.wait_for_function("document.body.dataset.state === 'running' && "
                               "document.querySelectorAll('#chat .msg.assistant .tok').length >= 1", timeout=10_000)
        assert page.locator("#stop").is_enabled()
        page.wait_for_function("document.body.dataset.state === 'done'", timeout=20_000)
        tokens = page.locator("#chat .msg.assistant .tok")
        assert tokens.count() == len(want), page.text_content("#status")
        assert "finish:" in page.text_content("#status")
        for i, (token, p, _) in enumerate(want):
            label = tokens.nth(i).get_attribute("aria-label")
            if token != tok.eos_id:
                assert label.startswith(f"token {i + 1}: {json.dumps(tok.decode([token]))}, probability ")
            assert math.isclose(shown_percent(label.rpartition(" ")[2]), 100 * p, rel_tol=0.01, abs_tol=0.006)
            # the colour: hue 0 (red) at probability 0 to 120 (green) at 1
            colour = page.evaluate(f"document.querySelectorAll('#chat .msg.assistant .tok')[{i}].style.background")
            rgb = colorsys.hls_to_rgb(round(120 * p) / 360, 0.82, 0.85)
            got = [int(c) for c in re.fullmatch(r"rgb\((\d+), (\d+), (\d+)\)", colour).groups()]
            assert all(abs(g - 255 * c) <= 1 for g, c in zip(got, rgb)), (colour, p)

        # the alternatives of the first and of the third token (hover, then keyboard: focus and arrow keys)
        for i, how in ((0, "hover"), (2, "keys")):
            if how == "hover":
                tokens.nth(i).hover()
            else:
                tokens.nth(1).focus()
                page.keyboard.press("ArrowRight")
                assert page.evaluate("document.activeElement.dataset.index") == str(i)
            assert page.is_visible("#alts")
            assert page.text_content("#alts .head").startswith(f"token {i + 1}:")
            rows = page.locator("#alts tr")
            assert rows.count() == TOP
            _, p, top = want[i]
            for r, (alt, q) in enumerate(top):
                cells = rows.nth(r).locator("td")
                if alt != tok.eos_id:
                    assert cells.nth(0).text_content() == shown(tok.decode([alt]))
                assert math.isclose(shown_percent(cells.nth(2).text_content()), 100 * q, rel_tol=0.01, abs_tol=0.006)
            assert rows.nth(0).get_attribute("class") == "chosen"  # greedy: the most probable one was drawn
            page.keyboard.press("Escape")
            assert not page.is_visible("#alts")

        # regenerate: the same conversation again, the reply replaced (greedy: the same tokens)
        first = [tokens.nth(i).get_attribute("aria-label") for i in range(tokens.count())]
        page.click("#regenerate")
        page.wait_for_function("document.body.dataset.state === 'done'", timeout=20_000)
        assert page.locator("#chat .msg").count() == 2
        assert [tokens.nth(i).get_attribute("aria-label") for i in range(tokens.count())] == first

        page.check("#show_prompt")
        page.wait_for_function("document.getElementById('prompt_view').dataset.loaded === 'true'", timeout=10_000)
        assert page.text_content("#prompt_text") == prompt  # the prompt of the last request
        tokens.nth(3).click()  # pinned open for the screenshot
        assert page.is_visible("#alts")
        page.screenshot(path=str(tmp_path / "playground-chat.png"), full_page=True)
        assert (tmp_path / "playground-chat.png").stat().st_size > 10_000
    finally:
        page.close()
    assert not errors, errors


def test_the_prompt_view_shows_the_rendered_template_and_its_tokens(chat_run, browser):
    srv, model, tok = chat_run
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    prompt = jinja2.Template(TEMPLATE).render(messages=messages, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    page, errors = open_page(browser, srv.url)
    try:
        page.fill("#system", "Be brief.")
        page.fill("#user_input", "What is 2+2?")
        page.check("#show_prompt")  # before sending: the prompt the typed message makes
        page.wait_for_function("document.getElementById('prompt_view').dataset.loaded === 'true'", timeout=10_000)
        assert page.text_content("#prompt_text") == prompt
        page.click("#template_details summary")
        assert page.text_content("#template_source") == TEMPLATE
        chips = page.locator("#prompt_tokens .piece")
        assert chips.count() == len(ids)
        assert [int(chips.nth(i).locator("b").text_content()) for i in range(len(ids))] == ids
        assert "".join(chips.nth(i).text_content().removeprefix(str(ids[i])) for i in range(len(ids))) == shown(prompt)
        page.uncheck("#show_prompt")
        assert not page.is_visible("#prompt_view")
    finally:
        page.close()
    assert not errors, errors


def test_stop_ends_a_streaming_reply_and_keeps_what_was_written(chat_run, browser):
    srv, model, tok = chat_run
    prompt = jinja2.Template(TEMPLATE).render(messages=[{"role": "user", "content": "go"}], add_generation_prompt=True)
    assert len(reference_reply(model, tok, prompt, 6)) == 6  # the reply would not end by itself this soon
    page, errors = open_page(browser, srv.url)
    try:
        set_controls(page, temperature=0, max_tokens=120)
        send(page, "go")
        page.wait_for_function("document.querySelectorAll('#chat .msg.assistant .tok').length >= 3", timeout=10_000)
        page.click("#stop")
        page.wait_for_function("document.body.dataset.state === 'done'", timeout=10_000)
        assert page.text_content("#status").startswith("stopped after")
        assert 3 <= page.locator("#chat .msg.assistant .tok").count() < 120
        assert "finish: stopped" in page.text_content("#chat .msg.assistant .note")
        assert page.locator("#send").is_enabled() and page.locator("#regenerate").is_enabled()
    finally:
        page.close()
    assert not errors, errors


def test_a_refused_request_shows_the_servers_message_and_regenerate_retries_it(chat_run, browser):
    srv, _, _ = chat_run
    page, errors = open_page(browser, srv.url)
    try:
        set_controls(page, temperature=0, max_tokens=1000)  # more than the 160-token context holds
        send(page, "hi")
        page.wait_for_function("document.body.dataset.state === 'done'", timeout=10_000)
        status = page.text_content("#status")
        assert "maximum context length is 160 tokens" in status and page.get_attribute("#status", "class") == "error"
        assert page.locator("#chat .msg").count() == 1  # the user's message stays, no empty reply
        set_controls(page, max_tokens=4)
        page.click("#regenerate")
        page.wait_for_function("document.body.dataset.state === 'done'", timeout=10_000)
        assert page.locator("#chat .msg.assistant .tok").count() >= 1 and "finish:" in page.text_content("#status")
    finally:
        page.close()
    # the browser logs the refused request's 400 itself; nothing else may go wrong
    assert [e for e in errors if "400" not in e] == []


def test_a_json_schema_is_sent_as_openai_response_format_and_a_server_ignoring_it_still_answers(chat_run, browser):
    srv, _, _ = chat_run
    page, errors = open_page(browser, srv.url)
    sent: list[dict] = []

    def capture(route):
        sent.append(json.loads(route.request.post_data))
        route.continue_()

    try:
        page.route("**/v1/chat/completions", capture)
        set_controls(page, temperature=0, max_tokens=5)
        send(page, "hi")  # no schema: no response_format
        page.wait_for_function("document.body.dataset.state === 'done'", timeout=20_000)
        page.fill("#json_schema", "{not json")
        send(page, "again")
        assert "not valid JSON" in page.text_content("#schema_status")
        page.fill("#json_schema", json.dumps(SCHEMA))
        page.click("#send")  # the message is still in the box
        page.wait_for_function("document.body.dataset.state === 'done'", timeout=20_000)
        assert not page.get_attribute("#status", "class")  # not an error
        assert page.locator("#chat .msg.assistant").count() == 2
    finally:
        page.close()
    assert len(sent) == 2
    assert "response_format" not in sent[0]
    assert sent[1]["response_format"] == {"type": "json_schema",
                                          "json_schema": {"name": "user_schema", "schema": SCHEMA}}
    assert [m["role"] for m in sent[1]["messages"]] == ["user", "assistant", "user"]
    assert sent[1]["stream"] is True and sent[1]["logprobs"] is True and sent[1]["max_tokens"] == 5
    assert not errors, errors


def sse(chunks: list[dict]) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                         "required": ["city"]}}}]


def test_tool_calls_streamed_or_whole_are_shown_and_their_results_sent_back_in_openai_shape(chat_run, browser):
    """Replies with tool calls, answered by the test in place of the server: first streamed (OpenAI's chunk
    shape: ``delta.tool_calls`` with the call's id and name first, its arguments in pieces, finish_reason
    "tool_calls"), then a whole completion with ``message.tool_calls``; the tools box and the calls' results
    go out as OpenAI's request shapes (``tools``, ``tool_choice``, then one ``tool`` message per call)."""
    srv, _, _ = chat_run
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": NAME}

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    streamed = sse([
        chunk({"role": "assistant", "content": None}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        chunk({}, "tool_calls"),
    ])
    second_call = {"id": "call_2", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}
    whole = {"id": "chatcmpl-2", "object": "chat.completion", "created": 0, "model": NAME, "choices": [
        {"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [second_call]},
         "logprobs": None, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}}
    sent: list[dict] = []

    def answer(route):
        sent.append(json.loads(route.request.post_data))
        if len(sent) == 1:
            route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=streamed)
        else:
            route.fulfill(status=200, headers={"Content-Type": "application/json"}, body=json.dumps(whole))

    page, errors = open_page(browser, srv.url)
    try:
        page.route("**/v1/chat/completions", answer)
        page.fill("#tools", "[not json")
        send(page, "weather in Paris?")
        assert "not valid JSON" in page.text_content("#tools_status") and not sent
        page.fill("#tools", json.dumps(TOOLS))
        page.select_option("#tool_choice", "required")
        page.click("#send")
        page.wait_for_function("document.body.dataset.state === 'done'", timeout=10_000)
        call = page.text_content("#chat .msg.assistant .tool-calls .call")
        assert call.startswith('get_weather({"city": "Paris"})') and "call_1" in call
        assert "finish: tool_calls" in page.text_content("#chat .msg.assistant .note")
        page.fill("#tool_result_0", "18 C, sunny")
        page.press("#tool_result_0", "Enter")  # the result alone: no user message with it
        page.wait_for_function("document.body.dataset.state === 'done' && "
                               "document.querySelectorAll('#chat .msg.assistant').length === 2", timeout=10_000)
        assert page.text_content("#chat .msg.tool .body") == "18 C, sunny"
        last = page.locator("#chat .msg.assistant").nth(1)
        assert last.locator(".call").text_content().startswith('get_weather({"city": "Lyon"})')
    finally:
        page.close()
    assert sent[0]["tools"] == TOOLS and sent[0]["tool_choice"] == "required"
    assert sent[1]["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}]
    assert not errors, errors


def test_an_encoder_run_shows_the_cosine_matrix_of_the_sentences(encoder_run, browser, tmp_path):
    from tinyformer.models.sentence_embeddings import embed_ids, encode_texts

    srv, model, tok = encoder_run
    sentences = ["the cat sat on the mat", "a cat sat on a mat", "stocks fell today"]
    with torch.no_grad():
        vectors = embed_ids(model, encode_texts(model, tok, sentences, 48), tok.pad_id).double()
    want = torch.nn.functional.cosine_similarity(vectors[:, None], vectors[None], dim=-1)
    page, errors = open_page(browser, srv.url)
    try:
        assert page.is_visible("#encoder_view") and not page.is_visible("#chat_view")
        page.fill("#sentences", "\n".join(sentences) + "\n\n")  # blank lines are no sentences
        page.click("#embed")
        page.wait_for_function("document.body.dataset.state === 'done'", timeout=10_000)
        cells = page.locator("#similarity td")
        assert cells.count() == len(sentences) ** 2
        got = torch.tensor([float(cells.nth(i).get_attribute("data-cosine")) for i in range(cells.count())],
                           dtype=torch.float64).view(len(sentences), len(sentences))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert re.fullmatch(r"3 sentences, 32 dimensions, \d+ tokens", page.text_content("#encoder_status"))
        page.screenshot(path=str(tmp_path / "playground-encoder.png"), full_page=True)
    finally:
        page.close()
    assert not errors, errors
