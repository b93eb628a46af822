"""Gemma 2 and Gemma 3 (text): (1 + g) RMSNorm, GeGLU-tanh, sqrt(d) embedding scale, sandwich norms, q/k norm,
alternating local/global layers with their own RoPE bases, soft-capping; checked against transformers'
Gemma2ForCausalLM / Gemma3ForCausalLM (random weights built offline)."""

from __future__ import annotations

import pytest
import torch
from test_interop_common import (
    assert_import_matches_transformers,
    pytestmark,  # noqa: F401 - one intra-op thread for every test here
)

from tinyformer.components.norm import RMSNorm
from tinyformer.config import ModelConfig
from tinyformer.run_folder import load_config

W = 6
CASES = {
    # layers: local, global (pattern 2), window 6 < prompt 24; soft-capping small enough to bend these weights
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=W, query_pre_attn_scalar=24,
                              attn_logit_softcapping=0.01, final_logit_softcapping=0.1)),
    # local, global with their own RoPE bases and linear scaling on the global layer only; q/k norms
    "gemma3": ("gemma3_text", dict(head_dim=16, sliding_window=W, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention", "full_attention"],
                                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                       "rope_theta": 1_000_000.0},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 10_000.0}})),
    "gemma3-tied-bias": ("gemma3_text", dict(head_dim=16, sliding_window=W, attention_bias=True,
                                             tie_word_embeddings=True, layer_types=["full_attention",
                                                                                    "sliding_attention"])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gemma_import_matches_transformers(case, tmp_path):
    kind, overrides = CASES[case]
    assert_import_matches_transformers(kind, tmp_path, length=24, **overrides)
    cfg = load_config(tmp_path / "run")
    assert (cfg.norm_placement, cfg.ffn, cfg.norm_gain_offset, cfg.embed_scale) == ("sandwich", "geglu_tanh", 1.0,
                                                                                    True)
    assert cfg.qk_norm == (kind == "gemma3_text") and cfg.sliding_window == W


def test_offset_rmsnorm_is_x_over_rms_times_one_plus_g():
    norm = RMSNorm(8, eps=1e-6, offset=1.0)
    assert torch.equal(norm.weight, torch.zeros(8))  # an effective gain of 1 at initialisation
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 8, dtype=torch.float64)
    want = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * (1 + norm.weight.double())
    torch.testing.assert_close(norm.double()(x), want)


def test_soft_capped_logits_stay_inside_the_cap_and_train():
    from tinyformer.models.decoder import DecoderLM

    cfg = ModelConfig(vocab_size=32, d_model=16, n_layer=1, n_head=2, d_ff=32, max_seq_len=16, init_std=1.0,
                      final_logit_softcap=2.0, attn_logit_softcap=1.0)
    model = DecoderLM(cfg)
    x = torch.randint(0, 32, (2, 8))
    logits = model(x)
    assert logits.abs().max() < 2.0
    loss = model.loss(x[:, :-1], x[:, 1:])
    want = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    torch.testing.assert_close(loss, want)


def test_gemma3_gguf_matches_transformers_gguf_loader(tmp_path):
    """llama.cpp's layout: Gemma's norm gains stored as 1 + g, four norms per layer, a sliding window."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    import transformers
    from test_interop_common import hf_logits, hf_model, padded_batch, write_gguf

    from tinyformer.interop.gguf import import_gguf
    from tinyformer.run_folder import load_model

    # transformers' loader takes query_pre_attn_scalar and the layer pattern from Gemma3TextConfig's defaults
    # (256; every 6th layer global): the model here has them too
    model = hf_model("gemma3_text", vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                     num_attention_heads=1, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                     sliding_window=W)
    write_gguf(model, tmp_path / "model.gguf", qtype="F32", arch="gemma3")
    import_gguf(tmp_path / "model.gguf", tmp_path / "run")
    cfg = load_config(tmp_path / "run")
    assert (cfg.sliding_window, cfg.norm_placement, cfg.qk_norm) == (W, "sandwich", True)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf", local_files_only=True,
                                                               dtype=torch.float32).eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        logits = load_model(tmp_path / "run")(ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(logits[real], hf_logits(theirs, ids, mask)[real], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[real], hf_logits(model, ids, mask)[real], atol=1e-4, rtol=1e-4)
