"""`--speculative`, `--draft-model`, `--draft-tokens` on the command line: the same greedy text as without
them, the draft counts in --json timings, and one-line errors for bad input."""

from __future__ import annotations

import json

import pytest
import torch

from tinyformer.cli.main import main
from tinyformer.config import ModelConfig
from tinyformer.data.tokenizer import build_tokenizer
from tinyformer.models.decoder import DecoderLM
from tinyformer.run_folder import save_model

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "abcdefghij klmnop"
PROMPT = "abc abc abc abc ab"


def make_run(folder, text: str, seed: int = 0):
    tok = build_tokenizer("char", text)
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=2, n_head=4, max_seq_len=128, init_std=0.3)
    save_model(folder, DecoderLM(cfg).eval())
    tok.save(folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_runs")
    return (make_run(root / "model", TEXT), make_run(root / "draft", TEXT, seed=1),
            make_run(root / "other", TEXT.replace("p", "q"), seed=1))


def one_line_error(argv, capsys, *pieces):
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and "Traceback" not in err and len(lines) == 1, err
    for piece in pieces:
        assert piece in lines[0], lines[0]


def generate_json(run, capsys, *extra):
    capsys.readouterr()
    assert main(["generate", "--model", str(run), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens",
                 "24", "--ignore-eos", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("how", [["--speculative", "ngram", "--draft-tokens", "3"], ["--draft-model", "DRAFT"]])
def test_speculative_generate_prints_the_plain_greedy_text_and_the_draft_counts(runs, capsys, how):
    model, draft, _ = runs
    how = [str(draft) if a == "DRAFT" else a for a in how]
    plain = generate_json(model, capsys)
    spec = generate_json(model, capsys, *how)
    assert spec["token_ids"] == plain["token_ids"]
    assert "draft_proposed" not in plain["timings"]
    assert spec["timings"]["draft_proposed"] >= spec["timings"]["draft_accepted"] >= 0
    assert spec["timings"]["draft_proposed"] > 0


def test_draft_tokens_0_is_one_line(runs, capsys):
    one_line_error(["generate", "--model", str(runs[0]), "--prompt", "ab", "--speculative", "ngram",
                    "--draft-tokens", "0"], capsys, "--draft-tokens must be >= 1")


def test_speculative_beam_search_is_one_line(runs, capsys):
    one_line_error(["generate", "--model", str(runs[0]), "--prompt", "ab", "--speculative", "ngram",
                    "--num-beams", "2"], capsys, "does not apply to beam search")


def test_a_draft_model_with_another_tokenizer_is_one_line(runs, capsys):
    one_line_error(["generate", "--model", str(runs[0]), "--prompt", "ab", "--draft-model", str(runs[2])],
                   capsys, "draft model's tokenizer differs")


def test_speculative_draft_without_a_draft_model_is_one_line(runs, capsys):
    one_line_error(["chat", "--model", str(runs[0]), "--speculative", "draft"], capsys,
                   "--speculative draft needs --draft-model")


def test_serve_draft_tokens_0_is_one_line(runs, capsys):
    pytest.importorskip("fastapi")
    one_line_error(["serve", "--model", str(runs[0]), "--port", "0", "--speculative", "ngram",
                    "--draft-tokens", "0"], capsys, "--draft-tokens must be >= 1")
