import math

import pytest
import torch

from tinyformer.components.rope import RotaryEmbedding, apply_rope, default_inv_freq, rope_inv_freq
from tinyformer.config import ModelConfig


def _cfg(**kw):
    base = dict(vocab_size=10, d_model=64, n_head=2, max_seq_len=4096, rope_theta=10000.0)
    return ModelConfig(**{**base, **kw})


def test_inv_freq_formula():
    inv = default_inv_freq(32, 10000.0).double()
    expected = torch.tensor([10000.0 ** (-2 * i / 32) for i in range(16)], dtype=torch.float64)
    torch.testing.assert_close(inv, expected, rtol=1e-6, atol=0)


def test_rope_dot_product_depends_only_on_relative_position():
    cfg = _cfg(d_model=32, n_head=1)
    rope = RotaryEmbedding(cfg)
    q, k = torch.randn(32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)

    def rotated(x, m):
        cos, sin = rope(m, 1)
        return apply_rope(x.view(1, 1, 1, -1), cos.double(), sin.double()).view(-1)

    for delta in (0, 3, 17):
        values = [float(rotated(q, m + delta) @ rotated(k, m)) for m in (0, 5, 100, 1000)]
        assert max(values) - min(values) < 1e-4, (delta, values)
    # and it does depend on the offset
    assert abs(float(rotated(q, 3) @ rotated(k, 0)) - float(rotated(q, 7) @ rotated(k, 0))) > 1e-3


def test_rope_is_a_rotation_preserving_norm():
    cfg = _cfg(d_model=32, n_head=1)
    rope = RotaryEmbedding(cfg)
    x = torch.randn(1, 1, 50, 32)
    cos, sin = rope(0, 50)
    torch.testing.assert_close(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)


SCALINGS = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 16,
     "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 512},
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s["rope_type"] + str(len(s)))
def test_rope_scaling_matches_hugging_face(scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tinyformer.families import config_to_hf

    cfg = _cfg(d_model=128, n_head=2, rope_theta=50000.0, rope_scaling=dict(scaling))
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in config_to_hf(cfg).items() if k != "architectures"})
    fn = ROPE_INIT_FUNCTIONS[cfg.rope_type]
    seq_lens = [None, 8192] if cfg.rope_type == "dynamic" else [None]
    for seq_len in seq_lens:
        hf_inv, hf_factor = fn(hf_cfg, "cpu", seq_len) if seq_len else fn(hf_cfg, "cpu")
        ours, factor = rope_inv_freq(cfg, seq_len=seq_len)
        torch.testing.assert_close(ours, hf_inv.float(), rtol=1e-6, atol=1e-12)
        assert factor == pytest.approx(hf_factor, rel=1e-9)
    # the scaling must actually change the frequencies (dynamic NTK only beyond the original context)
    longest = 8192 if cfg.rope_type == "dynamic" else None
    assert not torch.allclose(rope_inv_freq(cfg, seq_len=longest)[0], default_inv_freq(64, 50000.0))


def test_yarn_attention_factor_scales_cos_and_sin():
    cfg = _cfg(rope_scaling={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256})
    rope = RotaryEmbedding(cfg)
    cos, sin = rope(0, 10)
    expected = 0.1 * torch.log(torch.tensor(16.0)) + 1.0
    want = torch.full_like(cos, float(expected) ** 2)
    torch.testing.assert_close(cos**2 + sin**2, want, rtol=1e-5, atol=1e-5)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


@pytest.mark.parametrize("scaling", [None, YARN])
def test_reset_buffers_after_a_meta_build_gives_the_tables_of_a_cpu_build(scaling):
    cfg = _cfg(rope_scaling=scaling)
    with torch.device("meta"):
        rope = RotaryEmbedding(cfg)
    assert rope.cos_cached.is_meta
    rope.reset_buffers("cpu")
    built = RotaryEmbedding(cfg)
    for name in ("inv_freq", "cos_cached", "sin_cached"):
        torch.testing.assert_close(getattr(rope, name), getattr(built, name), rtol=0, atol=0)
    assert rope.attention_factor == built.attention_factor
    m = 1000  # the rotation angle m * theta_0 with theta_0 = 1: cos(m) scaled by the attention factor
    assert float(rope.cos_cached[m, 0]) == pytest.approx(math.cos(m) * built.attention_factor, abs=1e-4)
