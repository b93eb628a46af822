"""Qwen3: per-head RMSNorm of q and k before RoPE (qk_norm), explicit head_dim; checked against transformers'
Qwen3ForCausalLM (random weights built offline) and its GGUF loader."""

from __future__ import annotations

import pytest
import torch
from test_interop_common import (
    assert_import_matches_transformers,
    hf_logits,
    hf_model,
    padded_batch,
    pytestmark,  # noqa: F401 - one intra-op thread for every test here
    write_gguf,
)

from tinyformer.config import ModelConfig
from tinyformer.interop.gguf import import_gguf
from tinyformer.models.decoder import DecoderLM
from tinyformer.run_folder import load_config, load_model

CASES = {
    "plain": {},
    # head_dim (Qwen3Config's default 128, or 24) != hidden / heads = 16: the explicit head_dim is kept
    "head-dim-bias-tied": dict(head_dim=24, attention_bias=True, tie_word_embeddings=True),
    # layer 0 full, layer 1 sliding with a window of 6, prompts of 24
    "sliding": dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_qwen3_import_matches_transformers(case, tmp_path):
    hf, _ = assert_import_matches_transformers("qwen3", tmp_path, length=24, **CASES[case])
    cfg = load_config(tmp_path / "run")
    assert cfg.qk_norm and cfg.head_dim == hf.config.head_dim != 64 // 4


def test_qk_norm_is_rmsnorm_of_each_head_before_rope():
    """q_norm against the formula q_h / sqrt(mean(q_h^2) + eps) * g, with RoPE off (pos='none')."""
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layer=1, n_head=4, n_kv_head=2, d_ff=32, pos="none",
                      qk_norm=True, attn_impl="reference")
    torch.manual_seed(0)
    attn = DecoderLM(cfg).blocks[0].attn.double()
    with torch.no_grad():
        attn.q_norm.weight.normal_()
        attn.k_norm.weight.normal_()
        x = torch.randn(1, 5, 32, dtype=torch.float64)
        q, k, v = attn.qkv(x).split((32, 16, 16), -1)

        def rms(t, g, heads):
            t = t.view(1, 5, heads, 8)
            return (t / (t.pow(2).mean(-1, keepdim=True) + cfg.norm_eps).sqrt() * g).transpose(1, 2)

        q, k = rms(q, attn.q_norm.weight, 4), rms(k, attn.k_norm.weight, 2).repeat_interleave(2, 1)
        v = v.view(1, 5, 2, 8).transpose(1, 2).repeat_interleave(2, 1)
        scores = (q @ k.transpose(-1, -2)) / 8**0.5 + torch.full((5, 5), float("-inf")).triu(1)
        want = attn.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(1, 5, 32))
        torch.testing.assert_close(attn(x), want)


def test_qwen3_gguf_matches_transformers_gguf_loader(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    import transformers

    # transformers' qwen3 GGUF loader ignores attention.key_length and takes Qwen3Config's head_dim (128)
    model = hf_model("qwen3", vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    write_gguf(model, tmp_path / "model.gguf", qtype="Q8_0", arch="qwen3")
    import_gguf(tmp_path / "model.gguf", tmp_path / "run")
    assert load_config(tmp_path / "run").qk_norm
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf", local_files_only=True,
                                                               dtype=torch.float32).eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        logits = load_model(tmp_path / "run")(ids, attention_mask=mask)
    torch.testing.assert_close(logits[mask.bool()], hf_logits(theirs, ids, mask)[mask.bool()], atol=1e-4, rtol=1e-4)
    # and against the float model it was written from (Q8_0 rounding: loose)
    torch.testing.assert_close(logits[mask.bool()], hf_logits(model, ids, mask)[mask.bool()], atol=0.05, rtol=0.05)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_qk_norm_in_one_call_is_the_per_head_formula(offset):
    """q and k heads normalised together: x / sqrt(mean(x^2) + eps) * (offset + g), g_q on the query heads and g_k
    on the key heads; bfloat16 (the two-norm path) agrees within its rounding."""
    from tinyformer.components.attention import SelfAttention

    cfg = ModelConfig(d_model=64, n_head=4, n_kv_head=2, head_dim=16, qk_norm=True, norm_gain_offset=offset,
                      norm_eps=1e-6)
    attn = SelfAttention(cfg).double()
    with torch.no_grad():
        attn.q_norm.weight.normal_()
        attn.k_norm.weight.normal_()
    qk = torch.randn(2, 6, 5, 16, dtype=torch.float64)
    unit = qk / (qk.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    want = torch.cat([unit[:, :4] * (offset + attn.q_norm.weight), unit[:, 4:] * (offset + attn.k_norm.weight)], 1)
    with torch.no_grad():
        torch.testing.assert_close(attn._norm_qk(qk), want, rtol=1e-12, atol=1e-12)
        half = attn.to(torch.bfloat16)._norm_qk(qk.to(torch.bfloat16))
    torch.testing.assert_close(half.double(), want, rtol=2e-2, atol=2e-2)


def test_a_moe_with_qkv_biases_only_is_written_as_qwen3_moe_with_a_zero_output_bias(tmp_path):
    """Qwen3-MoE's attention_bias means q, k, v *and* o biases: a model with only q/k/v biases is written with an
    all-zero o_proj bias (adding zero changes nothing), as Llama and Qwen3 are, so that transformers and the import
    find every tensor the config.json implies."""
    transformers = pytest.importorskip("transformers")
    from tinyformer.interop.hf_folder import export_hf, import_hf
    from tinyformer.run_folder import save_model

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layer=1, n_head=4, n_kv_head=2, head_dim=8, d_ff=16, max_seq_len=32,
                      norm="rmsnorm", pos="rope", ffn="moe", n_experts=4, experts_per_token=2, router_norm_topk=True,
                      qk_norm=True, attn_bias=True, tie_embeddings=False)
    model = DecoderLM(cfg).eval()
    save_model(tmp_path / "run", model, cfg)
    export_hf(tmp_path / "run", tmp_path / "hf")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert hf.config.model_type == "qwen3_moe" and not info["missing_keys"]
    assert torch.equal(hf.model.layers[0].self_attn.o_proj.bias, torch.zeros(32))
    import_hf(tmp_path / "hf", tmp_path / "back")
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "back")(ids), model(ids))
