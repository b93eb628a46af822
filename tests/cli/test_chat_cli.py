"""`tinyformer chat` with piped input, compared with the engine run on the conversation prompt the chat
format prescribes (plain turns written out here by hand; templates rendered by `transformers`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinyformer.config import ModelConfig
from tinyformer.data.chat_template import ChatTemplate
from tinyformer.data.tokenizer import build_tokenizer
from tinyformer.generation.generator import Generator
from tinyformer.generation.sampling import SamplingParams
from tinyformer.models.decoder import DecoderLM
from tinyformer.run_folder import save_model

PYTHON = sys.executable
CORPUS = "User: Assistant: System: [the quick brown fox jumps over a lazy dog] 0123456789.,!?\n"
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
NEW = 12


def make_run(folder: Path, chat_template: str | None) -> Path:
    tok = build_tokenizer("char", CORPUS)
    tok.chat_template = chat_template
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64,
                      max_seq_len=160)
    torch.manual_seed(1)
    model = DecoderLM(cfg)
    with torch.no_grad():  # peaked next-token distributions
        for p in model.parameters():
            p.normal_(0, 0.3)
    save_model(folder, model)
    tok.save(folder)  # tokenizer.json + tokenizer_config.json (with the chat template, if any)
    return folder


SESSIONS = {  # name: (template?, piped stdin)
    "plain": (False, "the fox\na lazy dog\n/reset\nthe fox\n"),
    "quit": (False, "the fox\n/quit\na lazy dog\n"),
    "template": (True, "the fox\na lazy dog\n"),
    "bad character": (False, "héllo\nthe fox\n"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    return {"plain": make_run(root / "plain", None), "template": make_run(root / "template", TEMPLATE)}


@pytest.fixture(scope="module")
def sessions(runs) -> dict[str, subprocess.CompletedProcess]:
    """Every piped session, started at once (each is a separate interpreter start)."""
    import os

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"), HF_HUB_OFFLINE="1")
    procs = {}
    for name, (templated, stdin) in SESSIONS.items():
        run = runs["template" if templated else "plain"]
        argv = [PYTHON, "-m", "tinyformer", "chat", "--model", str(run), "--temperature", "0",
                "--max-new-tokens", str(NEW)]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, encoding="utf-8", env=env)
        procs[name] = (proc, stdin)
    done = {}
    for name, (proc, stdin) in procs.items():
        out, err = proc.communicate(stdin, timeout=180)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def greedy_reply(run: Path, prompt: str, stop: list[str]) -> str:
    gen = Generator.from_run(run)
    return gen.generate([prompt], SamplingParams(temperature=0, max_new_tokens=NEW, stop_strings=stop))[0].text


def test_plain_chat_keeps_the_conversation_in_context_and_reset_forgets_it(runs, sessions):
    run = runs["plain"]
    first = greedy_reply(run, "User: the fox\nAssistant:", ["\nUser:"])
    second = greedy_reply(run, f"User: the fox\nAssistant: {first.strip()}\nUser: a lazy dog\nAssistant:", ["\nUser:"])
    result = sessions["plain"]
    assert result.returncode == 0, result.stderr
    # after /reset the third turn starts over, so it gets the first reply again
    assert result.stdout == "".join(r.lstrip() + "\n---\n" for r in (first, second, first))
    assert second.strip() != first.strip()  # the second turn really depends on the context


def test_quit_ends_the_session(runs, sessions):
    result = sessions["quit"]
    first = greedy_reply(runs["plain"], "User: the fox\nAssistant:", ["\nUser:"])
    assert result.returncode == 0, result.stderr
    assert result.stdout == first.lstrip() + "\n---\n"  # the line after /quit is never answered


def test_template_chat_renders_like_transformers_apply_chat_template(runs, sessions):
    transformers = pytest.importorskip("transformers")
    run = runs["template"]
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(run / "tokenizer.json"), eos_token="<|eos|>",
                                                  bos_token="<|bos|>", chat_template=TEMPLATE)

    def render(messages):
        return hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    messages = [{"role": "user", "content": "the fox"}]
    first = greedy_reply(run, render(messages), [])
    messages += [{"role": "assistant", "content": first.strip()}, {"role": "user", "content": "a lazy dog"}]
    second = greedy_reply(run, render(messages), [])
    result = sessions["template"]
    assert result.returncode == 0, result.stderr
    assert result.stdout == first.lstrip() + "\n---\n" + second.lstrip() + "\n---\n"


def test_a_turn_with_bad_input_reports_it_and_the_chat_goes_on(runs, sessions):
    result = sessions["bad character"]
    assert result.returncode == 0
    assert "not in the char tokenizer" in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == greedy_reply(runs["plain"], "User: the fox\nAssistant:", ["\nUser:"]).lstrip() + "\n---\n"


@pytest.mark.parametrize("template", [
    # ChatML with a default system message and tojson
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ {'n': messages|length}|tojson }}",
    # Llama 2 style: bos/eos, system folded into the first turn, loop controls, whitespace control
    "{% for message in messages %}{% if message['role'] == 'system' %}{% continue %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'].strip() + ' [/INST]' }}"
    "{% else %}  {{ message['content'].strip() }} {{ eos_token }}\n{% endif %}{% endfor %}",
])
def test_render_template_equals_transformers(tmp_path, template):
    transformers = pytest.importorskip("transformers")
    tok = build_tokenizer("char", CORPUS)  # bos_token <|bos|>, eos_token <|eos|>
    tok.save(tmp_path / "tokenizer.json")
    tok.chat_template = template
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                                  bos_token="<|bos|>", eos_token="<|eos|>", chat_template=template)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " hi "},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    for gen_prompt in (True, False):
        want = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)
        got = ChatTemplate(tok).render(messages, gen_prompt)
        assert got == want


LOOPING = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_a_looping_template_stops_at_template_timeout_with_one_line(tmp_path, capsys, monkeypatch):
    import io

    from tinyformer.cli.main import main

    run = make_run(tmp_path / "looping", LOOPING)
    assert main(["generate", "--model", str(run), "--chat", "--prompt", "the fox", "--template-timeout", "0.2"]) == 2
    err = capsys.readouterr().err
    assert "ran past its time limit of 0.2 s" in err and "Traceback" not in err and err.count("\n") == 1
    # chat reports the turn and goes on to the next one (which fails the same way), then ends normally
    monkeypatch.setattr(sys, "stdin", io.StringIO("the fox\na lazy dog\n"))
    assert main(["chat", "--model", str(run), "--template-timeout", "0.2"]) == 0
    assert capsys.readouterr().err.count("ran past its time limit of 0.2 s") == 2


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_a_template_timeout_that_is_no_positive_number_is_exit_2(runs, capsys, command):
    from tinyformer.cli.main import main

    argv = [command, "--model", str(runs["template"]), "--template-timeout", "0"]
    assert main(argv + (["--prompt", "x"] if command == "generate" else [])) == 2
    assert "--template-timeout must be a positive number of seconds, got 0.0" in capsys.readouterr().err


def test_a_chat_session_compiles_its_template_once_not_every_turn(runs, monkeypatch):
    import jinja2

    from tinyformer.generation.chat import ChatSession

    session = ChatSession(Generator.from_run(runs["template"]))

    def no_compiling(*args, **kwargs):
        raise AssertionError("the template was compiled again")

    monkeypatch.setattr(jinja2.Environment, "compile", no_compiling)
    monkeypatch.setattr(jinja2.Environment, "from_string", no_compiling)
    for text in ("the fox", "a lazy dog"):
        "".join(session.send(text, SamplingParams(temperature=0), max_new_tokens=4))
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]
