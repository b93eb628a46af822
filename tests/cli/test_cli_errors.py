"""User mistakes end as ONE line on stderr and exit code 2, never a traceback (README's promise).

Each case is a file or flag value found to end in a traceback (UnicodeDecodeError, KeyError, an allocator
RuntimeError, a gloo error) or a wrong message. The commands run in this process through ``main``: an
exception that is not a TinyformerError propagates and fails the test with its traceback.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tinyformer.cli.main import main

BINARY = bytes(range(256)) * 4  # not UTF-8: 0x80 cannot start a character
CORPUS = "the quick brown fox jumps over the lazy dog.\n" * 60


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny finished run (char tokenizer, 2 steps, a checkpoint at step 2)."""
    root = tmp_path_factory.mktemp("errors")
    (root / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    run = root / "run"
    rc = main(["train", "--data", str(root / "corpus.txt"), "--tokenizer", "char", "--out", str(run),
               "--model.d_model", "16", "--model.n_layer", "1", "--model.n_head", "2", "--model.max_seq_len", "16",
               "--steps", "2", "--batch-size", "2", "--eval-interval", "2", "--eval-iters", "1",
               "--sample-tokens", "4", "--threads", "1", "--no-progress"])
    assert rc == 0
    return run


@pytest.fixture
def run(trained, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def fails_in_one_line(argv: list[str], capsys, *expected: str) -> str:
    """Run the CLI; require exit code 2 and one line on stderr containing every ``expected`` piece."""
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own usage errors (choices) also exit 2
        rc = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1, err
    for piece in expected:
        assert piece in lines[-1], lines[-1]
    return lines[-1]


# ---------------------------------------------------------------------------- files that are not UTF-8


def test_binary_config_json_is_one_line_for_generate(run, capsys):
    (run / "config.json").write_bytes(BINARY)
    fails_in_one_line(["generate", "--model", str(run), "--prompt", "the"], capsys, "config.json", "not UTF-8")


def test_binary_config_file_is_one_line_for_train(tmp_path, capsys):
    (tmp_path / "run.yaml").write_bytes(BINARY)
    fails_in_one_line(["train", "--config", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "r")], capsys,
                      "run.yaml", "not UTF-8")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("name", ["train.yaml", "metrics.jsonl", "samples.txt"])
def test_binary_run_file_is_one_line_for_resume(run, capsys, name):
    (run / name).write_bytes(BINARY)
    fails_in_one_line(["train", "--resume", str(run), "--steps", "3", "--no-progress"], capsys, name,
                      "not UTF-8")


def test_trainer_json_without_optimizer_is_one_line_for_resume(run, capsys):
    ckpt = max((run / "state").glob("step-*"))
    meta = json.loads((ckpt / "trainer.json").read_text())
    del meta["optimizer"]
    (ckpt / "trainer.json").write_text(json.dumps(meta))
    fails_in_one_line(["train", "--resume", str(run), "--steps", "3", "--no-progress"], capsys, "trainer.json",
                      "'optimizer'")


# ---------------------------------------------------------------------------- values


def test_absurd_max_seq_len_says_what_would_be_allocated(tmp_path, capsys):
    from tinyformer.config import ModelConfig
    from tinyformer.sizing import count_params

    line = fails_in_one_line(["train", "--set", "model.max_seq_len=1000000000000", "--out", str(tmp_path / "r"),
                              "--no-progress"], capsys, "would allocate", "max_seq_len=1,000,000,000,000")
    # the figure is the formula's: tiny preset, RoPE tables 2 * T * d_h float32
    from tinyformer.presets import get_preset

    cfg: ModelConfig = get_preset("tiny", max_seq_len=10**12)
    params, tables = count_params(cfg).total * 4, 2 * 10**12 * cfg.head_dim * 4
    assert f"{(params + tables) / 1e12:.1f} TB" in line
    assert not (tmp_path / "r").exists()


def test_generate_on_the_meta_device_is_refused(run, capsys):
    fails_in_one_line(["generate", "--model", str(run), "--prompt", "the", "--device", "meta"], capsys,
                      "'meta'", "cannot run a model")


def test_eval_on_the_meta_device_is_refused(run, tmp_path, capsys):
    (tmp_path / "t.txt").write_text(CORPUS)
    fails_in_one_line(["eval", "--model", str(run), "--data", str(tmp_path / "t.txt"), "--device", "meta"], capsys,
                      "'meta'", "cannot run a model")


def test_inspect_out_naming_a_file_is_refused(run, tmp_path, capsys):
    (tmp_path / "taken").write_text("keep me")
    fails_in_one_line(["inspect", "--model", str(run), "--prompt", "the", "--out", str(tmp_path / "taken")], capsys,
                      "is a file")
    assert (tmp_path / "taken").read_text() == "keep me"


def test_bad_parallel_value_with_nproc_is_one_line_before_any_process_starts(tmp_path, capsys, monkeypatch):
    import tinyformer.training.distributed as distributed

    def no_launch(*args, **kwargs):
        raise AssertionError("workers were launched with an invalid config")

    monkeypatch.setattr(distributed, "launch", no_launch)
    fails_in_one_line(["train", "--parallel", "bogus", "--nproc", "2", "--out", str(tmp_path / "r")], capsys,
                      "train.parallel='bogus'")


def test_yaml_syntax_error_is_one_line_with_file_line_and_column(tmp_path, capsys):
    import yaml

    text = "train:\n  lr: 0.1\n  steps: [1, 2\nmodel: {}\n"
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(yaml.MarkedYAMLError) as info:
        yaml.safe_load(text)
    mark = info.value.problem_mark
    fails_in_one_line(["train", "--config", str(tmp_path / "bad.yaml")], capsys, "bad.yaml",
                      f"line {mark.line + 1}, column {mark.column + 1}")


def test_too_small_bpe_vocabulary_names_the_minimum(tmp_path, capsys):
    from tinyformer.data.tokenizer import SPECIAL_TOKENS

    fails_in_one_line(["train", "--vocab-size", "100", "--out", str(tmp_path / "r")], capsys, "too small",
                      f"minimum is {256 + len(SPECIAL_TOKENS)}")


def test_eval_block_size_zero_is_rejected(run, tmp_path, capsys):
    (tmp_path / "t.txt").write_text(CORPUS)
    fails_in_one_line(["eval", "--model", str(run), "--data", str(tmp_path / "t.txt"), "--block-size", "0"], capsys,
                      "--block-size must be positive")


def test_eval_dtype_int8_is_rejected(run, tmp_path, capsys):
    (tmp_path / "t.txt").write_text(CORPUS)
    fails_in_one_line(["eval", "--model", str(run), "--data", str(tmp_path / "t.txt"), "--dtype", "int8"], capsys,
                      "int8")


# ---------------------------------------------------------------------------- the real reason, not "empty corpus"


def test_bpe_on_jsonl_without_the_text_field_names_the_field(tmp_path):
    from tinyformer.errors import DataError
    from tinyformer.training.prepare import train_tokenizer
    from tinyformer.training.train_config import TrainConfig

    (tmp_path / "x.jsonl").write_text(json.dumps({"body": "hello there"}) + "\n")
    with pytest.raises(DataError, match="no field 'text'"):
        train_tokenizer(TrainConfig(data=str(tmp_path / "x.jsonl"), tokenizer="bpe", vocab_size=300))


def test_bpe_on_hf_data_without_datasets_says_to_install_it(monkeypatch):
    from tinyformer.errors import DataError
    from tinyformer.training.prepare import train_tokenizer
    from tinyformer.training.train_config import TrainConfig

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(DataError, match="needs the `datasets` package"):
        train_tokenizer(TrainConfig(data="hf:some/dataset", tokenizer="bpe", vocab_size=300))


def test_bare_tinyformer_prints_help_and_exits_0(capsys):
    assert main([]) == 0
    assert "usage: tinyformer" in capsys.readouterr().out


def test_init_from_says_what_it_loaded_and_a_long_warm_up_is_mentioned(trained, tmp_path, capsys):
    from tinyformer.run_folder import load_model
    from tinyformer.training.optim import lr_at
    from tinyformer.training.train_config import TrainConfig

    (tmp_path / "c.txt").write_text(CORPUS)
    capsys.readouterr()
    assert main(["train", "--init-from", str(trained), "--data", str(tmp_path / "c.txt"), "--out",
                 str(tmp_path / "ft"), "--steps", "1", "--batch-size", "2", "--eval-interval", "1", "--eval-iters",
                 "1", "--sample-tokens", "0", "--warmup-steps", "5", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"initialised from {trained}" in out and "char tokenizer" in out
    n_params = sum(p.numel() for p in load_model(trained).parameters())
    assert f"its weights ({n_params:,} parameters" in out
    cfg = TrainConfig(max_steps=1, warmup_steps=5)
    assert "warm-up (5 steps) is not shorter than the run (1 steps)" in out
    assert f"to {lr_at(0, cfg):g} at the last step" in out


def test_an_unknown_field_beside_a_preset_is_one_line_for_count(tmp_path, capsys):
    (tmp_path / "model.yaml").write_text("model:\n  preset: tiny\n  d_modle: 64\n", encoding="utf-8")
    fails_in_one_line(["count", "--config", str(tmp_path / "model.yaml")], capsys,
                      "unknown model field(s): d_modle")
