"""Exact parameter counts of the classic presets: formula = model on the meta device = the published figure."""

from __future__ import annotations

import json

import pytest
import torch

from tinyformer.cli.main import main
from tinyformer.models import build_model
from tinyformer.presets import get_preset
from tinyformer.sizing import count_params

transformers = pytest.importorskip("transformers")


def _meta_count(cfg) -> int:
    with torch.device("meta"):
        model = build_model(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name, published", [
    ("gpt2-124m", 124_439_808),  # GPT2LMHeadModel (tied head)
    ("bert-base", 109_482_240),  # BertModel with its pooler
    ("transformer-base", 63_082_496),  # d 512, 6+6 layers, 37000 shared tokens (the paper rounds to 65M)
    ("gpt3-175b", None),
    ("bert-tiny", None),
    ("transformer-tiny", None),
])
def test_preset_counts_equal_the_meta_device_model(name, published):
    cfg = get_preset(name)
    total = count_params(cfg).total
    assert total == _meta_count(cfg)
    if published is not None:
        assert total == published


def test_bert_base_counts_like_transformers_bert_model():
    with torch.device("meta"):
        hf = transformers.BertModel(transformers.BertConfig())  # bert-base-uncased's shape
    assert sum(p.numel() for p in hf.parameters()) == count_params(get_preset("bert-base")).total


def test_count_cli_verifies_encoder_and_encoder_decoder(capsys):
    for name, total in (("bert-base", 109_482_240), ("transformer-base", 63_082_496)):
        assert main(["count", "--preset", name, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["total_params"] == total and report["verified_on_meta_device"] is True


def test_count_cli_reads_an_encoder_decoder_config_file(tmp_path, capsys):
    path = tmp_path / "model.yaml"
    path.write_text("model:\n  preset: transformer-base\n  share_src_tgt_embeddings: false\n  n_encoder_layer: 4\n")
    assert main(["count", "--config", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    cfg = get_preset("transformer-base", share_src_tgt_embeddings=False, n_encoder_layer=4)
    assert report["verified_on_meta_device"] and report["total_params"] == _meta_count(cfg)
    # a separate 37000 x 512 source table, and two encoder layers fewer
    per_encoder_layer = 3_152_384
    assert report["total_params"] == 63_082_496 + 37000 * 512 - 2 * per_encoder_layer
