import torch

from tinyformer.components.norm import LayerNorm, RMSNorm


def test_rmsnorm_equals_formula_in_float64():
    x = torch.randn(3, 5, 16, dtype=torch.float64) * 3 + 1
    norm = RMSNorm(16, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, dtype=torch.float64))
    expected = torch.zeros_like(x)
    for idx in range(x.shape[0]):
        for t in range(x.shape[1]):
            v = x[idx, t]
            rms = torch.sqrt((v * v).sum() / v.numel() + 1e-6)
            expected[idx, t] = v / rms * norm.weight
    torch.testing.assert_close(norm(x), expected, rtol=1e-12, atol=1e-12)


def test_rmsnorm_half_precision_uses_float32_statistics():
    x = torch.randn(4, 64) * 300  # squares overflow float16 (max 65504)
    norm = RMSNorm(64)
    ref = norm(x)
    out = norm(x.half())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)


def test_layernorm_with_and_without_bias_equals_formula_in_float64():
    x = torch.randn(2, 7, 12, dtype=torch.float64) * 2 - 0.5
    for bias in (True, False):
        ln = LayerNorm(12, eps=1e-5, bias=bias).double()
        with torch.no_grad():
            ln.weight.copy_(torch.randn(12, dtype=torch.float64))
            if bias:
                ln.bias.copy_(torch.randn(12, dtype=torch.float64))
        mean = x.sum(-1, keepdim=True) / 12
        var = ((x - mean) ** 2).sum(-1, keepdim=True) / 12  # biased variance
        expected = (x - mean) / torch.sqrt(var + 1e-5) * ln.weight
        if bias:
            expected = expected + ln.bias
        else:
            assert ln.bias is None
        torch.testing.assert_close(ln(x), expected, rtol=1e-12, atol=1e-12)
