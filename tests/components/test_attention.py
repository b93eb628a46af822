import math

import pytest
import torch

from tinyformer.components.attention import attend, reference_attention, safe_softmax, single_query_attention
from tinyformer.components.kv_cache import build_attention_mask
from tinyformer.config import ModelConfig
from tinyformer.models.decoder import DecoderLM


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


def _repeat_kv_rows(w: torch.Tensor, n_head: int, n_kv: int, d_h: int, interleave: bool = True) -> torch.Tensor:
    """A fused qkv weight (or bias) of a GQA layer -> the MHA one whose K/V rows repeat each K/V head for
    every query head of its group (interleave=True: head g serves query heads g*r .. g*r + r - 1)."""
    w_q, w_k, w_v = w.split([n_head * d_h, n_kv * d_h, n_kv * d_h])
    r = n_head // n_kv

    def rep(m: torch.Tensor) -> torch.Tensor:
        heads = m.reshape(n_kv, d_h, *m.shape[1:])
        heads = heads.repeat_interleave(r, dim=0) if interleave else heads.repeat(r, *([1] * (heads.dim() - 1)))
        return heads.reshape(n_head * d_h, *m.shape[1:])

    return torch.cat([w_q, rep(w_k), rep(w_v)])


@pytest.mark.parametrize("impl", ["reference", "sdpa"])
def test_gqa_model_equals_an_mha_model_whose_kv_heads_repeat_for_their_group(impl):
    """Query head i reads K/V head floor(i / (H / H_kv)): a GQA model equals the MHA model (H_kv = H) whose
    W_k, W_v rows are each K/V head repeated for its group of query heads, and not a differently grouped one."""
    gqa_cfg = ModelConfig(vocab_size=50, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=16,
                          attn_bias=True, attn_impl=impl)
    mha_cfg = gqa_cfg.replace(n_kv_head=4)
    gqa = DecoderLM(gqa_cfg).double().eval()
    x = torch.randint(0, 50, (2, 12))

    def mha_logits(interleave: bool) -> torch.Tensor:
        state = gqa.state_dict()
        for name in [n for n in state if n.endswith("attn.qkv.weight") or n.endswith("attn.qkv.bias")]:
            state[name] = _repeat_kv_rows(state[name], 4, 2, gqa_cfg.head_dim, interleave)
        mha = DecoderLM(mha_cfg).double().eval()
        mha.load_state_dict(state)
        assert mha.blocks[0].attn.n_kv_head == 4
        with torch.no_grad():
            return mha(x)

    with torch.no_grad():
        want = gqa(x)
    torch.testing.assert_close(mha_logits(interleave=True), want, atol=1e-12, rtol=1e-10)
    # heads (0, 1) -> K/V 0 and (2, 3) -> K/V 1; the other pairing (0, 2) / (1, 3) is a different model
    assert (mha_logits(interleave=False) - want).abs().max() > 1e-3


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
    # naive softmax overflows where the safe one does not
    naive = torch.exp(s[0]) / torch.exp(s[0]).sum()
    assert not torch.isfinite(naive).all()


def test_exp_overflows_float16_above_ln_65504_and_half_softmax_is_computed_in_float32():
    """exp(x) is infinite above ln(max) of the dtype: ln(65504) = 11.09 in float16, ln(3.4e38) = 88.72 in
    float32. safe_softmax does not subtract the maximum in float16: it computes in float32 and rounds back."""
    for dtype in (torch.float16, torch.float32):
        limit = math.log(torch.finfo(dtype).max)
        below, above = torch.tensor([limit - 0.02, limit + 0.02], dtype=dtype)
        assert torch.isfinite(torch.exp(below)) and torch.isinf(torch.exp(above)), dtype
    h = torch.tensor([[12.0, 11.0, 70.0], [-3.0, 0.5, 2.0]], dtype=torch.float16)
    assert not torch.isfinite(torch.exp(h) / torch.exp(h).sum(-1, keepdim=True)).all()  # naive float16
    p = safe_softmax(h)
    assert p.dtype == torch.float16
    assert torch.equal(p, safe_softmax(h.float()).half())  # the float32 computation, rounded once
    torch.testing.assert_close(p.double(), torch.softmax(h.double(), -1), atol=2**-11, rtol=2**-10)


def test_attention_with_fully_masked_row_is_finite_in_both_paths():
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    mask[..., 0, :] = False
    for impl in ("reference", "sdpa"):
        out = attend(q, k, v, mask, is_causal=False, impl=impl)
        assert torch.isfinite(out).all(), impl


@pytest.mark.parametrize("impl", ["reference", "sdpa"])
def test_score_scaling_keeps_variance_near_one(impl):
    """Var(q.k) = d_h for unit-variance entries; the attention's 1/sqrt(d_h) brings the scores back to variance 1.

    The scores are read off the attention itself: with V = I (one-hot values) its output row is P, and
    log P_ij = s_ij - logsumexp_j(s_ij), so the variance of log P over the keys j is that of the scores."""
    torch.manual_seed(1)
    n_keys = 64
    v = torch.eye(n_keys, dtype=torch.float64)[None, None]  # (1, 1, S, S)
    for d in (16, 64, 256):
        q = torch.randn(1, 1, 2000, d, dtype=torch.float64)
        k = torch.randn(1, 1, n_keys, d, dtype=torch.float64)
        probs = attend(q, k, v, None, is_causal=False, impl=impl)  # (1, 1, 2000, S)
        assert abs(float(torch.log(probs).var(-1).mean()) - 1.0) < 0.05, (impl, d)
        unscaled = reference_attention(q, k, v, scale=1.0)  # without 1/sqrt(d_h): variance d_h
        assert abs(float(torch.log(unscaled).var(-1).mean()) / d - 1.0) < 0.05, d
