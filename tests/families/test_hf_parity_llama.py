"""Logits parity with transformers.LlamaForCausalLM / Qwen2ForCausalLM built offline from the same config."""

import pytest
import torch

from tinyformer.config import ModelConfig
from tinyformer.families import config_to_hf, tinyformer_to_hf
from tinyformer.models.decoder import DecoderLM

transformers = pytest.importorskip("transformers")


def hf_twin(model: DecoderLM):
    hf_cfg = config_to_hf(model.cfg)
    cls = transformers.Qwen2ForCausalLM if hf_cfg["model_type"] == "qwen2" else transformers.LlamaForCausalLM
    config_cls = transformers.Qwen2Config if hf_cfg["model_type"] == "qwen2" else transformers.LlamaConfig
    config = config_cls(**{k: v for k, v in hf_cfg.items() if k != "architectures"})
    config._attn_implementation = "eager"
    hf = cls(config).eval()
    missing, unexpected = hf.load_state_dict(dict(tinyformer_to_hf(model.cfg, model.state_dict())), strict=False)
    assert not unexpected
    assert all("rotary" in m for m in missing) or (model.cfg.tie_embeddings and missing == ["lm_head.weight"])
    return hf


CASES = {
    "gqa-untied": dict(n_kv_head=2, tie_embeddings=False),
    "mha-tied": dict(n_kv_head=4, tie_embeddings=True),
    "linear": dict(n_kv_head=2, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "dynamic": dict(n_kv_head=2, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "llama3": dict(n_kv_head=1, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2-bias": dict(n_kv_head=2, attn_bias=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_equal_transformers(case):
    cfg = ModelConfig(vocab_size=128, d_model=64, n_layer=2, n_head=4, d_ff=96, max_seq_len=64,
                      rope_theta=10000.0, norm_eps=1e-6, **CASES[case])
    model = DecoderLM(cfg).eval()
    with torch.no_grad():  # non-trivial biases and norm gains, so a mis-mapping cannot hide
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf = hf_twin(model)
    x = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    # padded batch (left padding, as generate uses)
    am = torch.ones(2, 24, dtype=torch.long)
    am[1, :7] = 0
    with torch.no_grad():
        ours = model(x, attention_mask=am)
        pos = (am.cumsum(-1) - 1).clamp_min(0)
        theirs = hf(x, attention_mask=am, position_ids=pos).logits
    torch.testing.assert_close(ours[am.bool()], theirs[am.bool()], atol=1e-4, rtol=1e-4)
