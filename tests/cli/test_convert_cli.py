"""`tinyformer convert` as a user runs it: imports, exports, options, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from test_interop_common import (
    PYTHON_CLI,
    hf_logits,
    hf_model,
    padded_batch,
    pytestmark,  # noqa: F401 - one intra-op thread for every test here
    save_hf,
    write_gguf,
)

from tinyformer.cli.main import main
from tinyformer.run_folder import load_model, load_tokenizer

transformers = pytest.importorskip("transformers")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what the setup printed (transformers' progress bars)
    code = main(["convert", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_import_export_through_the_real_command_line(tmp_path, cli_env):
    model = hf_model("qwen2", tie_word_embeddings=True)
    save_hf(model, tmp_path / "hf")
    done = subprocess.run([*PYTHON_CLI, "convert", "--from-hf", tmp_path / "hf", "--out", tmp_path / "run"],
                          capture_output=True, text=True, env=cli_env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and "model.safetensors" in done.stdout
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "run" / name).is_file(), name
    assert load_tokenizer(tmp_path / "run").chat_template  # what `chat` needs
    assert main(["convert", "--model", str(tmp_path / "run"), "--to-hf", str(tmp_path / "out")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    ids, mask = padded_batch()
    torch.testing.assert_close(hf_logits(hf, ids, mask)[mask.bool()], hf_logits(model, ids, mask)[mask.bool()],
                               atol=1e-5, rtol=1e-5)


def test_dtype_and_sharded_output(tmp_path, capsys):
    model = hf_model("llama")
    save_hf(model, tmp_path / "hf", tokenizer=False)
    code, out, err = run_cli(capsys, "--from-hf", tmp_path / "hf", "--out", tmp_path / "run", "--dtype", "bfloat16",
                             "--max-shard-size", "40KB")
    assert code == 0, err
    index = json.loads((tmp_path / "run" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "bfloat16" in out
    ours = load_model(tmp_path / "run")
    assert ours.tok_emb.weight.dtype == torch.bfloat16
    code, _, err = run_cli(capsys, "--model", tmp_path / "run", "--to-hf", tmp_path / "out", "--dtype", "float32",
                           "--max-shard-size", "60KB")
    assert code == 0, err
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        want = load_model(tmp_path / "run", dtype=torch.float32)(ids, attention_mask=mask)
    torch.testing.assert_close(hf_logits(hf, ids, mask)[mask.bool()], want[mask.bool()], atol=1e-4, rtol=1e-4)


def test_gguf_import_from_the_command_line(tmp_path, capsys):
    write_gguf(hf_model("llama"), tmp_path / "m.gguf", qtype="Q8_0", tokenizer="gpt2")
    code, out, err = run_cli(capsys, "--from-gguf", tmp_path / "m.gguf", "--out", tmp_path / "run")
    assert code == 0, err
    assert "float32" in out and load_tokenizer(tmp_path / "run").chat_template


def _assert_one_line_error(code: int, err: str, pattern: str) -> None:
    import re

    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tinyformer convert: error:"), err
    assert re.search(pattern, lines[0]), lines[0]


def test_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    model = hf_model("llama")
    hf = save_hf(model, tmp_path / "hf", tokenizer=False)
    config = json.loads((hf / "config.json").read_text())

    falcon = {**config, "model_type": "falcon", "architectures": ["FalconForCausalLM"]}
    (hf / "config.json").write_text(json.dumps(falcon))
    _assert_one_line_error(*run_cli(capsys, "--from-hf", hf, "--out", tmp_path / "r")[::2], "falcon")

    (hf / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
    _assert_one_line_error(*run_cli(capsys, "--from-hf", hf, "--out", tmp_path / "r")[::2],
                           r"k_proj.weight has shape \[32, 64\], config.json implies \[64, 64\]")

    (hf / "config.json").write_text("{not json")
    _assert_one_line_error(*run_cli(capsys, "--from-hf", hf, "--out", tmp_path / "r")[::2], "not valid JSON")

    (hf / "config.json").write_text(json.dumps(config))
    weights = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(weights[:1000])
    _assert_one_line_error(*run_cli(capsys, "--from-hf", hf, "--out", tmp_path / "r")[::2], "truncated")
    (hf / "model.safetensors").write_bytes(weights)

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    _assert_one_line_error(*run_cli(capsys, "--from-hf", hf, "--out", tmp_path / "busy")[::2], "--force")

    write_gguf(hf_model("llama", vocab_size=320, hidden_size=256, intermediate_size=256, num_hidden_layers=1),
               tmp_path / "t.gguf", qtype="TQ2_0")
    _assert_one_line_error(*run_cli(capsys, "--from-gguf", tmp_path / "t.gguf", "--out", tmp_path / "r")[::2],
                           "TQ2_0")
    data = (tmp_path / "t.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:300])
    _assert_one_line_error(*run_cli(capsys, "--from-gguf", tmp_path / "cut.gguf", "--out", tmp_path / "r")[::2],
                           "cut.gguf")
    _assert_one_line_error(*run_cli(capsys, "--model", tmp_path / "nowhere", "--to-hf", tmp_path / "o")[::2],
                           "does not exist")
    _assert_one_line_error(*run_cli(capsys, "--from-hf", hf, "--to-hf", tmp_path / "o")[::2], "--out")
    _assert_one_line_error(*run_cli(capsys, "--model", hf, "--to-hf", tmp_path / "o")[::2],
                           "Hugging Face model folder.*--from-hf")
    assert not (tmp_path / "r").exists()


def test_imported_run_generates_and_fine_tunes_and_a_trained_run_exports(tmp_path, capsys):
    """The run folder an import writes is what generate and `train --init-from` read; the run that
    `tinyformer train` writes exports to a folder transformers loads with the same logits and tokens."""
    from test_interop_common import TEXT

    save_hf(hf_model("llama"), tmp_path / "hf")
    assert run_cli(capsys, "--from-hf", tmp_path / "hf", "--out", tmp_path / "run")[0] == 0
    assert main(["generate", "--model", str(tmp_path / "run"), "--prompt", "the quick", "--max-new-tokens", "4",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip()
    (tmp_path / "corpus.txt").write_text(TEXT * 4)
    code = main(["train", "--init-from", str(tmp_path / "run"), "--out", str(tmp_path / "ft"), "--data",
                 str(tmp_path / "corpus.txt"), "--steps", "2", "--batch-size", "2", "--block-size", "16",
                 "--eval-interval", "100", "--eval-iters", "1", "--sample-tokens", "2", "--no-progress",
                 "--threads", "1"])
    assert code == 0, capsys.readouterr().err
    assert run_cli(capsys, "--model", tmp_path / "ft", "--to-hf", tmp_path / "ft-hf")[0] == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ft-hf", local_files_only=True).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "ft-hf", local_files_only=True)
    tok = load_tokenizer(tmp_path / "ft")
    assert hf_tok("the lazy dog", add_special_tokens=False)["input_ids"] == tok.encode("the lazy dog")
    ids, mask = padded_batch()
    with torch.no_grad():
        want = load_model(tmp_path / "ft")(ids, attention_mask=mask)
    torch.testing.assert_close(hf_logits(hf, ids, mask)[mask.bool()], want[mask.bool()], atol=1e-4, rtol=1e-4)
