import json
import subprocess
import sys

import pytest
import torch

from tinyformer.config import ModelConfig
from tinyformer.models import build_model
from tinyformer.presets import PRESETS, get_preset
from tinyformer.sizing import count_params, sizing_report


def meta_count(cfg):
    with torch.device("meta"):
        model = build_model(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_count_equals_meta_device_model(name):
    cfg = get_preset(name)
    assert count_params(cfg).total == meta_count(cfg)


def test_published_totals():
    assert count_params(get_preset("llama-7b")).total == 6_738_415_616
    assert count_params(get_preset("llama2-70b")).total == 68_976_648_192
    assert count_params(get_preset("gpt2-124m")).total == 124_439_808


@pytest.mark.parametrize(
    "kw",
    [
        dict(attn_bias=True),
        dict(attn_bias=True, attn_out_bias=True, mlp_bias=True),
        dict(norm="layernorm", norm_bias=False),
        dict(norm="layernorm", ffn="relu", pos="learned"),
        dict(ffn="gelu", pos="sinusoidal", tie_embeddings=False),
        dict(n_kv_head=1, head_dim=24),
        dict(final_norm=False, norm_placement="post"),
        dict(qk_norm=True, head_dim=16),
        dict(norm_placement="sandwich", ffn="geglu_tanh", norm_gain_offset=1.0, qk_norm=True),
    ],
)
def test_option_counts_equal_meta_device_model(kw):
    cfg = ModelConfig(vocab_size=101, d_model=48, n_layer=3, n_head=4, max_seq_len=20, **kw)
    assert count_params(cfg).total == meta_count(cfg)


def test_kv_cache_of_llama2_70b_with_and_without_gqa():
    rep = sizing_report(get_preset("llama2-70b"), seq_len=4096, batch=1, dtype="bfloat16")
    # 2 (K, V) x 80 layers x 8 kv heads x 128 dims x 2 bytes
    assert rep["kv_cache"]["bytes_per_token"] == 2 * 80 * 8 * 128 * 2
    assert rep["kv_cache"]["bytes_per_token_if_mha"] == 2 * 80 * 64 * 128 * 2
    assert rep["kv_cache"]["bytes_total"] == 2 * 80 * 8 * 128 * 2 * 4096


def test_training_flops_follow_6n_plus_attention_term():
    cfg = get_preset("gpt2-124m")
    rep = sizing_report(cfg, seq_len=1024)
    c = count_params(cfg)
    n_matmul = c.total - c.embedding - c.positions + cfg.vocab_size * cfg.d_model  # the head counts once
    assert rep["training_flops_per_token"] == 6 * n_matmul + 12 * 12 * 768 * 1024


def test_count_cli_json_prints_total(cli_env):
    out = subprocess.run(
        [sys.executable, "-m", "tinyformer", "count", "--preset", "llama-7b", "--json"],
        capture_output=True, text=True, env=cli_env, check=True,
    )
    data = json.loads(out.stdout)
    assert data["total_params"] == 6_738_415_616
    assert data["verified_on_meta_device"] is True


def test_count_cli_bad_preset_is_one_line_error(cli_env):
    out = subprocess.run(
        [sys.executable, "-m", "tinyformer", "count", "--preset", "llama-9000"],
        capture_output=True, text=True, env=cli_env,
    )
    assert out.returncode == 2
    assert "unknown preset 'llama-9000'" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_count_cli_reads_yaml_config(tmp_path, cli_env):
    path = tmp_path / "m.yaml"
    path.write_text("model:\n  preset: gpt2-124m\n  n_layer: 2\n")
    out = subprocess.run(
        [sys.executable, "-m", "tinyformer", "count", "--config", str(path), "--json"],
        capture_output=True, text=True, env=cli_env, check=True,
    )
    cfg = get_preset("gpt2-124m", n_layer=2)
    assert json.loads(out.stdout)["total_params"] == meta_count(cfg)
