"""Quantized products over many rows (prefill, chunked prefill, batched decoding) against float64.

Every code path is forced in turn: the 8-bit-activation GEMM (``quant_kernels.act8_gemm``) on AVX-512 VNNI,
on AVX2 and in plain C++ (a path this CPU lacks is skipped), its PyTorch fallback, and the weight-only path
(dequantized tiles + BLAS) that ``cpp`` takes above ``CPP_MAX_ROWS`` rows. Shapes are chosen off every tile: rows
not a multiple of the register tile (4; AVX2: 2), output channels not a multiple of its 16-channel blocks or
48-channel panels (AVX2: 8-channel eighths, 32-channel panels), K spanning several of the GEMM's
K chunks (256 int8 / 512 int4 columns) with a partial last one, and, for the weight-only path, K and groups
off the 32-column grid.

The bound: y = x_r W'^T with W' = dequant(W) (|W' - W| <= s/2 per weight, s its group's scale) and x_r the
activations rounded per 32-column block b (|x_r - x| <= d_b / 2, d_b = max_b |x| / 127; int4's zero-point part
multiplies the exact x). Hence, against the float weights,
    |y - x W^T| <= sum_i |x_i| s_i / 2  +  sum_b d_b / 2 sum_{i in b} |W''_i|  (+ float32 summation error),
W'' the part of W' that multiplies x_r (int8: W'; int4: s (u - 8)).
"""

from __future__ import annotations

import pytest
import torch

from tinyformer.components import quant_kernels
from tinyformer.components.quantized import CPP_MAX_ROWS, QuantizedLinear, QuantSpec, dequantize_weight, quantize_weight

pytestmark = pytest.mark.usefixtures("one_thread")

# (spec, out_features, in_features): 37 / 50 / 100 channels (partial 16-blocks and 48-panels), K = 288 (9
# blocks: two int8 chunks, the last partial) and 544 (17 blocks: two int4 chunks), groups of 32 / 64 / 96
GEMM_LAYOUTS = [
    (QuantSpec("int8", 0), 37, 288),
    (QuantSpec("int8", 32), 50, 288),
    (QuantSpec("int8", 96), 100, 288),
    (QuantSpec("int4", 32), 37, 544),
    (QuantSpec("int4", 64), 50, 256),
    (QuantSpec("int4", 32), 100, 96),
    (QuantSpec("int8", 0), 37, 544),  # the AVX2 path's chunks are twice as long: 17 blocks (int8: 16 a chunk)
    (QuantSpec("int4", 32), 37, 1056),  # and 33 (int4: 32 a chunk)
]
GEMM_ROWS = [1, 5, 13, 33]
PATHS = ["vnni", "avx2", "plain"]


def spec_id(value: object) -> str | None:
    return str(value) if isinstance(value, QuantSpec) else None


@pytest.fixture(scope="module")
def cpp() -> None:
    if quant_kernels._compiler() is None:
        pytest.skip("no C++ compiler: the C++ kernels cannot be built here")
    assert quant_kernels.available(), "a C++ compiler is present but the kernels did not build (see stderr)"


def need_path(path: str) -> None:
    if path == "vnni" and not quant_kernels.has_vnni():
        pytest.skip("this CPU has no AVX-512 VNNI (lscpu: avx512_vnni)")
    if path == "avx2" and not quant_kernels.has_avx2():
        pytest.skip("this CPU has no AVX2 + FMA (lscpu: avx2, fma)")


def case(spec: QuantSpec, n: int, k: int, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[0, :5] *= 20  # a few large weights: coarse steps in their groups
    x = torch.randn(rows, k, generator=g)
    x[:, 3] *= 30  # an outlier column: a coarse activation block
    return w, quantize_weight(w, spec), x


def act8_exact(spec: QuantSpec, parts: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (the rounded-activation formula, W'' (N, K)): x_r W''^T + (int4) the group sums of the exact x
    times z - 8 s; d = max |x_b| / 127, x_r = round(x / d) d (half to even)."""
    k = x.shape[1]
    xb = x.double().reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    xr = (torch.round(xb / torch.where(d > 0, d, torch.ones_like(d))) * d).reshape(x.shape)
    wd = dequantize_weight(parts, spec.type, torch.float64)
    if spec.type == "int8":
        return xr @ wd.t(), wd
    g = spec.groups(k)
    m = (parts["zeros"].double() - 8 * parts["scales"].double()).repeat_interleave(g, dim=1)
    return xr @ (wd - m).t() + x.double() @ m.t(), wd - m


def assert_within_bound(y: torch.Tensor, w: torch.Tensor, spec: QuantSpec, parts: dict[str, torch.Tensor],
                        x: torch.Tensor, w_rounded_part: torch.Tensor | None) -> None:
    """|y - x W^T| within the module doc's bound (weight rounding, plus activation rounding when
    ``w_rounded_part`` is given), and the float32 summation's slack."""
    exact = x.double() @ w.double().t()
    g = spec.groups(x.shape[1])
    step = parts["scales"].double().repeat_interleave(g, dim=1)  # (N, K): s of each weight's group
    bound = x.double().abs() @ (step / 2).t()
    if w_rounded_part is not None:
        d = x.double().reshape(x.shape[0], -1, 32).abs().amax(-1) / 127
        bound = bound + (d / 2) @ w_rounded_part.abs().reshape(w.shape[0], -1, 32).sum(-1).t()
    slack = 1e-5 * float(exact.abs().max())
    err = (y.double() - exact).abs()
    assert torch.all(err <= bound + slack), f"max excess {float((err - bound).max()):.3g}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", GEMM_ROWS)
@pytest.mark.parametrize(("spec", "n", "k"), GEMM_LAYOUTS, ids=spec_id)
def test_act8_gemm_equals_the_rounded_activation_formula_and_stays_within_the_bound(cpp, spec, n, k, rows, path):
    need_path(path)
    w, parts, x = case(spec, n, k, rows, seed=rows)
    packed = quant_kernels.pack_act8(parts, spec.type)
    y = quant_kernels.act8_gemm(x, packed, n, spec.groups(k), spec.type, path)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    formula, w_rounded = act8_exact(spec, parts, x)
    torch.testing.assert_close(y.double(), formula, rtol=1e-5, atol=1e-5 * float(formula.abs().max()))
    assert_within_bound(y, w, spec, parts, x, w_rounded)


@pytest.mark.parametrize("path", PATHS)
def test_act8_layer_over_a_prefill_of_many_rows_with_bias_and_batch_axes(cpp, path):
    need_path(path)
    spec = QuantSpec("int4", 32, "cpp_act8")
    w, parts, _ = case(spec, 75, 160, 1, seed=11)
    x = torch.randn(3, 41, 160)  # 123 rows
    b = torch.randn(75)
    layer = QuantizedLinear(parts, spec, 160, b)
    layer.gemm_path = path
    y = layer(x)
    assert y.shape == (3, 41, 75)
    formula, w_rounded = act8_exact(spec, parts, x.reshape(-1, 160))
    torch.testing.assert_close(y.reshape(-1, 75).double(), formula + b.double(), rtol=1e-5,
                               atol=1e-5 * float(formula.abs().max()))
    assert_within_bound(y.reshape(-1, 75) - b, w, spec, parts, x.reshape(-1, 160), w_rounded)


@pytest.mark.parametrize(("spec", "n", "k"), GEMM_LAYOUTS[::2], ids=spec_id)
def test_act8_pytorch_fallback_reads_the_packed_layout_as_the_formula(spec, n, k):
    w, parts, x = case(spec, n, k, 6, seed=3)
    packed = quant_kernels.pack_act8(parts, spec.type)
    back = quant_kernels.unpack_act8(packed, n, spec.type)
    assert all(torch.equal(back[name], parts[name]) for name in parts)  # packing loses nothing
    y = quant_kernels.act8_gemm_reference(x, packed, n, spec.groups(k), spec.type)
    formula, w_rounded = act8_exact(spec, parts, x)
    torch.testing.assert_close(y.double(), formula, rtol=1e-5, atol=1e-5 * float(formula.abs().max()))
    assert_within_bound(y, w, spec, parts, x, w_rounded)


def saturating_case(quant_type: str, n: int, k: int, rows: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Weights and activations at the ends of their ranges, every product of x row 0 with channel 0 positive
    and of row 1 negative (the rest random signs): the inputs on which vpmaddubsw's int16 pair sums saturate
    if a kernel feeds it the wrong operands. x is +-3 everywhere, so xq = +-127. int8: q in {-128, 127}
    (-128 is outside the quantizer's range but a valid int8) on channel 0, +-127 elsewhere; int4: u = 15
    where x row 0 is positive, 0 where negative (channel 0: all 15)."""
    g = torch.Generator().manual_seed(k)
    sign = torch.where(torch.rand(n, k, generator=g) < 0.5, -1, 1)
    x = 3.0 * torch.where(torch.rand(rows, k, generator=g) < 0.5, -1.0, 1.0)
    s = torch.rand(n, k // 32, generator=g) + 0.5
    if quant_type == "int8":
        x[0], x[1] = 3.0 * sign[0], -3.0 * sign[0]
        q = (127 * sign).to(torch.int8)
        q[0] = torch.where(sign[0] < 0, -128, 127).to(torch.int8)
        return {"qweight": q, "scales": s}, x
    x[0], x[1] = 3.0, -3.0
    u = torch.where(sign > 0, 15, 0)
    u[0] = 15
    return {"qweight": quant_kernels.pack_int4(u), "scales": s, "zeros": torch.randn(n, k // 32, generator=g)}, x


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("group", [32, 0])
@pytest.mark.parametrize("quant_type", ["int8", "int4"])
def test_act8_gemm_does_not_saturate_at_the_ends_of_the_ranges(cpp, quant_type, group, path):
    """The exact integer sums are far from int16's limits here (they are int32 in every kernel), but the naive
    vpmaddubsw operands would not be: activations stored as xq + 128 (0..255) times the signed weights give
    pairs up to 2 x 255 x 128; int4's 8 pairs per 32-column block up to 8 x 2 x 255 x 15. Checked below on the
    very inputs, so this test would catch such a kernel."""
    need_path(path)
    if quant_type == "int4" and group == 0:
        pytest.skip("int4 has groups only")
    n, k, rows = 37, 288, 7  # a partial 8- and 16-channel block, an odd row count, two int8 K chunks
    parts, x = saturating_case(quant_type, n, k, rows)
    if group == 0:
        parts["scales"] = parts["scales"][:, :1].contiguous()
    spec = QuantSpec(quant_type, group)
    xq = torch.round(x / 3 * 127)  # the rounded activations: +-127
    if quant_type == "int8":
        naive = ((xq[:2, None, :] + 128) * parts["qweight"][0].float()).reshape(2, -1, 2).sum(-1)  # pair sums
    else:
        u = quant_kernels.unpack_int4(parts["qweight"])[0].float()
        naive = ((xq[:2] + 128) * u).reshape(2, -1, 32).sum(-1)  # a block's int16 sum
    assert naive.abs().max() > 32767
    y = quant_kernels.act8_gemm(x, quant_kernels.pack_act8(parts, quant_type), n, spec.groups(k), quant_type, path)
    formula, _ = act8_exact(spec, parts, x)
    torch.testing.assert_close(y.double(), formula, rtol=1e-5, atol=1e-5 * float(formula.abs().max()))


# the weight-only path over many rows: K and groups off the 32-grid too (100 = 5 x 20 = 2 x 50)
WEIGHT_ONLY_LAYOUTS = [(QuantSpec("int8", 0, "cpp"), 37, 100), (QuantSpec("int8", 20, "cpp"), 50, 100),
                       (QuantSpec("int4", 50, "cpp"), 37, 100), (QuantSpec("int4", 32, "cpp"), 75, 288)]


@pytest.mark.parametrize("rows", [CPP_MAX_ROWS + 1, 37])
@pytest.mark.parametrize(("spec", "n", "k"), WEIGHT_ONLY_LAYOUTS, ids=spec_id)
def test_weight_only_layer_over_many_rows_equals_x_times_dequantized_weight(cpp, spec, n, k, rows):
    w, parts, x = case(spec, n, k, rows, seed=5)
    layer = QuantizedLinear(parts, spec, k)
    y = layer(x)
    expected = x.double() @ dequantize_weight(parts, spec.type, torch.float64).t()
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    assert_within_bound(y, w, spec, parts, x, None)


def test_auto_takes_act8_only_with_integer_dots_and_act8_holds_only_the_packed_form(cpp):
    parts = quantize_weight(torch.randn(16, 64), QuantSpec("int4", 32))
    integer_dots = quant_kernels.has_vnni() or quant_kernels.has_avx2()
    assert QuantizedLinear(parts, QuantSpec("int4", 32), 64).kernel == ("cpp_act8" if integer_dots else "cpp")
    layer = QuantizedLinear(parts, QuantSpec("int4", 32, "cpp_act8"), 64)
    assert layer.kernel == "cpp_act8" and not hasattr(layer, "qweight")  # only the packed form is held
    assert {"wp", "sp", "aux"} <= {name for name, _ in layer.named_buffers()}


@pytest.mark.parametrize(("path", "has", "name"), [("avx2", "has_avx2", "AVX2"), ("vnni", "has_vnni", "AVX-512 VNNI")])
def test_forcing_a_path_the_cpu_lacks_is_refused(cpp, path, has, name):
    if getattr(quant_kernels, has)():
        pytest.skip(f"this CPU has {name}: nothing to refuse")
    parts = quantize_weight(torch.randn(16, 64), QuantSpec("int8", 0))
    with pytest.raises(RuntimeError, match=f"no {name}"):
        quant_kernels.act8_gemm(torch.randn(2, 64), quant_kernels.pack_act8(parts, "int8"), 16, 64, "int8", path)
