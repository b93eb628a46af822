"""The C++ int8 / int4 CPU kernels (``tinyformer.components.quant_kernels``) against the formula.

Reference: y = x dequant(W)^T in float64, dequant being ``dequantize_weight`` (the module doc's formula),
for every layout the format allows, sizes that are not multiples of the kernel's vector width included.
The C++ build runs once per session (cached under torch's extensions folder); without a compiler those
tests are skipped and the PyTorch fallback is still checked.
"""

from __future__ import annotations

import pytest
import torch

from tinyformer.components import quant_kernels, quantized
from tinyformer.components.quantized import (
    CPP_MAX_ROWS,
    QuantizedLinear,
    QuantSpec,
    dequantize_weight,
    quantize_weight,
)
from tinyformer.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

# (spec, out_features, in_features): per channel, groups of 32 / 64 / 128, and sizes that leave a partial
# vector in every row or group (100 = 6 x 16 + 4; int4 groups of 50 = 32 + 18 and of 10)
LAYOUTS = [
    (QuantSpec("int8", 0), 48, 128),
    (QuantSpec("int8", 32), 40, 256),
    (QuantSpec("int8", 64), 33, 192),
    (QuantSpec("int8", 128), 20, 384),
    (QuantSpec("int8", 0), 37, 100),
    (QuantSpec("int8", 20), 37, 100),
    (QuantSpec("int4", 32), 48, 128),
    (QuantSpec("int4", 64), 33, 192),
    (QuantSpec("int4", 128), 20, 384),
    (QuantSpec("int4", 50), 37, 100),
    (QuantSpec("int4", 10), 37, 100),
]
ROWS = [1, 3, CPP_MAX_ROWS]
ACT8_LAYOUTS_FOR_ROWS = [(QuantSpec("int8", 0), 37, 128), (QuantSpec("int4", 32), 37, 128),
                         (QuantSpec("int4", 128), 20, 384)]


def spec_id(value: object) -> str | None:
    return str(value) if isinstance(value, QuantSpec) else None


@pytest.fixture(scope="session")
def cpp_kernels() -> None:
    if quant_kernels._compiler() is None:
        pytest.skip("no C++ compiler: the C++ kernels cannot be built here")
    assert quant_kernels.available(), "a C++ compiler is present but the kernels did not build (see stderr)"


def layer_case(spec: QuantSpec, n: int, k: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[0, :5] *= 20  # a few large weights: large steps in their groups
    parts = quantize_weight(w, spec)
    x = torch.randn(rows, k, generator=g)
    expected = x.double() @ dequantize_weight(parts, spec.type, torch.float64).t()
    return parts, x, expected


def run_kernel(fn, spec: QuantSpec, parts: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    if spec.type == "int8":
        return fn["int8"](x, parts["qweight"], parts["scales"])
    return fn["int4"](x, parts["qweight"], parts["scales"], parts["zeros"])


def assert_matches(y: torch.Tensor, expected: torch.Tensor) -> None:
    # float32 sums of in_features products: relative error ~ 1e-7 sqrt(in) of the terms' magnitude
    scale = float(expected.abs().max())
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("spec", "n", "k"), LAYOUTS, ids=spec_id)
def test_cpp_kernel_equals_x_times_dequantized_weight(cpp_kernels, spec, n, k, rows):
    parts, x, expected = layer_case(spec, n, k, rows)
    ops = {"int8": torch.ops.tinyformer.int8_linear, "int4": torch.ops.tinyformer.int4_linear}
    y = run_kernel(ops, spec, parts, x)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert_matches(y, expected)


def need_path(path: str) -> None:
    """Skips a weight-only path (``quant_kernels.WEIGHT_ONLY_PATHS``) this CPU lacks."""
    if path == "avx512" and not quant_kernels.has_avx512():
        pytest.skip("this CPU has no AVX-512 F/BW/VL (lscpu: avx512f, avx512bw, avx512vl)")
    if path == "avx2" and not quant_kernels.has_avx2():
        pytest.skip("this CPU has no AVX2 + FMA (lscpu: avx2, fma)")


@pytest.mark.parametrize("path", ["avx512", "avx2", "plain"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
@pytest.mark.parametrize(("spec", "n", "k"), LAYOUTS, ids=spec_id)
def test_every_cpu_path_of_the_cpp_kernel_equals_x_times_dequantized_weight(cpp_kernels, spec, n, k, rows, path):
    """Each path forced in turn: output rows off the 4-row block (37, 33), activation rows off the 2-row batch,
    groups off the 8- and 16-float vectors (20, 50, 10: the AVX2 kernels' scalar tails), large weights and an
    outlier activation column."""
    need_path(path)
    parts, x, _ = layer_case(spec, n, k, rows, seed=rows)
    x[:, 1] *= 50
    expected = x.double() @ dequantize_weight(parts, spec.type, torch.float64).t()
    paths = {"int8": lambda *a: quant_kernels.int8_linear(*a, path=path),
             "int4": lambda *a: quant_kernels.int4_linear(*a, path=path)}
    assert_matches(run_kernel(paths, spec, parts, x), expected)


@pytest.mark.parametrize("path", ["avx512", "avx2", "plain"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16])
@pytest.mark.parametrize(("n", "k"), [(37, 100), (64, 64), (20, 7), (300, 577)])
def test_every_cpu_path_of_the_float32_kernel_equals_x_times_w_plus_b(cpp_kernels, n, k, rows, path):
    """f32_linear against float64 x W^T + b: 1 to 8 activation rows, past the kernel's 8 rows (F.linear), K off
    the 8- and 16-float vectors (100, 7, 577), at 1 and 2 threads (300 output rows are split between them), with
    and without bias, leading dimensions kept."""
    need_path(path)
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(rows, k, generator=g)
    x[:, 1] *= 50
    expected = x.double() @ w.double().t()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert_matches(quant_kernels.f32_linear(x, w, path=path), expected)
        assert_matches(quant_kernels.f32_linear(x, w, b, path=path), expected + b.double())
    y3 = quant_kernels.f32_linear(x.view(1, rows, k), w, b, path=path)
    assert y3.shape == (1, rows, n)
    assert_matches(y3[0], expected + b.double())


@pytest.mark.parametrize("path", ["avx512", "avx2", "plain"])
def test_each_row_of_the_float32_kernels_product_is_bit_for_bit_that_row_multiplied_alone(cpp_kernels, path):
    """Row m of f32_linear(x) for 1 to 8 rows equals f32_linear(x[m]) exactly (the same sum in the same order),
    so a speculative verification over K + 1 rows computes what K + 1 one-row decoding steps compute."""
    need_path(path)
    g = torch.Generator().manual_seed(1)
    for k in (7, 100, 577):
        w, b, x = torch.randn(300, k, generator=g), torch.randn(300, generator=g), torch.randn(8, k, generator=g)
        alone = torch.cat([quant_kernels.f32_linear(x[m : m + 1], w, b, path=path) for m in range(8)])
        for rows in range(2, 9):
            assert torch.equal(quant_kernels.f32_linear(x[:rows], w, b, path=path), alone[:rows]), (k, rows)


@pytest.mark.parametrize(("spec", "n", "k"), ACT8_LAYOUTS_FOR_ROWS, ids=spec_id)
def test_each_row_of_the_act8_product_is_bit_for_bit_that_row_multiplied_alone(cpp_kernels, spec, n, k):
    """The act8 GEMM rounds each activation row on its own and sums integer products exactly, so its row m for
    1 to 9 rows (across its 4-row register tiles) equals the row multiplied alone."""
    if not integer_dots():
        pytest.skip("this CPU has no integer dot products (AVX2 or VNNI) for the act8 kernel")
    parts, x, _ = layer_case(spec, n, k, 9, seed=3)
    layer = QuantizedLinear(parts, QuantSpec(spec.type, spec.group_size, "cpp_act8"), k)
    with torch.inference_mode():
        alone = torch.cat([layer(x[m : m + 1]) for m in range(9)])
        for rows in range(2, 10):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows


def attention_case(d: int, seed: int = 0):
    """q (2, 6, 5, d) against a cache slice of 2 K/V heads (the cache holds 50 slots, 37 are attended); row 0's
    queries at positions 20..24 see a sliding window of 8, row 1's at 30..34 every earlier slot, and row 1's
    last query no slot at all."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 6, 5, d, generator=g)
    k, v = (torch.randn(2, 2, 50, d, generator=g)[:, :, :37] for _ in range(2))
    pos = torch.tensor([[20], [30]]) + torch.arange(5)  # (B, T)
    keys = torch.arange(37)
    mask = (keys <= pos[:, :, None]) & ((keys > pos[:, :, None] - 8) | (torch.arange(2) == 1)[:, None, None])
    mask[1, 4] = False
    return q, k, v, mask[:, None]  # mask (B, 1, T, S)


@pytest.mark.parametrize("d", [64, 72, 12])
@pytest.mark.parametrize("path", ["avx2", "plain"])
def test_row_attention_is_the_attention_formula(cpp_kernels, path, d):
    """softmax(q k^T / sqrt(d) + M) v against float64 ``reference_attention``, grouped K/V heads and a strided
    cache slice included; a query that may attend no slot gets zeros. (AVX2: 37 slots, keys four at a time and
    the last one alone; d = 72, 64 output values in registers and the last 8 through memory.)"""
    from tinyformer.components.attention import reference_attention

    need_path(path)
    if path == "avx2" and d % 8:
        pytest.skip("the AVX2 path takes d in multiples of 8")
    q, k, v, mask = attention_case(d)
    y = quant_kernels.row_attention(q, k, v, mask, path=path)
    expected = reference_attention(q.double(), k.double(), v.double(), mask)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(y[1, :, 4], torch.zeros(6, d))


@pytest.mark.parametrize("d", [64, 72])
@pytest.mark.parametrize("path", ["avx2", "plain"])
def test_each_query_of_row_attention_is_bit_for_bit_that_query_attending_alone_over_its_own_slots(cpp_kernels, path,
                                                                                                   d):
    """Query t of a T-query call equals a one-query call over only the slots it may see (no more slots, no mask):
    the sums do not depend on T, on how many slots are given, or on the other queries. So a speculative
    verification gets each position's one-token step bit for bit (SDPA over T queries does not)."""
    need_path(path)
    q, k, v, mask = attention_case(d, seed=1)
    y = quant_kernels.row_attention(q, k, v, mask, path=path)
    for b in range(2):
        for t in range(4):
            seen = mask[b, 0, t].nonzero()[:, 0]
            query, keys, values = q[b : b + 1, :, t : t + 1], k[b : b + 1, :, seen], v[b : b + 1, :, seen]
            alone = quant_kernels.row_attention(query, keys, values, torch.ones(1, 1, 1, len(seen), dtype=torch.bool),
                                                path=path)
            assert torch.equal(alone[0, :, 0], y[b, :, t]), (b, t)


def test_forcing_a_path_the_cpu_lacks_is_refused(cpp_kernels):
    x, q, s = torch.randn(1, 32), torch.ones(4, 32, dtype=torch.int8), torch.ones(4, 1)
    cases = [("avx512", quant_kernels.has_avx512(), "AVX-512"), ("avx2", quant_kernels.has_avx2(), "AVX2")]
    for path, has, name in cases:
        if not has:
            with pytest.raises(RuntimeError, match=f"no {name}"):
                quant_kernels.int8_linear(x, q, s, path=path)
            with pytest.raises(RuntimeError, match=f"no {name}"):
                quant_kernels.f32_linear(x, q.float(), path=path)
    with pytest.raises(RuntimeError, match="path must be"):
        torch.ops.tinyformer.int8_linear(x, q, s, 7)
    with pytest.raises(RuntimeError, match="x must be float32"):
        quant_kernels.f32_linear(x.double(), q.float())


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize(("spec", "n", "k"), LAYOUTS[::2], ids=spec_id)
def test_pytorch_fallback_equals_x_times_dequantized_weight(spec, n, k, rows):
    parts, x, expected = layer_case(spec, n, k, rows, seed=1)
    ref = {"int8": quant_kernels.int8_linear_reference, "int4": quant_kernels.int4_linear_reference}
    assert_matches(run_kernel(ref, spec, parts, x), expected)


def test_cpp_kernel_uses_all_threads_and_bfloat16_activations_alike(cpp_kernels):
    """Output rows split across threads give the same products; bfloat16 x is widened, y returned in bf16."""
    spec = QuantSpec("int4", 32)
    parts, x, expected = layer_case(spec, 1000, 256, 2, seed=2)
    torch.set_num_threads(2)
    y = torch.ops.tinyformer.int4_linear(x, parts["qweight"], parts["scales"], parts["zeros"])
    assert_matches(y, expected)
    yb = torch.ops.tinyformer.int4_linear(x.bfloat16(), parts["qweight"], parts["scales"], parts["zeros"])
    assert yb.dtype == torch.bfloat16
    expected_b = x.bfloat16().double() @ dequantize_weight(parts, "int4", torch.float64).t()
    torch.testing.assert_close(yb.double(), expected_b, rtol=1e-2, atol=1e-2 * float(expected_b.abs().max()))


@pytest.mark.parametrize("spec", [QuantSpec("int8", 0, "cpp"), QuantSpec("int4", 32, "cpp")], ids=str)
def test_cpp_layer_takes_the_kernel_for_few_rows_and_the_float_product_for_many(cpp_kernels, spec, monkeypatch):
    n, k = 40, 128
    monkeypatch.setattr(quantized, "DEQUANT_TILE_BYTES", 7 * 4 * k)  # many rows: tiles of 7 output rows
    parts, _, _ = layer_case(spec, n, k, 1, seed=3)
    b = torch.randn(n)
    layer = QuantizedLinear(parts, spec, k, b)
    assert layer.kernel == "cpp"
    wd = dequantize_weight(parts, spec.type, torch.float64)
    for shape in [(1, 1, k), (2, CPP_MAX_ROWS // 2, k), (3, CPP_MAX_ROWS, k)]:  # 1, 8 and 24 rows
        x = torch.randn(*shape)
        assert_matches(layer(x), x.double() @ wd.t() + b.double())
    auto = QuantizedLinear(parts, QuantSpec(spec.type, spec.group_size), k).kernel
    assert auto == ("cpp_act8" if k % 32 == 0 and integer_dots() else "cpp")


def peaked_tiny_model():
    """A one-layer decoder with peaked, varied next-token distributions (the default init is near-uniform, so
    greedy tokens would hang on rounding)."""
    from tinyformer.config import ModelConfig
    from tinyformer.models.decoder import DecoderLM

    torch.manual_seed(0)
    model = DecoderLM(ModelConfig(vocab_size=50, d_model=32, n_layer=1, n_head=4, n_kv_head=2, d_ff=64,
                                  max_seq_len=64))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["cpp", "cpp_act8"])
def test_compiled_decode_step_with_the_cpp_kernel_gives_the_eager_greedy_tokens(cpp_kernels, tmp_path, kernel):
    from tinyformer.generation.generator import Generator
    from tinyformer.generation.sampling import SamplingParams
    from tinyformer.quantization import quantize_run
    from tinyformer.run_folder import load_model, save_model

    save_model(tmp_path / "run", peaked_tiny_model())
    quantize_run(tmp_path / "run", tmp_path / "q", QuantSpec("int4", 32, kernel))
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    tokens = {}
    for compiled in (False, True):
        q = load_model(tmp_path / "q")
        assert {m.kernel for m in q.modules() if isinstance(m, QuantizedLinear)} == {kernel}
        gen = Generator(q, compile=compiled)
        gen.eos_token_id = None
        greedy = SamplingParams(temperature=0, max_new_tokens=12)
        tokens[compiled] = [r.token_ids for r in gen.generate(prompts, greedy, logprobs=False)]
    assert tokens[True] == tokens[False]


@pytest.mark.slow
def test_compiled_decode_step_with_the_float32_kernel_gives_the_eager_greedy_tokens(cpp_kernels):
    """A float32 model prepared for decoding (FewRowsLinear, ``f32_linear`` inside the packaged step's graph)
    decodes, eager and compiled, the greedy tokens of the same model with plain nn.Linear layers."""
    import copy

    from tinyformer.generation.generator import Generator
    from tinyformer.generation.sampling import SamplingParams
    from tinyformer.generation.weight_layout import FewRowsLinear, prepare_for_decoding

    plain = peaked_tiny_model()
    model = copy.deepcopy(plain)
    prepare_for_decoding(model, min_bytes=0)
    assert {type(m) for m in model.modules() if isinstance(m, torch.nn.Linear)} == {FewRowsLinear}
    prompts, greedy = [[1, 2, 3, 4], [5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=12)
    tokens = {}
    for name, m, compiled in (("plain", plain, False), ("eager", model, False), ("compiled", model, True)):
        gen = Generator(m, compile=compiled)
        gen.eos_token_id = None
        tokens[name] = [r.token_ids for r in gen.generate(prompts, greedy, logprobs=False)]
    assert tokens["compiled"] == tokens["eager"] == tokens["plain"]
    assert type(plain.lm_head) is torch.nn.Linear  # the plain model was decoded eagerly: never prepared


# ------------------------------------------------------------------ activations rounded to 8 bits (the act8 kernel)

ACT8_LAYOUTS = [(QuantSpec("int8", 0), 37, 128), (QuantSpec("int8", 32), 40, 256), (QuantSpec("int8", 64), 33, 192),
                (QuantSpec("int4", 32), 37, 128), (QuantSpec("int4", 64), 33, 192), (QuantSpec("int4", 128), 20, 384)]


def act8_reference(spec: QuantSpec, parts: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """float64: x rounded per block of 32 (d = max |x| / 127, round half to even) times dequant(W), except
    int4's zero-point part, z - 8 s per group, which multiplies the exact x."""
    xb = x.double().reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    xr = (torch.round(xb / torch.where(d > 0, d, torch.ones_like(d))) * d).reshape(x.shape)
    wd = dequantize_weight(parts, spec.type, torch.float64)
    if spec.type == "int8":
        return xr @ wd.t()
    g = spec.groups(x.shape[1])
    m = parts["zeros"].double() - 8 * parts["scales"].double()
    return xr @ (wd - m.repeat_interleave(g, dim=1)).t() + x.double().reshape(x.shape[0], -1, g).sum(-1) @ m.t()


def integer_dots() -> bool:
    """Whether this CPU has the integer dot products ``auto`` takes the act8 kernel for (VNNI or AVX2)."""
    return quant_kernels.has_vnni() or quant_kernels.has_avx2()


def test_auto_takes_act8_where_the_cpu_has_integer_dots_and_refuses_widths_off_the_32_grid(cpp_kernels):
    parts = quantize_weight(torch.randn(8, 100), QuantSpec("int8", 0))
    with pytest.raises(ConfigError, match="multiples of 32"):
        QuantizedLinear(parts, QuantSpec("int8", 0, "cpp_act8"), 100)
    spec = QuantSpec("int4", 32, "cpp_act8")
    parts, x, _ = layer_case(spec, 24, 64, 2, seed=6)
    layer = QuantizedLinear(parts, spec, 64)
    assert layer.kernel == "cpp_act8"
    assert QuantizedLinear(parts, QuantSpec("int4", 32), 64).kernel == ("cpp_act8" if integer_dots() else "cpp")
    assert_matches(layer(x), act8_reference(spec, parts, x))
    off_grid = quantize_weight(torch.randn(8, 100), QuantSpec("int8", 0))
    assert QuantizedLinear(off_grid, QuantSpec("int8", 0), 100).kernel == "cpp"  # auto: the weight-only kernel


def test_tied_int4_head_and_token_table_share_one_copy_of_the_weights(cpp_kernels, tmp_path):
    """The cpp kernel reads the stored layout, so the head and the token lookup hold the same tensors."""
    from tinyformer.config import ModelConfig
    from tinyformer.models.decoder import DecoderLM
    from tinyformer.quantization import quantize_run
    from tinyformer.run_folder import load_model, save_model

    save_model(tmp_path / "run", DecoderLM(ModelConfig(vocab_size=40, d_model=32, n_layer=1, n_head=4,
                                                       n_kv_head=2, d_ff=64, max_seq_len=32)))
    quantize_run(tmp_path / "run", tmp_path / "q", QuantSpec("int4", 32, "cpp"))
    model = load_model(tmp_path / "q")
    assert model.lm_head.kernel == "cpp"
    for name in ("qweight", "scales", "zeros"):
        assert getattr(model.lm_head, name).data_ptr() == getattr(model.tok_emb, name).data_ptr()


@pytest.mark.parametrize("quant_type", ["int8", "int4"])
def test_a_token_table_tied_to_a_packed_head_reads_its_rows_from_the_head(cpp_kernels, tmp_path, quant_type):
    """cpp_act8 packs the head into its own layout: the token lookup reads rows of that layout (no portable
    copy of the table is kept) and gives dequant(W)[ids], W the stored table."""
    from tinyformer.components.quant_kernels import dequantize_weight
    from tinyformer.config import ModelConfig
    from tinyformer.models.decoder import DecoderLM
    from tinyformer.quantization import quantize_run
    from tinyformer.run_folder import iter_tensors, load_model, save_model

    save_model(tmp_path / "run", DecoderLM(ModelConfig(vocab_size=40, d_model=64, n_layer=1, n_head=4,
                                                       n_kv_head=2, d_ff=64, max_seq_len=32)))
    group = 32 if quant_type == "int4" else 0
    quantize_run(tmp_path / "run", tmp_path / "q", QuantSpec(quant_type, group, "cpp_act8"))
    model = load_model(tmp_path / "q")
    assert model.lm_head.kernel == "cpp_act8" and model.tok_emb.packed
    assert not any(hasattr(model.tok_emb, name) for name in ("qweight", "scales", "zeros"))
    for name in ("wp", "sp", "aux"):
        assert getattr(model.lm_head, name).data_ptr() == getattr(model.tok_emb, name).data_ptr()
    stored = {k.removeprefix("lm_head."): v for k, v in iter_tensors(tmp_path / "q") if k.startswith("lm_head.")}
    table = dequantize_weight(stored, quant_type)  # (40, 64), from the file
    ids = torch.tensor([[0, 39, 16, 15], [17, 3, 3, 31]])  # both ends, and both sides of a 16-row block
    torch.testing.assert_close(model.tok_emb(ids), table[ids], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("quant_type", ["int8", "int4"])
def test_a_token_table_read_from_a_packed_head_exports_with_a_symbolic_number_of_tokens(cpp_kernels, tmp_path,
                                                                                       quant_type):
    """The packaged speculative verification exports the model with T tokens per row symbolic: the lookup from
    a packed head must not fix T (it did through len(ids), and every act8 model's verification failed to
    export and ran eagerly). The exported lookup then gives the eager one's rows for another T."""
    from torch.export import Dim, export

    from tinyformer.config import ModelConfig
    from tinyformer.models.decoder import DecoderLM
    from tinyformer.quantization import quantize_run
    from tinyformer.run_folder import load_model, save_model

    save_model(tmp_path / "run", DecoderLM(ModelConfig(vocab_size=40, d_model=64, n_layer=1, n_head=4,
                                                       n_kv_head=2, d_ff=64, max_seq_len=32)))
    quantize_run(tmp_path / "run", tmp_path / "q", QuantSpec(quant_type, 32 if quant_type == "int4" else 0,
                                                              "cpp_act8"))
    table = load_model(tmp_path / "q").tok_emb
    assert table.packed
    exported = export(table, (torch.zeros(1, 5, dtype=torch.long),),
                      dynamic_shapes=({1: Dim("T", min=2, max=8)},), strict=False)
    ids = torch.tensor([[0, 39, 16]])
    assert torch.equal(exported.module()(ids), table(ids))


def test_quantize_refuses_act8_for_widths_off_the_32_grid_before_writing(tmp_path):
    from tinyformer.config import ModelConfig
    from tinyformer.models.decoder import DecoderLM
    from tinyformer.quantization import quantize_run
    from tinyformer.run_folder import save_model

    save_model(tmp_path / "run", DecoderLM(ModelConfig(vocab_size=40, d_model=48, n_layer=1, n_head=4,
                                                       n_kv_head=2, d_ff=96, max_seq_len=32)))
    with pytest.raises(ConfigError, match="multiples of 32"):
        quantize_run(tmp_path / "run", tmp_path / "q", QuantSpec("int8", 0, "cpp_act8"))
    assert not (tmp_path / "q").exists()


def test_without_a_compiler_one_line_says_so_and_layers_keep_the_pytorch_kernels(monkeypatch, capsys):
    monkeypatch.setattr(quant_kernels, "_compiler", lambda: None)
    monkeypatch.setattr(quant_kernels, "_state", {})
    assert not quant_kernels.available() and not quant_kernels.available()  # said once per process
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no C++ compiler" in err
    parts, x, expected = layer_case(QuantSpec("int8", 0), 24, 64, 2, seed=7)
    layer = QuantizedLinear(parts, QuantSpec("int8", 0), 64)
    assert layer.kernel == "aten"  # auto without the C++ kernels: as before they existed
    assert_matches(layer(x), expected)
    assert_matches(quant_kernels.int8_linear(x, parts["qweight"], parts["scales"]), expected)  # the formula
