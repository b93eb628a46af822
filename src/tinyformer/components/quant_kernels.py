"""int8 / int4 products on the CPU: a small C++ extension (weight-only kernels, an 8-bit-activation GEMM).

    int8_linear(x, q, s)     y = x dequant(W)^T,  dequant(W)_oi = s_og q_oi              (i in group g)
    int4_linear(x, q, s, z)  y = x dequant(W)^T,  dequant(W)_oi = s_og (u_oi - 8) + z_og

x (M, K) float, q int8 (N, K) or uint8 (N, K/2) (two 4-bit values u per byte, low nibble first), s and z
float32 (N, K/G) -> y (M, N) in x's dtype: the portable layout of ``tinyformer.components.quantized``, read
in place (no second copy of the weights). Each weight is widened to float32 in registers and multiplied
with every activation row there; the float matrix is never written. Decoding one token reads every weight
once, so this reads 1 (int8) or 0.5 (int4) byte per weight where float32 reads 4.

The source (``quant_kernels.cpp``: AVX-512, else AVX2 + FMA, chosen by a run-time check, a plain C++ loop
otherwise; the ops' ``path`` argument forces one, see ``WEIGHT_ONLY_PATHS`` / ``GEMM_PATHS``; threads over
output rows) is compiled at first use with ``torch.utils.cpp_extension.load`` (a C++ compiler and
``ninja``, as ``torch.compile`` on the CPU needs too) and cached under torch's extensions folder
(``TORCH_EXTENSIONS_DIR``); later processes load the cached library. The ops are registered with
``torch.library`` (``torch.ops.tinyformer.int8_linear`` / ``int4_linear``) with fake implementations, so a
``torch.compile``-d decode step calls them. Without a compiler the same formulas run in PyTorch
(``int8_linear_reference`` / ``int4_linear_reference``) and one line on stderr says so.

Not weight-only (``act8_gemm``, on weights packed once by ``pack_act8``, the form ``cpp_act8`` layers hold;
its formula on the portable layout is ``act8_gemm_reference``): the
activations are rounded to 8 bits per block of 32 columns first, as llama.cpp does for its Q8_0 / Q4_0
products (``round_activations``: x_i ~ d_b xq_i, d_b = max_b |x| / 127, |error| <= d_b / 2), and the
products are integer dot products (AVX-512 VNNI ``vpdpbusd``; on AVX2 ``vpmaddubsw`` + ``vpmaddwd``, with
operands that cannot saturate its int16 pair sums), several times fewer instructions per weight. int4's zero
points multiply the exact sums of x.
``act8_gemm`` tiles 4 rows x 48 output channels in registers, for one row (decoding) or many (prefill);
``dequantize_rows`` widens rows of W to float32 for the weight-only prefill (tiles handed to the BLAS).
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("quant_kernels.cpp")
_state: dict[str, object] = {}


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def _ninja_on_path() -> None:
    """torch's build runs ``ninja`` by name; the ninja wheel puts it in the environment's scripts folder,
    which is on PATH only when the environment is activated (``.venv/bin/tinyformer`` run directly is not)."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _build() -> None:
    from torch.utils.cpp_extension import load

    _ninja_on_path()

    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
    name = f"tinyformer_quant_kernels_{digest}"
    announce_build(name)
    clear_stale_lock(name)
    # ``load`` of the file (not ``load_inline``, which adds the Python headers) keeps the build short
    load(name=name, sources=[str(_SOURCE)], is_python_module=False,
         extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)

    for op, fake in _FAKES.items():
        torch.library.register_fake(f"tinyformer::{op}")(fake)


def build_folder(name: str) -> Path:
    """Where torch builds and caches the extension ``name``."""
    from torch.utils import cpp_extension

    try:  # torch's own rule (the root, then a python / CUDA version folder); private, hence the fallback
        return Path(cpp_extension._get_build_directory(name, verbose=False))
    except (AttributeError, TypeError, OSError):
        return Path(cpp_extension.get_default_build_root()) / name


# A build takes about a minute; a lock file older than this was left by a process killed while building
STALE_LOCK_S = 600.0


def clear_stale_lock(name: str, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove the build lock of extension ``name`` if it is older than ``max_age_s``: torch's builder waits for
    that file to go, so one left by a killed build (Ctrl-C, a killed CI job) would make every later process wait
    forever. Says so in one line on stderr; returns whether it removed one."""
    lock = build_folder(name) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:  # no lock: nobody is building
        return False
    if age < max_age_s:
        return False  # another process is building now: wait for it
    lock.unlink(missing_ok=True)
    print(f"tinyformer: removed a stale build lock ({lock}, {age / 60:.0f} min old, left by a build that was "
          "stopped)", file=sys.stderr, flush=True)
    return True


def announce_build(name: str) -> bool:
    """One line on stderr before the extension ``name`` is compiled (its library is not in torch's extensions
    folder yet): the first quantized run waits seconds for the compiler, later ones load the cached build.
    Returns whether it printed."""
    folder = build_folder(name)
    if (folder / f"{name}.so").is_file():
        return False
    print(f"tinyformer: compiling the CPU kernels (float32 / int8 / int4 products; once, about a minute; cached in "
          f"{folder}) ...", file=sys.stderr, flush=True)
    return True


# each op's output (shape and dtype) for torch.compile's tracing: the fake implementations registered by ``_build``
_FAKES = {
    "f32_linear": lambda x, w, b, path=0: x.new_empty((x.shape[0], w.shape[0])),
    "int8_linear": lambda x, q, s, path=0: x.new_empty((x.shape[0], q.shape[0])),  # (M, N)
    "int4_linear": lambda x, q, s, z, path=0: x.new_empty((x.shape[0], q.shape[0])),
    "act8_gemm": lambda x, wp, sp, aux, n, g, int4, path: x.new_empty((x.shape[0], n)),
    "dequantize_rows": lambda q, s, z, o0, o1: s.new_empty((o1 - o0, q.shape[1] * (2 if z is not None else 1)),
                                                           dtype=torch.float32),
    "row_attention": lambda q, k, v, mask, scale, path=0: q.new_empty(q.shape),  # contiguous, as the kernel's
    "act8_embedding": lambda wp, sp, aux, ids, g, int4: sp.new_empty((ids.shape[0], wp.shape[1] * (8 if int4 else 4)),
                                                                      dtype=torch.float32),
}


def row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None,
                  path: str = "auto") -> torch.Tensor:
    """softmax(scale q k^T + M) v with each query summed alone, key by key in slot order, over the keys its mask
    allows: q (B, H, T, d), k and v (B, H_kv, S, d) float32, mask bool broadcastable to (B, 1, T, S), True = may
    attend -> (B, H, T, d). A query's output does not depend on T, on S or on the other queries, so the T
    positions of a speculative verification get a one-token step's bits. Call ``available()`` first."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.ops.tinyformer.row_attention(q, k, v, mask, scale, WEIGHT_ONLY_PATHS[path])


def uses_kernels(model: torch.nn.Module) -> bool:
    """Whether a layer of ``model`` computes with these kernels (its ``uses_cpu_kernels`` is True:
    ``FewRowsLinear``, a ``cpp`` / ``cpp_act8`` quantized layer): then they are built already, and its caches
    attend with :func:`row_attention` per query (``KVCache(row_kernel=True)``)."""
    return any(getattr(m, "uses_cpu_kernels", False) for m in model.modules())


def dequantize_rows(t: dict[str, torch.Tensor], quant_type: str, o0: int, o1: int) -> torch.Tensor:
    """Rows o0..o1 of ``dequantize_weight(t)`` as float32, in one C++ pass where compiled."""
    if available():
        return torch.ops.tinyformer.dequantize_rows(t["qweight"], t["scales"], t.get("zeros"), o0, o1)
    return dequantize_weight({k: v[o0:o1] for k, v in t.items()}, quant_type)


def available() -> bool:
    """Whether the compiled ops are loaded; builds (or loads the cached build) on the first call. On failure
    (no compiler, no ninja, a build error) prints one line on stderr, once per process, and returns False."""
    if "ok" not in _state:
        reason = None
        if _compiler() is None:
            reason = "no C++ compiler found (set CXX or install g++/clang++)"
        else:
            try:
                _build()
            except Exception as exc:  # any build or load failure leaves the PyTorch formulas in charge
                lines = str(exc).strip().splitlines()
                reason = f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:300]
        _state["ok"] = reason is None
        if reason is not None:
            print(f"tinyformer: the CPU kernels could not be built ({reason}); "
                  "using the slower PyTorch formula", file=sys.stderr, flush=True)
    return bool(_state["ok"])


# ---------------------------------------------------------------- the formats' formulas (components/quantized.py
# quantizes with them; the reference kernels below compute with them)


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """(out, in) values in [0, 15] -> (out, in/2) uint8: column 2j low nibble, 2j+1 high nibble."""
    u = u.to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(out, in/2) uint8 -> (out, in) uint8 values in [0, 15]; inverse of ``pack_int4``."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def dequantize_weight(t: dict[str, torch.Tensor], quant_type: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """{"qweight", "scales"[, "zeros"]} -> W (out, in): s * q (int8) or s * (u - 8) + z (int4)."""
    q, s = t["qweight"], t["scales"].float()
    if quant_type == "int4":
        v = unpack_int4(q).float() - 8
    else:
        v = q.float()
    out_f, in_f = v.shape
    n_groups = s.shape[1]
    w = v.reshape(out_f, n_groups, in_f // n_groups) * s[..., None]
    if quant_type == "int4":
        w = w + t["zeros"].float()[..., None]
    return w.reshape(out_f, in_f).to(dtype)


def int8_linear_reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The formula in PyTorch: x (M, K) @ (s_og q_oi)^T, computed in float32, returned in x's dtype."""
    return (x.float() @ dequantize_weight({"qweight": q, "scales": s}, "int8").t()).to(x.dtype)


def int4_linear_reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The formula in PyTorch: x (M, K) @ (s_og (u_oi - 8) + z_og)^T in float32, returned in x's dtype."""
    return (x.float() @ dequantize_weight({"qweight": q, "scales": s, "zeros": z}, "int4").t()).to(x.dtype)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x (M, K), K % 32 == 0 -> d_b xq as float32: per block b of 32 columns d_b = max |x_b| / 127,
    xq = round(x / d_b) (half to even) in [-127, 127]; |x - d_b xq| <= d_b / 2."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127
    inv = torch.where(amax > 0, 127 / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    return (torch.round(xb * inv) * d).reshape(x.shape)


# The weight-only ops' ``path`` argument: "auto" takes the widest this CPU has (AVX-512 > AVX2 + FMA > plain C++);
# naming one forces it (tests, benchmarks), and the op refuses one the CPU lacks.
WEIGHT_ONLY_PATHS = {"auto": 0, "avx512": 1, "plain": 2, "avx2": 3}


def f32_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, path: str = "auto") -> torch.Tensor:
    """y = x W^T + b for float32 W (N, K) in nn.Linear's layout and x (..., K): the compiled op (call
    ``available()`` first). Up to 8 rows of x it runs its own kernels (``path``: ``WEIGHT_ONLY_PATHS``), which
    split the output rows over torch's threads, where MKL's sgemv keeps a row's product on one thread; past
    that, ``F.linear``."""
    y = torch.ops.tinyformer.f32_linear(x.reshape(-1, x.shape[-1]), w, b, WEIGHT_ONLY_PATHS[path])
    return y.view(*x.shape[:-1], w.shape[0])  # (..., N)


def int8_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, path: str = "auto") -> torch.Tensor:
    """y = x dequant(W)^T for int8 W (module doc): the compiled op where available (``path``:
    ``WEIGHT_ONLY_PATHS``), else the formula."""
    if available():
        return torch.ops.tinyformer.int8_linear(x, q, s, WEIGHT_ONLY_PATHS[path])
    return int8_linear_reference(x, q, s)


def int4_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, path: str = "auto") -> torch.Tensor:
    """y = x dequant(W)^T for int4 W (module doc): the compiled op where available (``path``:
    ``WEIGHT_ONLY_PATHS``), else the formula."""
    if available():
        return torch.ops.tinyformer.int4_linear(x, q, s, z, WEIGHT_ONLY_PATHS[path])
    return int4_linear_reference(x, q, s, z)


# ---------------------------------------------------------------- the 8-bit-activation GEMM's packed weights

# the C++ op's ``path`` argument: "auto" takes VNNI > AVX2 + FMA > plain C++ by the CPU's features
GEMM_PATHS = {"auto": 0, "vnni": 1, "plain": 2, "avx2": 3}


def has_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI (the compiled kernels' own run-time check); False without them."""
    return available() and bool(torch.ops.tinyformer.cpu_has_vnni())


def has_avx512() -> bool:
    """Whether this CPU has AVX-512 F/BW/VL + FMA (the weight-only kernels' wide path); False without them."""
    return available() and bool(torch.ops.tinyformer.cpu_has_avx512())


def has_avx2() -> bool:
    """Whether this CPU has AVX2 + FMA (both kernels' 256-bit path); False without the compiled kernels."""
    return available() and bool(torch.ops.tinyformer.cpu_has_avx2())


def pack_act8(t: dict[str, torch.Tensor], quant_type: str) -> dict[str, torch.Tensor]:
    """The portable {"qweight", "scales"[, "zeros"]} (N, K) -> the layout ``act8_gemm`` reads, made once at load:
    output channels in blocks of 16 (N padded to Np with zero rows), each block's K columns in quads of 4.

      int8: wp (Np/16, K/4, 16, 4) int8, wp[b, k/4, c, k%4] = q[16b + c, k]; sp (Np/16, K/G, 16) the scales;
            aux (Np/16, K/32, 16) int32 = -128 sum_{i in block} q (the activations enter as xq + 128)
      int4: wp (Np/16, K/8, 16, 4) uint8 = u[16b + c, 8p + j] | u[16b + c, 8p + 4 + j] << 4 (j < 4);
            sp (Np/16, K/G, 16) the scales; aux (Np/16, K/G, 16) float32 = z - 8 s
    K and G must be multiples of 32 (the activations' blocks)."""
    s = t["scales"].float()
    n = s.shape[0]
    np_ = -(-n // 16) * 16
    pad = np_ - n

    def blocks(v: torch.Tensor) -> torch.Tensor:  # (N, X) -> (Np/16, X, 16)
        v = torch.nn.functional.pad(v, (0, 0, 0, pad))
        return v.reshape(np_ // 16, 16, -1).transpose(1, 2).contiguous()

    if quant_type == "int8":
        q = t["qweight"]
        k = q.shape[1]
        qp = torch.nn.functional.pad(q, (0, 0, 0, pad))
        wp = qp.reshape(np_ // 16, 16, k // 4, 4).transpose(1, 2).contiguous()
        aux = blocks(-128 * q.reshape(n, k // 32, 32).sum(-1, dtype=torch.int32))
        return {"wp": wp, "sp": blocks(s), "aux": aux}
    u = unpack_int4(t["qweight"])
    k = u.shape[1]
    up = torch.nn.functional.pad(u, (0, 0, 0, pad)).reshape(np_ // 16, 16, k // 8, 2, 4)
    wp = (up[:, :, :, 0] | (up[:, :, :, 1] << 4)).transpose(1, 2).contiguous()
    return {"wp": wp, "sp": blocks(s), "aux": blocks(t["zeros"].float() - 8 * s)}


def act8_gemm(x: torch.Tensor, packed: dict[str, torch.Tensor], n: int, group: int, quant_type: str,
              path: str = "auto") -> torch.Tensor:
    """y (M, N) = round_activations(x) dequant(W)^T (int4: the zero points times the exact x, as
    ``act8_gemm_reference``) from ``pack_act8``'s layout: integer dot products over register tiles of
    4 rows x 48 output channels (AVX-512 VNNI), of 2 rows x 16 channels (AVX2, the layout read in 32-byte halves), or
    the same sums in plain C++; ``path`` (``GEMM_PATHS``) forces one, "auto" takes VNNI > AVX2 > plain by
    the CPU's features; without the compiled kernels, ``act8_gemm_reference``."""
    if not available():
        return act8_gemm_reference(x, packed, n, group, quant_type)
    return torch.ops.tinyformer.act8_gemm(x, packed["wp"], packed["sp"], packed["aux"], n, group,
                                          quant_type == "int4", GEMM_PATHS[path])


def unpack_act8(packed: dict[str, torch.Tensor], n: int, quant_type: str) -> dict[str, torch.Tensor]:
    """``pack_act8``'s inverse: the portable {"qweight", "scales"[, "zeros"]} of the first ``n`` channels."""
    return act8_rows(packed, torch.arange(n, device=packed["wp"].device), quant_type)


def act8_rows(packed: dict[str, torch.Tensor], ids: torch.Tensor, quant_type: str) -> dict[str, torch.Tensor]:
    """The portable {"qweight", "scales"[, "zeros"]} of rows ``ids`` (n,) of ``pack_act8``'s layout: row r is
    column r % 16 of channel block r // 16, so a token table tied to a packed head is read from the head's
    bytes (no second copy of the table); ``unpack_act8`` reads every row."""
    b, c = ids // 16, ids % 16
    w = packed["wp"][b, :, c]  # (n, K/4, 4) int8 or (n, K/8, 4) uint8: advanced indices first
    s = packed["sp"][b, :, c]  # (n, K/G)
    # flatten, not reshape(len(ids), -1): len() is a Python int, which would fix n in an exported graph (a
    # speculative verification's T tokens per row are symbolic)
    if quant_type == "int8":
        return {"qweight": w.flatten(1), "scales": s}
    u = torch.stack([w & 15, w >> 4], dim=2).flatten(1)  # (n, K/8, 2, 4) -> (n, K): 8p + 4h + j
    return {"qweight": pack_int4(u), "scales": s, "zeros": packed["aux"][b, :, c] + 8 * s}


def act8_embedding(packed: dict[str, torch.Tensor], ids: torch.Tensor, group: int, quant_type: str) -> torch.Tensor:
    """Rows ``ids`` (n,) of the float32 table a ``pack_act8`` layout holds: (n, K), as
    ``dequantize_weight(act8_rows(packed, ids, quant_type))`` computes them, in one C++ pass (a token table tied
    to a packed head); without the compiled kernels, that formula in PyTorch."""
    if not available():
        return dequantize_weight(act8_rows(packed, ids, quant_type), quant_type)
    return torch.ops.tinyformer.act8_embedding(packed["wp"], packed["sp"], packed["aux"], ids, group,
                                               quant_type == "int4")


def act8_gemm_reference(x: torch.Tensor, packed: dict[str, torch.Tensor], n: int, group: int,
                        quant_type: str) -> torch.Tensor:
    """``act8_gemm``'s formula in PyTorch on the portable layout (the fallback without a compiler): int8
    y = round_activations(x) dequant(W)^T; int4 y = round_activations(x) (s (u - 8))^T plus the zero points'
    terms on the exact x (z - 8 s times the exact group sums of x)."""
    t = unpack_act8(packed, n, quant_type)
    xr = round_activations(x)
    if quant_type == "int8":
        return int8_linear_reference(xr.to(x.dtype), t["qweight"], t["scales"])
    u, s = unpack_int4(t["qweight"]).float(), t["scales"].float()
    g = u.shape[1] // s.shape[1]
    y = xr @ (u.reshape(n, -1, g) * s[..., None]).reshape(n, -1).t()
    y = y + x.float().reshape(x.shape[0], -1, g).sum(-1) @ (t["zeros"].float() - 8 * s).t()
    return y.to(x.dtype)
