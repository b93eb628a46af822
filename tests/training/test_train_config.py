"""TrainConfig validation, command-line overrides, the learning-rate schedule and AdamW parameter groups."""

from __future__ import annotations

import math

import pytest
import torch

from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError
from tinyformer.models import build_model
from tinyformer.training.optim import lr_at, param_groups
from tinyformer.training.train_config import (
    TrainConfig,
    apply_override,
    build_model_config,
    parse_value,
    read_run_file,
    to_yaml,
)


@pytest.mark.parametrize(
    "field, value",
    [("lr", -1.0), ("lr", 0.0), ("max_steps", 0), ("batch_size", 2.5), ("beta2", 1.0), ("val_fraction", 1.0),
     ("grad_clip", -0.1), ("lr_schedule", "step"), ("device", "tpu"), ("dtype", "int8"), ("keep_last", 0),
     ("block_size", 0), ("compile", "yes"), ("weight_decay", float("nan"))],
)
def test_invalid_train_field_raises_config_error_naming_it(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"train\.{field}"):
        TrainConfig(**{field: value})


def test_min_lr_above_lr_is_rejected() -> None:
    with pytest.raises(ConfigError, match="min_lr"):
        TrainConfig(lr=1e-3, min_lr=1e-2)


def test_vocab_size_with_char_tokenizer_is_rejected() -> None:
    with pytest.raises(ConfigError, match="vocab_size"):
        TrainConfig(tokenizer="char", vocab_size=100)


def test_unknown_train_field_is_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown train field.*learning_rate"):
        TrainConfig.from_dict({"learning_rate": 1e-3})


@pytest.mark.parametrize("text, expected", [("3e-4", 3e-4), ("1e3", 1000.0), ("12", 12), ("true", True),
                                            ("null", None), ("cosine", "cosine"), ("0.5", 0.5)])
def test_parse_value_reads_yaml_and_exponent_floats(text: str, expected: object) -> None:
    assert parse_value(text) == expected
    assert type(parse_value(text)) is type(expected)


def test_overrides_coerce_to_field_types_and_reject_unknown_fields() -> None:
    sections: dict = {"model": {}, "train": {}}
    apply_override(sections, "train.lr=1")  # an int for a float field
    apply_override(sections, "train.max_steps=1e3")  # a whole float for an int field
    apply_override(sections, "train.data=123")  # digits for a string field stay text
    apply_override(sections, "model.d_model=64")
    assert sections["train"] == {"lr": 1.0, "max_steps": 1000, "data": "123"}
    assert type(sections["train"]["lr"]) is float and type(sections["train"]["max_steps"]) is int
    with pytest.raises(ConfigError, match="model.d_modle is not a field"):
        apply_override(sections, "model.d_modle=64")
    with pytest.raises(ConfigError, match="must look like"):
        apply_override(sections, "lr=1e-3")


def test_model_section_takes_a_preset_plus_overrides_or_all_fields() -> None:
    tiny = build_model_config({})
    assert tiny.d_model == build_model_config({"preset": "tiny"}).d_model
    small = build_model_config({"preset": "tiny", "n_layer": 2})
    assert small.n_layer == 2 and small.d_model == tiny.d_model
    explicit = build_model_config({"d_model": 64, "n_layer": 1, "n_head": 2})
    assert explicit == ModelConfig(d_model=64, n_layer=1, n_head=2)
    with pytest.raises(ConfigError, match="unknown preset"):
        build_model_config({"preset": "nope"})


def test_resolved_yaml_round_trips(tmp_path) -> None:
    model = ModelConfig(d_model=64, n_layer=1, n_head=2, vocab_size=99)
    train = TrainConfig(lr=3e-4, max_steps=7, sample_prompt="\n", data="x.txt")
    path = tmp_path / "train.yaml"
    path.write_text(to_yaml(model, train))
    sections = read_run_file(path)
    assert build_model_config(sections["model"]) == model
    assert TrainConfig.from_dict(sections["train"]) == train


def _reference_lr(t: int, lr: float, floor: float, warmup: int, total: int) -> float:
    # independent restatement of nanoGPT's get_lr (with (t+1)/W warm-up)
    if t < warmup:
        return lr * (t + 1) / warmup
    if t > total:
        return floor
    ratio = (t - warmup) / (total - warmup)
    return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - floor)


def test_cosine_schedule_matches_reference_and_hits_its_landmarks() -> None:
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    for t in range(0, 130):
        assert lr_at(t, cfg) == pytest.approx(_reference_lr(t, 1e-3, 1e-4, 10, 110), rel=1e-12)
    assert lr_at(0, cfg) == pytest.approx(1e-4)  # lr / W
    assert lr_at(9, cfg) == pytest.approx(1e-3)  # end of warm-up: the peak
    assert lr_at(60, cfg) == pytest.approx(5.5e-4)  # halfway down: mean of peak and floor
    assert lr_at(110, cfg) == pytest.approx(1e-4) and lr_at(500, cfg) == pytest.approx(1e-4)


def test_linear_and_constant_schedules() -> None:
    lin = TrainConfig(lr=1.0, min_lr=0.0, warmup_steps=0, max_steps=10, lr_schedule="linear")
    assert [lr_at(t, lin) for t in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])
    const = TrainConfig(lr=2.0, warmup_steps=2, max_steps=10, lr_schedule="constant")
    assert [lr_at(t, const) for t in (0, 1, 2, 9, 50)] == pytest.approx([1.0, 2.0, 2.0, 2.0, 2.0])


@pytest.mark.parametrize("decay_embeddings", [True, False])
def test_weight_decay_goes_to_matrices_only(decay_embeddings: bool) -> None:
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layer=2, n_head=2, d_ff=64, norm="layernorm", pos="learned",
                      ffn="gelu", attn_bias=True, mlp_bias=True, tie_embeddings=True)
    model = build_model(cfg)
    decay, no_decay = param_groups(model, 0.1, decay_embeddings)
    decayed = {id(p) for p in decay["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    embeddings = {id(model.tok_emb.weight), id(model.pos_emb.weight)}
    for p in model.parameters():
        want = p.dim() >= 2 and (decay_embeddings or id(p) not in embeddings)
        assert (id(p) in decayed) == want, names[id(p)]
    # every parameter once, the tied head/embedding included exactly once
    all_ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert len(all_ids) == len(set(all_ids)) == len(list(model.parameters()))
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in no_decay["params"] if id(p) not in embeddings)
    assert torch.is_tensor(model.lm_head.weight) and model.lm_head.weight is model.tok_emb.weight
