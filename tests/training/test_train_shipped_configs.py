"""The example run configs in configs/ are valid and describe the models they claim to."""

from __future__ import annotations

from pathlib import Path

import pytest

from tinyformer.config import ModelConfig
from tinyformer.data.tokenizer import DEFAULT_BPE_VOCAB_SIZE
from tinyformer.sizing import count_params
from tinyformer.training.train_config import TrainConfig, build_model_config, read_run_file

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def load(name: str) -> tuple[ModelConfig, TrainConfig]:
    sections = read_run_file(CONFIGS / name)
    return build_model_config(sections["model"]), TrainConfig.from_dict(sections["train"])


@pytest.mark.parametrize("name", ["default.yaml", "shakespeare_char.yaml", "bpe_15m.yaml"])
def test_shipped_config_is_valid(name: str) -> None:
    model, train = load(name)
    assert train.block_size is None or train.block_size <= model.max_seq_len


def test_default_yaml_is_what_train_does_without_arguments() -> None:
    model, train = load("default.yaml")
    assert model == build_model_config({})
    defaults = TrainConfig()
    # fields whose default is None ("derive it") are written out in the file with the derived value
    derived = {"block_size": model.max_seq_len, "vocab_size": DEFAULT_BPE_VOCAB_SIZE, "min_lr": defaults.lr_floor}
    for field, value in train.to_dict().items():
        assert value == derived.get(field, getattr(defaults, field)), field


def test_shakespeare_config_matches_the_gpt2_baseline_parameter_count() -> None:
    model, train = load("shakespeare_char.yaml")
    vocab = 68  # TinyShakespeare's 65 characters + the 3 special tokens
    gpt2 = ModelConfig(vocab_size=vocab, d_model=128, n_layer=4, n_head=4, max_seq_len=64, norm="layernorm",
                       pos="learned", ffn="gelu", attn_bias=True, attn_out_bias=True, mlp_bias=True)
    ours = count_params(model.replace(vocab_size=vocab)).total
    assert abs(ours - count_params(gpt2).total) / count_params(gpt2).total < 0.005
    assert (train.batch_size, train.block_size, train.max_steps, train.tokenizer) == (12, 64, 2000, "char")
    assert train.compile  # the recipe trains with the compiled loss by default (docs/benchmarks/training.md)


def test_bpe_15m_has_about_15m_parameters() -> None:
    model, train = load("bpe_15m.yaml")
    assert model.vocab_size == train.vocab_size == 8192
    assert 14e6 < count_params(model).total < 16e6
