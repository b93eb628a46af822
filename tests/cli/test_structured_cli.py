"""`tinyformer generate` with the structured-output flags on a run folder (the command line's ``main``, in
process: a subprocess costs tens of seconds on a busy machine): the samples meet the schema (checked with
``jsonschema``), the regex (``re.fullmatch``), the GBNF grammar and the choices, and bad values are one-line
errors with exit code 2."""

from __future__ import annotations

import json
import re
import string

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from tinyformer.config import ModelConfig  # noqa: E402
from tinyformer.data.tokenizer import build_tokenizer  # noqa: E402
from tinyformer.models.decoder import DecoderLM  # noqa: E402
from tinyformer.run_folder import save_model  # noqa: E402

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 99},
                                           "w": {"enum": ["red", "blue"]},
                                           "s": {"type": "string", "maxLength": 4}},
          "required": ["n", "w"], "additionalProperties": False}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("structured_run")
    tok = build_tokenizer("char", string.printable)
    torch.manual_seed(0)
    save_model(folder, DecoderLM(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=1, n_head=2, d_ff=64,
                                             max_seq_len=256)))
    tok.save(folder / "tokenizer.json")
    return folder


class Out:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def generate(run_dir, capsys):
    """Run `tinyformer generate --model RUN --prompt a ... FLAGS` in process (the thread settings it makes
    are undone afterwards)."""
    from tinyformer.cli.main import main

    threads = torch.get_num_threads()

    def run(*flags: str) -> Out:
        capsys.readouterr()
        code = main(["generate", "--model", str(run_dir), "--prompt", "a", "--temperature", "1", "--top-k", "0",
                     "--seed", "0", *flags])
        out = capsys.readouterr()
        return Out(code, out.out, out.err)

    yield run
    torch.set_num_threads(threads)


def test_json_schema_samples_validate_and_report_completion(generate, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    out = generate("--json", "--num-samples", "16", "--max-new-tokens", "120",
                   "--json-schema", str(path))
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(lines) == 16
    for line in lines:
        assert line["complete"] is True and line["finish_reason"] == "stop"
        jsonschema.validate(json.loads(line["text"]), SCHEMA)


def test_choice_regex_and_gbnf_grammar_samples_conform(generate, tmp_path):
    out = generate("--json", "--num-samples", "12", "--choice", "yes", "--choice", "no thanks")
    assert out.returncode == 0, out.stderr
    assert {json.loads(x)["text"] for x in out.stdout.splitlines()} <= {"yes", "no thanks"}
    out = generate("--no-echo", "--num-samples", "4", "--max-new-tokens", "40",
                   "--regex", "[a-c]{2}-[0-9]{1,3}")  # streamed samples
    assert out.returncode == 0, out.stderr
    samples = [s for s in out.stdout.splitlines() if not s.startswith("--- sample")]
    assert len(samples) == 4 and all(re.fullmatch("[a-c]{2}-[0-9]{1,3}", s) for s in samples), samples
    gbnf = tmp_path / "sum.gbnf"
    gbnf.write_text('root ::= digit ("+" digit)*\ndigit ::= [0-9]\n')
    out = generate("--json", "--num-samples", "6", "--max-new-tokens", "60", "--grammar", str(gbnf))
    assert out.returncode == 0, out.stderr
    for x in out.stdout.splitlines():
        line = json.loads(x)
        assert line["finish_reason"] == "length" or re.fullmatch(r"[0-9](\+[0-9])*", line["text"])


def test_a_budget_too_small_warns_that_the_output_is_incomplete(generate):
    out = generate("--max-new-tokens", "3", "--json-schema", json.dumps(SCHEMA))
    assert out.returncode == 0, out.stderr
    assert "incomplete" in out.stderr and "--max-new-tokens 3" in out.stderr


@pytest.mark.parametrize("flags, needle", [
    (["--json-schema", '{"type": "array", "uniqueItems": true}'], "uniqueItems"),
    (["--json-schema", "missing.json"], "no such file"),
    (["--regex", "a(b"], "regex"),
    (["--grammar", "missing.lark"], "no such file"),
    (["--json-object", "--num-beams", "2"], "--num-beams"),
])
def test_bad_structured_flags_are_one_line_errors(generate, flags, needle):
    out = generate(*flags)
    assert out.returncode == 2
    assert needle in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
