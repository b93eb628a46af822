"""Weight-only quantized linear layers and token tables: int8 and int4 weights, float activations.

A weight matrix W (out, in) is cut, row by row, into groups of G consecutive input columns
(G = in for int8 "per output channel", ``group_size`` 0). Group g of row o holds W[o, gG : (g+1)G].

    int8, symmetric:   s_og = max_i |W_oi| / 127                       (over the group's G values)
                       q_oi = clamp(round(W_oi / s_og), -127, 127)     int8
                       W_oi ~ s_og * q_oi                              |W_oi - s_og q_oi| <= s_og / 2
    int4, asymmetric:  s_og = (max_i W_oi - min_i W_oi) / 15,  m_og = min_i W_oi
                       u_oi = clamp(round((W_oi - m_og) / s_og), 0, 15)   4 bits
                       W_oi ~ s_og * (u_oi - 8) + z_og,  z_og = m_og + 8 s_og    |error| <= s_og / 2

``round`` is round-half-to-even (``torch.round``); a group whose values are all equal gets s = 0 and is
stored exactly (int4 through z). Scales (and int4 zero points) are float32, one per group: shape
(out, in / G). Stored int4 values are packed two per byte, (out, in / 2) uint8, column 2j in the low
nibble and column 2j+1 in the high one. The int4 zero point also expresses llama.cpp's Q4_0
(x = d (u - 8): z = 0) and Q4_1 (x = d u + m: z = m + 8 d) blocks, and int8 with G = 32 its Q8_0 blocks
(x = d q), exactly.

Forward: y = x dequant(W)^T + b, x (..., in) -> y (..., out), computed by one of these ``kernel`` s:
  * ``cpp`` (weight-only): ``tinyformer.components.quant_kernels``, a C++ extension (AVX-512, else AVX2) that
    reads the portable layout in place and widens each weight to float32 in registers, for M <=
    ``CPP_MAX_ROWS`` activation rows (M = batch x tokens; decoding). More rows (a prefill) widen
    ``DEQUANT_TILE_BYTES`` of output rows at a time in C++ (``dequantize_rows``) and call the BLAS, where the
    widening's cost is shared by the rows. Built at first use; without a C++ compiler the same formula runs
    in PyTorch.
  * ``cpp_act8`` (``auto``'s choice where in and G are multiples of 32 and the CPU has AVX-512 VNNI or AVX2): the
    activations are rounded to 8 bits per row and block b of 32 columns,
    x_i ~ d_b xq_i with d_b = max_b |x| / 127 (as llama.cpp's Q8_0 / Q4_0 products do), and multiplied as
    integers by weights packed once at load (``quant_kernels.pack_act8``; the layer keeps only that form) in
    a register-tiled GEMM (``quant_kernels.act8_gemm``: VNNI ``vpdpbusd``, 4 rows x 48 output channels a
    tile; on AVX2 ``vpmaddubsw``, 2 rows x 16 channels; int4 nibbles widened to bytes in registers), for any
    number of rows, one (decoding) to thousands (prefill). y differs from x dequant(W)^T by at most
    sum_b d_b / 2 sum_{i in b} |dequant(W)_oi| (int4: |s_og (u_oi - 8)| there, the zero points multiply the
    exact x).
  * ``dequant``: F.linear(x, dequant(W)), the formula itself. Eager, every call widens the weights
    (slower than float weights); under ``torch.compile`` the widening fuses into the product.
  * ``aten``: PyTorch's weight-only CPU kernels, ``aten._weight_int8pack_mm`` (int8 per output channel)
    and ``aten._weight_int4pack_mm_for_cpu`` (int4, G in {32, 64, 128, 256}, out % 16 == 0).
  * ``fbgemm`` (int8 per output channel only): torch.ao's dynamically quantized linear. It also rounds
    the activations to 8 bits, x ~ s_x (q_x - z_x) with one s_x = (max x - min(min x, 0)) / 255 per call
    (one row when decoding), and multiplies integers, as llama.cpp does for its Q8_0 dot products (there
    per 32 values) -- so it is not weight-only: y differs from x dequant(W)^T by the activation rounding,
    at most sum_i |dequant(W)_oi| s_x / 2 per output. On a CPU without VNNI its integer products are
    ``vpmaddubsw``, whose int16 pair sums saturate for 8-bit activations (the outputs came out wrong by tens
    on an AVX2 EPYC): there x is rounded to 7 bits, s_x = (max x - min(min x, 0)) / 127
    (:func:`fbgemm_reduce_range`). ``torch.compile`` cannot trace it.
``benchmarks/bench_quant_kernels.py`` measures them (docs/benchmarks/quantized.md has the figures).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tinyformer.components import quant_kernels
from tinyformer.components.quant_kernels import dequantize_weight, pack_int4, unpack_int4
from tinyformer.errors import ConfigError

QUANT_TYPES = ("int8", "int4")
KERNELS = ("auto", "cpp", "cpp_act8", "dequant", "aten", "fbgemm")
# Rows up to which the weight-only cpp kernel beats widening the weights once (dequantize_rows) and calling
# the BLAS (measured: docs/benchmarks/quantized.md, 1 thread): its cost grows with the rows, the widening's does
# not; at 16 rows the kernel was faster on every shape and layout, at 32 on half of them, at 64 on two.
CPP_MAX_ROWS = 16
DEQUANT_TILE_BYTES = 8 * 2**20
INT4_KERNEL_GROUPS = (32, 64, 128, 256)


@dataclass(frozen=True)
class QuantSpec:
    """How a run's linear weights are quantized: ``type`` int8 | int4; ``group_size`` G (0 = one scale per
    output row, int8 only; int4 needs G >= 2, even); ``kernel`` the forward computation (see module doc;
    ``auto`` picks, on a CPU with the C++ kernels, ``cpp_act8`` where the CPU has integer dot products
    (AVX-512 VNNI or AVX2) and in and G are multiples of 32, else the weight-only ``cpp``; without the C++
    kernels ``aten`` for int8 per channel and for int4 where its kernel applies, else ``dequant``; off the
    CPU ``dequant``. ``fbgemm`` is only used when asked for)."""

    type: str
    group_size: int = 0
    kernel: str = "auto"

    def __post_init__(self) -> None:
        if self.type not in QUANT_TYPES:
            raise ConfigError(f"quantization type {self.type!r} is not one of {', '.join(QUANT_TYPES)}")
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            raise ConfigError(f"quantization group_size must be a non-negative integer, got {g!r}")
        if self.type == "int4" and (g < 2 or g % 2):
            raise ConfigError(f"int4 needs an even group_size >= 2 (e.g. 32, 64, 128), got {g}")
        if self.kernel not in KERNELS:
            raise ConfigError(f"quantization kernel {self.kernel!r} is not one of {', '.join(KERNELS)}")
        if self.kernel == "fbgemm" and (self.type != "int8" or g != 0):
            raise ConfigError("kernel 'fbgemm' needs int8 with one scale per output channel (group_size 0)")

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "group_size": self.group_size, "kernel": self.kernel}

    @classmethod
    def from_dict(cls, data: Any) -> QuantSpec:
        if not isinstance(data, dict):
            raise ConfigError(f"quantization must be a mapping, got {data!r}")
        unknown = sorted(set(data) - {"type", "group_size", "kernel"})
        if unknown:
            raise ConfigError(f"unknown quantization field(s): {', '.join(unknown)}")
        if "type" not in data:
            raise ConfigError("quantization needs a 'type' (int8 or int4)")
        return cls(**data)

    def groups(self, in_features: int) -> int:
        """G for a matrix with ``in_features`` columns; ConfigError if it does not divide them."""
        g = self.group_size or in_features
        if in_features % g:
            raise ConfigError(f"group_size {g} does not divide the {in_features} input columns of a weight")
        return g


# ------------------------------------------------------------------ quantize / dequantize (the formulas)


def quantize_weight(w: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """W (out, in) float -> {"qweight", "scales"} (+ "zeros" for int4), the module doc's formulas, computed in
    float32 whatever W's dtype."""
    out_f, in_f = w.shape
    g = spec.groups(in_f)
    wg = w.detach().float().reshape(out_f, in_f // g, g)
    if spec.type == "int8":
        scale = wg.abs().amax(-1) / 127
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(wg / safe[..., None]).clamp(-127, 127).to(torch.int8)
        return {"qweight": q.reshape(out_f, in_f), "scales": scale.contiguous()}
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    u = torch.round((wg - lo[..., None]) / safe[..., None]).clamp(0, 15)
    zeros = lo + 8 * scale
    return {"qweight": pack_int4(u.reshape(out_f, in_f)), "scales": scale.contiguous(), "zeros": zeros.contiguous()}


@functools.cache
def fbgemm_reduce_range() -> bool:
    """Whether fbgemm's dynamic linear must round activations to 7 bits on this CPU: where it has no VNNI
    (``avx512_vnni`` / ``avx_vnni`` in /proc/cpuinfo's flags) its products saturate with 8 (PyTorch's own
    x86 quantization config sets ``reduce_range`` for the same reason). Read once per process."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    return not flags & {"avx512_vnni", "avx_vnni"}


def resolve_kernel(spec: QuantSpec, out_features: int, in_features: int, device: torch.device) -> str:
    """The kernel one layer uses: the spec's, or for ``auto`` the fastest measured that applies."""
    g = spec.groups(in_features)
    aten_applies = (spec.type == "int8" and spec.group_size == 0) or (
        spec.type == "int4" and device.type == "cpu" and out_features % 16 == 0 and g in INT4_KERNEL_GROUPS)
    kernel = spec.kernel
    if kernel == "auto":
        if device.type != "cpu":
            return "dequant"
        if quant_kernels.available():
            # 8-bit activations as llama.cpp rounds them, integer products: ~2x the weight-only kernel's rate
            # at one row and the only quantized product faster than float32 over many rows, where the CPU
            # has integer dot products (docs/benchmarks/quantized.md); else the weight-only kernel
            integer_dots = quant_kernels.has_vnni() or quant_kernels.has_avx2()
            return "cpp_act8" if integer_dots and in_features % 32 == 0 and g % 32 == 0 else "cpp"
        return "aten" if aten_applies else "dequant"
    if kernel == "aten" and not aten_applies:
        raise ConfigError(f"kernel 'aten' does not apply to a {out_features} x {in_features} {spec.type} weight "
                          f"with group_size {spec.group_size} on {device.type} (int8 needs group_size 0; int4 "
                          f"needs a CPU, out % 16 == 0 and G in {INT4_KERNEL_GROUPS})")
    if kernel in ("fbgemm", "cpp", "cpp_act8") and device.type != "cpu":
        raise ConfigError(f"kernel {kernel!r} runs on the CPU only")
    if kernel == "cpp_act8" and (in_features % 32 or g % 32):
        raise ConfigError(f"kernel 'cpp_act8' needs input columns and group_size in multiples of 32, got a "
                          f"{out_features} x {in_features} weight with groups of {g}")
    return kernel


# ------------------------------------------------------------------ modules


class QuantizedLinear(nn.Module):
    """y = x dequant(W)^T + b with W stored as int8 / int4 plus per-group scales (see the module doc).

    Holds the weights in the form its kernel reads (non-persistent buffers); the portable form
    (``quantize_weight``'s dict) is what run folders store. ``bias`` stays a float parameter.
    """

    @property
    def uses_cpu_kernels(self) -> bool:  # quant_kernels.uses_kernels
        return self.kernel in ("cpp", "cpp_act8")

    def __init__(self, portable: dict[str, torch.Tensor], spec: QuantSpec, in_features: int,
                 bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        q = portable["qweight"]
        self.spec = spec
        self.in_features = in_features
        self.out_features = q.shape[0]
        self.group = spec.groups(in_features)
        self.kernel = resolve_kernel(spec, self.out_features, in_features, q.device)
        self.bias = nn.Parameter(bias.to(dtype), requires_grad=False) if bias is not None else None
        self.dtype = dtype
        self._fbgemm: Any = None
        self.gemm_path = "auto"  # cpp_act8: the C++ op's code path ("vnni" / "avx2" / "plain" force one: tests)
        scales = portable["scales"].float()
        if self.kernel == "cpp_act8":  # packed once for the GEMM (quant_kernels.pack_act8); no portable copy kept
            for name, t in quant_kernels.pack_act8({**portable, "scales": scales}, spec.type).items():
                self.register_buffer(name, t, persistent=False)
        elif self.kernel == "fbgemm":
            with warnings.catch_warnings():  # torch 2.13 marks the quantized tensor type deprecated
                warnings.simplefilter("ignore", UserWarning)
                s = scales.reshape(-1)
                s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero row: q = 0 with any scale
                w = torch.quantize_per_channel(q.float() * s[:, None], s.double(),
                                               torch.zeros(self.out_features, dtype=torch.long), 0, torch.qint8)
                self._fbgemm = torch.ops.quantized.linear_prepack(w, None)
        elif self.kernel == "aten" and spec.type == "int8":
            self.register_buffer("qweight", q, persistent=False)
            self.register_buffer("scales", scales.reshape(-1).to(dtype), persistent=False)
        elif self.kernel == "aten":
            u = unpack_int4(q).to(torch.int32)
            self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1),
                                 persistent=False)
            sz = torch.stack([scales.t(), portable["zeros"].float().t()], dim=-1).contiguous()  # (in/G, out, 2)
            self.register_buffer("scales_and_zeros", sz.to(dtype), persistent=False)
        else:  # cpp, dequant: the portable tensors, scales (and zeros) float32 for the C++ kernels, else in dtype
            s_dtype = torch.float32 if self.kernel == "cpp" else dtype
            self.register_buffer("qweight", q, persistent=False)
            self.register_buffer("scales", scales.to(s_dtype), persistent=False)
            if spec.type == "int4":
                self.register_buffer("zeros", portable["zeros"].float().to(s_dtype), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """dequant(W) (out, in): for code that needs the matrix itself (the fused loss); the forward never does."""
        if self.kernel == "fbgemm":
            w, _ = torch.ops.quantized.linear_unpack(self._fbgemm)
            return w.dequantize().to(self.dtype)
        t = getattr(self, "qweight", None)
        device = t.device if isinstance(t, torch.Tensor) else torch.device("cpu")
        eye = torch.eye(self.in_features, dtype=self.dtype, device=device)
        bias, self.bias = self.bias, None
        try:
            return self(eye).t().contiguous()
        finally:
            self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.kernel == "cpp_act8":
            y = quant_kernels.act8_gemm(x2, {"wp": self.wp, "sp": self.sp, "aux": self.aux}, self.out_features,
                                        self.group, self.spec.type, self.gemm_path)
        elif self.kernel == "cpp" and x2.shape[0] <= CPP_MAX_ROWS:  # the C++ kernels (components/quant_kernels.py)
            if self.spec.type == "int8":
                y = quant_kernels.int8_linear(x2, self.qweight, self.scales)
            else:
                y = quant_kernels.int4_linear(x2, self.qweight, self.scales, self.zeros)
        elif self.kernel == "fbgemm":
            y = torch.ops.quantized.linear_dynamic(x2.float(), self._fbgemm, fbgemm_reduce_range()).to(x.dtype)
        elif self.kernel == "aten" and self.spec.type == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)
        elif self.kernel == "aten":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group, self.scales_and_zeros)
        elif self.kernel == "cpp":
            y = self._tiled_dequant_linear(x2)
        else:
            y = F.linear(x2, dequantize_weight(self._portable(), self.spec.type, x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def _portable(self) -> dict[str, torch.Tensor]:
        """The weight's {"qweight", "scales"[, "zeros"]} as this layer holds them (kernels cpp, dequant)."""
        parts = {"qweight": self.qweight, "scales": self.scales}
        if self.spec.type == "int4":
            parts["zeros"] = self.zeros
        return parts

    def _tiled_dequant_linear(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 dequant(W)^T for many rows, widening W a tile of output rows at a time (at most
        ``DEQUANT_TILE_BYTES`` of float weights alive at once, not the whole matrix: the head of a 49k-token
        vocabulary would be 113 MiB)."""
        step = max(1, DEQUANT_TILE_BYTES // (4 * self.in_features))
        out = x2.new_empty(x2.shape[0], self.out_features)
        parts = self._portable()
        for o in range(0, self.out_features, step):
            w = quant_kernels.dequantize_rows(parts, self.spec.type, o, min(o + step, self.out_features))
            torch.matmul(x2, w.to(x2.dtype).t(), out=out[:, o : o + step])
        return out

    def extra_repr(self) -> str:
        g = "per-channel" if self.spec.group_size == 0 else f"group {self.group}"
        return f"{self.in_features} -> {self.out_features}, {self.spec.type} {g}, kernel {self.kernel}"


class QuantizedEmbedding(nn.Module):
    """Token lookup from a quantized table: E[ids] = dequant(rows ids of W), (...,) -> (..., d).

    Reads only the rows asked for: from the portable form, or, for a table tied to a head whose kernel
    packed it (``cpp_act8``), from the head's packed tensors (``quant_kernels.act8_embedding``), so that the
    table's bytes are held once."""

    def __init__(self, portable: dict[str, torch.Tensor], quant_type: str, dtype: torch.dtype = torch.float32,
                 head: QuantizedLinear | None = None) -> None:
        super().__init__()
        self.quant_type = quant_type
        self.dtype = dtype
        self.packed = head is not None and head.kernel == "cpp_act8"
        if self.packed:
            for name in ("wp", "sp", "aux"):
                self.register_buffer(name, getattr(head, name), persistent=False)
            return
        self.register_buffer("qweight", portable["qweight"], persistent=False)
        self.register_buffer("scales", portable["scales"].to(dtype), persistent=False)
        if quant_type == "int4":
            self.register_buffer("zeros", portable["zeros"].to(dtype), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self.packed:  # the C++ op: a compiled graph's first norm then sums each token's row as eager does
            columns = self.wp.shape[1] * (8 if self.quant_type == "int4" else 4)
            packed = {"wp": self.wp, "sp": self.sp, "aux": self.aux}
            table = quant_kernels.act8_embedding(packed, flat, columns // self.sp.shape[1], self.quant_type)
            return table.to(self.dtype).reshape(*ids.shape, -1)
        rows = {"qweight": self.qweight[flat], "scales": self.scales[flat]}
        if self.quant_type == "int4":
            rows["zeros"] = self.zeros[flat]
        return dequantize_weight(rows, self.quant_type, self.dtype).reshape(*ids.shape, -1)
