"""Small things a new user meets on the first run: labels and summaries that say what is true, defaults
that do not overwrite tracked files, flags that accept what the other commands accept."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinyformer.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def test_inspect_labels_the_cumulative_column_as_within_top_k():
    from tinyformer.generation.sampling import SamplingParams
    from tinyformer.inspect.next_token import distribution_from_logits, format_table

    logits = torch.randn(30, generator=torch.Generator().manual_seed(0)) * 2
    table = format_table(distribution_from_logits(logits, SamplingParams(top_k=5, top_p=0.9)), str, 8)
    header, *rows = table.splitlines()
    assert "cum p in top-k" in header and "renormalised over the top-5 tokens" in table
    # the column really is cumulative over the top-k set: the 5th row reaches 1
    probs = torch.softmax(logits.double(), -1)
    top5 = torch.sort(probs, descending=True, stable=True).values[:5]
    cums = [float(r.split()[4]) for r in rows if re.match(r"^\s+\d+\s+\d+\s", r)]
    assert cums[4] == pytest.approx(1.0, abs=1e-4)
    assert cums[0] == pytest.approx(float(top5[0] / top5.sum()), abs=1e-4)
    plain = format_table(distribution_from_logits(logits, SamplingParams(top_p=0.9)), str, 3)
    assert "top-k" not in plain.splitlines()[0]


def test_serve_accepts_dtype_auto_like_generate():
    args = build_parser().parse_args(["serve", "--model", "RUN", "--dtype", "auto"])
    assert args.dtype == "auto"
    from tinyformer.devices import resolve_dtype

    assert resolve_dtype(args.dtype, torch.device("cpu")) == torch.float32


def test_convert_help_lists_every_supported_family(capsys):
    from tinyformer.families import adapters

    assert {"llama", "mistral", "qwen2", "gpt2", "bert"} <= {t for a in adapters() for t in a.model_types}
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = re.sub(r"-\s+", "-", " ".join(capsys.readouterr().out.split()))  # argparse wraps at hyphens
    for family in ("Llama", "Mistral", "Qwen2", "GPT-2", "BERT", "sentence-transformers"):
        assert family in text, family


def test_convert_summary_names_the_position_encoding(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2,
                                                                n_positions=16))
    gpt2.save_pretrained(tmp_path / "gpt2")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16))
    llama.save_pretrained(tmp_path / "llama")
    capsys.readouterr()
    assert main(["convert", "--from-hf", str(tmp_path / "gpt2"), "--out", str(tmp_path / "g")]) == 0
    out = capsys.readouterr().out
    assert "learned positions" in out and "rope" not in out
    assert main(["convert", "--from-hf", str(tmp_path / "llama"), "--out", str(tmp_path / "l")]) == 0
    assert re.search(r"context 16, rope\b", capsys.readouterr().out)


def test_attention_memory_refuses_to_overwrite_without_being_asked(tmp_path):
    figure = tmp_path / "attention_memory.png"
    figure.write_bytes(b"tracked figure")
    script = ROOT / "benchmarks" / "attention_memory.py"
    done = subprocess.run([sys.executable, str(script), "--png", str(figure), "--seq-lens", "64"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--overwrite" in done.stderr
    assert figure.read_bytes() == b"tracked figure"


def test_a_build_lock_left_by_a_stopped_build_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch, capsys):
    """torch's builder waits for its lock file to go: one left by a killed build would hang every later run."""
    import os
    import time

    from torch.utils import cpp_extension

    from tinyformer.components import quant_kernels

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path / name))
    assert quant_kernels.clear_stale_lock("kernels_abc") is False  # no lock at all
    lock = tmp_path / "kernels_abc" / "lock"
    lock.parent.mkdir()
    lock.write_bytes(b"")
    assert quant_kernels.clear_stale_lock("kernels_abc") is False and lock.exists()  # a build running now
    old = time.time() - quant_kernels.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert quant_kernels.clear_stale_lock("kernels_abc") is True and not lock.exists()
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "stale build lock" in err


def test_the_kernel_build_says_it_is_compiling_and_where_it_is_cached_only_when_it_is(tmp_path, monkeypatch, capsys):
    from torch.utils import cpp_extension

    from tinyformer.components import quant_kernels

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path / name))
    assert quant_kernels.announce_build("kernels_abc") is True
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "compiling the CPU kernels" in err
    assert f"cached in {tmp_path / 'kernels_abc'}" in err
    (tmp_path / "kernels_abc").mkdir()
    (tmp_path / "kernels_abc" / "kernels_abc.so").write_bytes(b"")  # built before: loading it is quick
    assert quant_kernels.announce_build("kernels_abc") is False
    assert capsys.readouterr().err == ""


def test_the_compile_notice_names_inductors_cache(monkeypatch, tmp_path):
    from tinyformer.cli.common import compile_notice

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    line = compile_notice("the decode step")
    assert "torch.compile builds the decode step" in line and f"cached in {tmp_path / 'inductor'}" in line


README_OUTPUT_FLAGS = re.compile(r"--(?:out|to-hf|to-peft|to-gguf) (\S+)")


def test_readme_examples_write_under_runs_which_git_ignores():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    commands = [line.split("  #")[0] for block in blocks for line in block.splitlines()]  # comments left out
    outputs = [m for command in commands for m in README_OUTPUT_FLAGS.findall(command)]
    assert len(outputs) >= 15
    assert all(out.startswith("runs/") for out in outputs), [o for o in outputs if not o.startswith("runs/")]
    assert "runs/" in (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()


def test_readme_says_how_to_get_the_cpu_build_of_torch_without_changing_the_set_up_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in readme
    assert "pulls the CUDA build" in readme
    assert ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . && "
            "tinyformer train --out runs/default && tinyformer generate --model runs/default --prompt "
            '"The function returns"') in readme
    assert ('python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[test]" '
            "&& python -m pytest -q") in readme
