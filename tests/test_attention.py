import math

import pytest
import torch

from tinyformer.components.attention import attend, reference_attention, safe_softmax, single_query_attention
from tinyformer.config import ModelConfig
from tinyformer.models.decoder import DecoderLM, build_attention_mask


def _naive_float64(q, k, v, mask):
    """Independent float64 reference: explicit loops over batch and heads."""
    B, H, T, d = q.shape
    group = H // k.shape[1]
    out = torch.zeros(B, H, T, d, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            s = q[b, h].double() @ k[b, h // group].double().T / math.sqrt(d)
            s = s.masked_fill(~mask[b, 0], float("-inf"))
            p = torch.softmax(s, dim=-1)
            out[b, h] = p @ v[b, h // group].double()
    return out


@pytest.mark.parametrize("n_head,n_kv", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_single_query_attention_matches_float64_loops_with_per_row_masks(n_head, n_kv):
    """The compiled decode step's formula: one query per row, each row seeing its own prefix of the cache."""
    B, S, d = 3, 11, 8
    q, k, v = torch.randn(B, n_head, 1, d), torch.randn(B, n_kv, S, d), torch.randn(B, n_kv, S, d)
    mask = (torch.arange(S)[None, :] <= torch.tensor([[2], [10], [6]]))[:, None, None, :]  # (B, 1, 1, S)
    got = single_query_attention(q, k, v, mask)
    torch.testing.assert_close(got.double(), _naive_float64(q, k, v, mask), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(single_query_attention(q, k, v), reference_attention(q, k, v), atol=1e-6, rtol=1e-6)
    # what torch.compile runs agrees with the eager SDPA call
    compiled = torch.compile(lambda q, k, v, m: attend(q, k, v, m, is_causal=False), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, mask), attend(q, k, v, mask, is_causal=False), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("n_head,n_kv", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_reference_and_sdpa_agree_causal_and_padded(n_head, n_kv):
    B, T, d = 3, 9, 16
    q = torch.randn(B, n_head, T, d)
    k = torch.randn(B, n_kv, T, d)
    v = torch.randn(B, n_kv, T, d)
    # causal, no padding
    ref = reference_attention(q, k, v, None, is_causal=True)
    sdpa = attend(q, k, v, None, is_causal=True, impl="sdpa")
    torch.testing.assert_close(sdpa, ref, atol=1e-5, rtol=1e-5)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T)
    torch.testing.assert_close(ref.double(), _naive_float64(q, k, v, causal), atol=1e-5, rtol=1e-5)
    # left-padded batch
    am = torch.ones(B, T, dtype=torch.long)
    am[1, :3] = 0
    am[2, :5] = 0
    mask = build_attention_mask(am, T, 0)
    ref = reference_attention(q, k, v, mask)
    sdpa = attend(q, k, v, mask, is_causal=False, impl="sdpa")
    torch.testing.assert_close(sdpa, ref, atol=1e-5, rtol=1e-5)
    real = am.bool()
    torch.testing.assert_close(
        ref.double()[real[:, None, :].expand(B, n_head, T)],
        _naive_float64(q, k, v, mask)[real[:, None, :].expand(B, n_head, T)],
        atol=1e-5, rtol=1e-5,
    )


def test_gqa_with_n_kv_equal_n_head_equals_mha_model():
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layer=2, n_head=4, max_seq_len=16)
    explicit = cfg.replace(n_kv_head=4)
    a, b = DecoderLM(cfg), DecoderLM(explicit)
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 50, (2, 12))
    torch.testing.assert_close(a(x), b(x), atol=0, rtol=0)


def test_gqa_equals_mha_with_repeated_kv_heads():
    B, T, d = 2, 6, 8
    q = torch.randn(B, 6, T, d)
    k = torch.randn(B, 2, T, d)
    v = torch.randn(B, 2, T, d)
    gqa = attend(q, k, v, None, is_causal=True)
    mha = attend(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), None, is_causal=True)
    torch.testing.assert_close(gqa, mha, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", ["reference", "sdpa"])
def test_causality_future_tokens_do_not_change_past_logits(impl):
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=32, attn_impl=impl)
    model = DecoderLM(cfg).eval()
    x = torch.randint(0, 64, (2, 20))
    y = x.clone()
    t = 11
    y[:, t + 1 :] = torch.randint(0, 64, (2, 20 - t - 1))
    assert not torch.equal(x, y)
    lx, ly = model(x), model(y)
    torch.testing.assert_close(lx[:, : t + 1], ly[:, : t + 1], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(lx[:, t + 1 :], ly[:, t + 1 :])


def test_safe_softmax_finite_above_88_and_for_fully_masked_rows():
    s = torch.tensor([[89.0, 100.0, 95.0], [float("-inf")] * 3])
    p = safe_softmax(s)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p[0], torch.softmax(s[0].double(), -1).float())
    assert torch.equal(p[1], torch.zeros(3))
    # float16: exp(12) already overflows, the max subtraction keeps it finite
    h = safe_softmax(torch.tensor([[12.0, 11.0, 70000.0 / 1000]], dtype=torch.float16))
    assert torch.isfinite(h).all() and abs(float(h.float().sum()) - 1) < 1e-3
    # naive softmax overflows where the safe one does not
    naive = torch.exp(s[0]) / torch.exp(s[0]).sum()
    assert not torch.isfinite(naive).all()


def test_attention_with_fully_masked_row_is_finite_in_both_paths():
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    mask[..., 0, :] = False
    for impl in ("reference", "sdpa"):
        out = attend(q, k, v, mask, is_causal=False, impl=impl)
        assert torch.isfinite(out).all(), impl


def test_score_scaling_keeps_variance_near_one():
    torch.manual_seed(1)
    for d in (16, 64, 256):
        q, k = torch.randn(20000, d), torch.randn(20000, d)
        scores = (q * k).sum(-1) / math.sqrt(d)
        # Var(q.k) = d for unit-variance entries, so the scaled score has variance 1 (+- sampling error)
        assert abs(float(scores.var()) - 1.0) < 0.05, d
        unscaled = (q * k).sum(-1)
        assert float(unscaled.var()) > 0.8 * d
