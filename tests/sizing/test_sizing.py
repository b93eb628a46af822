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


# Totals published for these shapes (model cards / the counts of the official Hugging Face checkpoints:
# sum of parameter sizes, tied tensors once). GPT-3's paper only rounds (175.0B).
PUBLISHED = {
    "llama-7b": 6_738_415_616,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3.1-8b": 8_030_261_248,
    "gpt2-124m": 124_439_808,
    "gpt2-350m": 354_823_168,
    "gpt3-175b": 174_604_259_328,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_totals(name):
    assert count_params(get_preset(name)).total == PUBLISHED[name]


def _transformers_model(cfg: ModelConfig):
    """The same shape as a Hugging Face model (an independent implementation), built on the meta device."""
    import transformers

    if cfg.ffn == "moe":
        hf_cfg = transformers.MixtralConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
            num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
            head_dim=cfg.head_dim, num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
            tie_word_embeddings=cfg.tie_embeddings)
        cls = transformers.MixtralForCausalLM
    elif cfg.ffn == "swiglu":
        hf_cfg = transformers.LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
            num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
            tie_word_embeddings=cfg.tie_embeddings)
        cls = transformers.LlamaForCausalLM
    else:
        hf_cfg = transformers.GPT2Config(vocab_size=cfg.vocab_size, n_embd=cfg.d_model, n_layer=cfg.n_layer,
                                         n_head=cfg.n_head, n_positions=cfg.max_seq_len, n_inner=cfg.d_ff)
        cls = transformers.GPT2LMHeadModel
    with torch.device("meta"):
        return cls(hf_cfg)


@pytest.mark.parametrize("name", [n for n in sorted(PRESETS) if get_preset(n).arch == "decoder"])
def test_decoder_preset_counts_like_transformers_built_from_the_same_shape(name):
    pytest.importorskip("transformers")
    cfg = get_preset(name)
    hf = _transformers_model(cfg)
    assert count_params(cfg).total == sum(p.numel() for p in hf.parameters())


def test_weight_tying_saves_vocab_times_d_parameters():
    """Tying the head to the embedding removes one V x d matrix (131,072,000 for LLaMA-7B), not 1/V of it."""
    cfg = get_preset("llama-7b")
    untied, tied = meta_count(cfg), meta_count(cfg.replace(tie_embeddings=True))
    assert untied - tied == cfg.vocab_size * cfg.d_model
    assert count_params(cfg).total - count_params(cfg.replace(tie_embeddings=True)).total == untied - tied


@pytest.mark.parametrize("dtype, batch, seq_len", [("float32", 2, 16), ("bfloat16", 3, 8), ("float16", 1, 5)])
def test_attention_score_memory_is_the_size_of_the_tensors_the_kernels_build(dtype, batch, seq_len):
    """naive: one (B, H, T, T) score matrix per layer in the compute dtype, B H T^2 bytes_per_element; all
    layers keep theirs for backward. SDPA (flash): only the (B, H, T) float32 log-sum-exp per layer."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layer=3, n_head=4, max_seq_len=32)
    mem = sizing_report(cfg, seq_len=seq_len, batch=batch, dtype=dtype)["attention_memory"]
    q = torch.randn(batch, cfg.n_head, seq_len, cfg.head_dim).to(getattr(torch, dtype))
    scores = q @ q.transpose(-2, -1)
    assert mem["naive_scores_bytes_per_layer"] == scores.numel() * scores.element_size()
    assert mem["naive_scores_bytes_all_layers"] == cfg.n_layer * mem["naive_scores_bytes_per_layer"]
    _, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, is_causal=True)[:2]
    assert mem["sdpa_bytes_per_layer"] == logsumexp.numel() * logsumexp.element_size()


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
