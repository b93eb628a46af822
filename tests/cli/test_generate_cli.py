"""`tinyformer generate` as a user runs it: a subprocess on a run folder with a tiny random model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinyformer.config import ModelConfig
from tinyformer.data.tokenizer import build_tokenizer
from tinyformer.generation.generator import Generator
from tinyformer.generation.sampling import SamplingParams
from tinyformer.models.decoder import DecoderLM
from tinyformer.run_folder import load_model, load_tokenizer, save_model

PYTHON = sys.executable
CORPUS = "the quick brown fox jumps over the lazy dog. a b c d e f g h i j k l m n o p q r s t u v w x y z\n"


def make_run(folder: Path, max_seq_len: int = 64, seed: int = 0) -> Path:
    """A run folder: config.json, model.safetensors (random but peaked weights) and a char tokenizer."""
    tok = build_tokenizer("char", CORPUS)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64,
                      max_seq_len=max_seq_len)
    torch.manual_seed(seed)
    model = DecoderLM(cfg)
    with torch.no_grad():  # larger than the default init, so that the next-token distributions are peaked
        for p in model.parameters():
            p.normal_(0, 0.3)
    save_model(folder, model)
    tok.save(folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("run"))


def cli(*args: str, env: dict[str, str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "tinyformer", *args], capture_output=True, text=True, env=env,
                          input=stdin, timeout=120, encoding="utf-8")


def api_result(run_dir: Path, prompt: str, **params) -> object:
    gen = Generator.from_run(run_dir)
    return gen.generate([prompt], SamplingParams(**params))[0]


def test_streams_text_and_json_has_text_ids_and_logprobs(run_dir, cli_env):
    common = ["generate", "--model", str(run_dir), "--prompt", "the fox", "--max-new-tokens", "24", "--seed", "5",
              "--temperature", "0.8", "--top-k", "0", "--num-samples", "2"]
    streamed = cli(*common, env=cli_env)
    as_json = cli(*common, "--json", env=cli_env)
    assert streamed.returncode == 0, streamed.stderr
    assert as_json.returncode == 0, as_json.stderr
    rows = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert len(rows) == 2
    for i, row in enumerate(rows):
        assert set(row) >= {"text", "token_ids", "logprobs"}
        assert len(row["token_ids"]) == len(row["logprobs"]) <= 24  # generated ids only, not the prompt
        assert all(lp <= 0 for lp in row["logprobs"])
        # the same sample as the library gives for seed 5 + i
        want = api_result(run_dir, "the fox", temperature=0.8, max_new_tokens=24, seed=5 + i)
        assert row["token_ids"] == want.token_ids and row["text"] == want.text
        # streaming (one sample at a time) prints the same samples as the batched --json run
        assert row["text"] in streamed.stdout


def test_temperature_zero_is_greedy_and_stop_string_is_honoured(run_dir, cli_env, tmp_path):
    greedy = api_result(run_dir, "a b c", temperature=0, max_new_tokens=30)
    stop = greedy.text[4:7]
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("a b c", encoding="utf-8")
    out = cli("generate", "--model", str(run_dir), "--prompt-file", str(prompt_file), "--temperature", "0",
              "--max-new-tokens", "30", "--stop", stop, "--json", env=cli_env)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert row["text"] == greedy.text[: greedy.text.find(stop)]
    assert row["token_ids"] == greedy.token_ids[: len(row["text"]) + len(stop)]
    assert row["finish_reason"] == "stop"


BAD_INPUTS = {  # name: (flags after --model RUN, text the error must contain)
    "empty prompt": (["--prompt", ""], "prompt is empty"),
    "prompt longer than the context": (["--prompt", "a b c d e f g " * 10], "context"),
    "character the tokenizer lacks": (["--prompt", "héllo"], "not in the char tokenizer"),
    "top_p outside (0, 1]": (["--prompt", "a", "--top-p", "1.5"], "top_p"),
    "negative temperature": (["--prompt", "a", "--temperature", "-0.5"], "temperature"),
    "negative top_k": (["--prompt", "a", "--top-k", "-3"], "top_k"),
    "max-new-tokens beyond the context": (["--prompt", "a", "--max-new-tokens", "500"], "at most 63"),
}


def test_bad_input_is_one_line_on_stderr_with_exit_code_2(run_dir, cli_env, tmp_path):
    cases = {name: ["--model", str(run_dir), *flags] for name, (flags, _) in BAD_INPUTS.items()}
    cases["missing run folder"] = ["--model", str(tmp_path / "no-such-run"), "--prompt", "a"]
    expected = {name: text for name, (_, text) in BAD_INPUTS.items()} | {"missing run folder": "does not exist"}
    # all cases run at once: each is a separate interpreter start
    procs = {name: subprocess.Popen([PYTHON, "-m", "tinyformer", "generate", *argv], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=cli_env, encoding="utf-8")
             for name, argv in cases.items()}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 2, f"{name}: exit {proc.returncode}, stderr {stderr!r}"
        assert "Traceback" not in stderr, name
        assert len(stderr.strip().splitlines()) == 1, f"{name}: {stderr!r}"
        assert expected[name] in stderr, f"{name}: {stderr!r}"
        assert stdout == "", name


def test_from_run_stores_linear_weights_input_major_with_unchanged_output(run_dir):
    gen = Generator.from_run(run_dir)
    w = gen.model.blocks[0].attn.qkv.weight
    assert w.stride() == (1, w.shape[0])  # W^T contiguous, on CPU
    plain = Generator(load_model(run_dir), load_tokenizer(run_dir))  # as saved: row-major
    assert plain.model.blocks[0].attn.qkv.weight.is_contiguous()
    params = SamplingParams(temperature=0, max_new_tokens=24)
    assert gen.generate(["the fox"], params)[0].token_ids == plain.generate(["the fox"], params)[0].token_ids


def test_num_beams_prints_the_best_num_samples_hypotheses_of_the_library_search(run_dir, cli_env):
    out = cli("generate", "--model", str(run_dir), "--prompt", "the fox", "--max-new-tokens", "10", "--num-beams",
              "4", "--num-samples", "3", "--length-penalty", "0.5", "--early-stopping", "never", "--json",
              env=cli_env)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    gen = Generator.from_run(run_dir)
    want = gen.beam_search("the fox", 4, 10, 0.5, early_stopping="never", num_return_sequences=3)
    assert [line["token_ids"] for line in lines] == [r.token_ids for r in want]
    assert [line["text"] for line in lines] == [r.text for r in want]


def test_human_output_is_the_prompt_then_its_continuation_and_no_echo_leaves_the_prompt_out(run_dir, cli_env):
    common = ["generate", "--model", str(run_dir), "--prompt", "the fox", "--max-new-tokens", "12",
              "--temperature", "0"]
    want = api_result(run_dir, "the fox", temperature=0, max_new_tokens=12).text
    echoed = cli(*common, env=cli_env)
    plain = cli(*common, "--no-echo", env=cli_env)
    as_json = cli(*common, "--json", env=cli_env)
    assert echoed.returncode == plain.returncode == as_json.returncode == 0, echoed.stderr + plain.stderr
    assert echoed.stdout == "the fox" + want + "\n"  # as llama.cpp prints it: the text reads from its start
    assert plain.stdout == want + "\n"
    assert json.loads(as_json.stdout)["text"] == want  # --json: the generated text alone, as before


def test_verbose_timings_are_on_stderr_on_a_line_of_their_own(run_dir, cli_env):
    # stdout and stderr into one pipe, as `2>&1` or a terminal shows them
    out = subprocess.run([PYTHON, "-m", "tinyformer", "generate", "--model", str(run_dir), "--prompt", "the fox",
                          "--max-new-tokens", "8", "--temperature", "0", "--verbose"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=cli_env, timeout=120, encoding="utf-8")
    assert out.returncode == 0, out.stdout
    lines = out.stdout.splitlines()
    timing = [line for line in lines if "prefill:" in line]
    assert len(timing) == 1 and timing[0].startswith("prefill:"), out.stdout
    assert lines[lines.index(timing[0]) - 1].startswith("the fox")


def test_chat_replies_do_not_echo_the_user_turn(run_dir, cli_env):
    out = cli("chat", "--model", str(run_dir), "--temperature", "0", "--max-new-tokens", "6", "--separator", "",
              env=cli_env, stdin="the fox\n")
    assert out.returncode == 0, out.stderr
    assert not out.stdout.startswith("the fox"), out.stdout
