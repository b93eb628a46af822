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


def test_layernorm_worked_example_divides_the_variance_by_d_and_has_2d_parameters():
    """The walkthrough's example x = [2, -1, 0.5, 3], gamma = 2, beta = 0.5, against the formula in exact
    rational arithmetic: mean = sum / d, variance = sum of squared deviations / d (biased, not d - 1)."""
    from fractions import Fraction

    xs = [Fraction(2), Fraction(-1), Fraction(1, 2), Fraction(3)]
    gamma, beta, d = Fraction(2), Fraction(1, 2), len(xs)
    mean = sum(xs) / d
    var = sum((v - mean) ** 2 for v in xs) / d
    ln = LayerNorm(d, eps=0.0).double()
    with torch.no_grad():
        ln.weight.fill_(float(gamma))
        ln.bias.fill_(float(beta))
    got = ln(torch.tensor([float(v) for v in xs], dtype=torch.float64))

    def output(variance: Fraction) -> torch.Tensor:
        return torch.tensor([float(v - mean) / float(variance) ** 0.5 * float(gamma) + float(beta) for v in xs],
                            dtype=torch.float64)

    torch.testing.assert_close(got, output(var), atol=1e-14, rtol=1e-14)
    unbiased = sum((v - mean) ** 2 for v in xs) / (d - 1)
    assert (got - output(unbiased)).abs().max() > 0.1  # dividing by d - 1 would be visibly wrong
    assert sum(p.numel() for p in ln.parameters()) == 2 * d  # gamma and beta
