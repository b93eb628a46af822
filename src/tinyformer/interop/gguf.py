"""Import GGUF files (llama.cpp's format) of the Llama family (and Mixtral), Qwen2/3, Qwen3-MoE, Phi-3 and
Gemma 2/3: weights, config and tokenizer.

A GGUF file is a header of typed key/value metadata followed by tensors, each stored as float
(F32, F16, BF16) or in one of ggml's block quantizations. This module turns one into the pair a
Hugging Face folder would give -- a ``config.json`` dict and HF-named tensors -- and hands both to the
same pipeline as ``hf_folder.import_hf`` (``convert_pipeline.import_checkpoint``), so the Llama adapter does the rest.

Weights. Quantized tensors are dequantized to float32 with ``gguf.quants.dequantize`` (the reference
Python implementation of ggml's formats, e.g. Q8_0: x = d * q, with one float16 scale d per block of 32
int8 values; Q4_K: 256-value super-blocks of eight 32-value blocks, x = d * s_j * q - dmin * m_j with
6-bit block scales s_j and mins m_j). Float tensors are copied as they are.

RoPE. llama.cpp rotates adjacent pairs (2i, 2i+1) for the ``llama`` architecture, so its converter
permutes each head's rows of W_q and W_k (and their biases) from Hugging Face's half-split order:

    gguf = hf.reshape(n_head, 2, d_head / 2, d_in).swapaxes(1, 2).reshape(rows, d_in)

Reading undoes it: ``hf = gguf.reshape(n_head, d_head / 2, 2, d_in).swapaxes(1, 2).reshape(rows, d_in)``
(n_head = the key/value head count for W_k). ``qwen2`` and ``qwen3`` files use llama.cpp's half-split
("neox") RoPE and are not permuted; ``qwen3`` adds the per-head q/k norms ``attn_q_norm``/``attn_k_norm``.
``gemma3`` files store every norm gain as 1 + g (ggml's RMSNorm multiplies by the stored gain), which the
import turns back into Gemma's g; llama.cpp fixes Gemma 3's layer pattern (every 6th layer global), the local
layers' RoPE base (10000) and the score scale (head_dim^-1/2), so the import does too.
``gemma2`` files are stored alike, with the soft-caps as ``attn_logit_softcapping`` / ``final_logit_softcapping``
and every 2nd layer global. Where the file states them, ``attention.scale`` (the score scale s, read as
query_pre_attn_scalar = s^-2), ``attention.sliding_window_pattern`` (every n-th layer global, or one flag per layer)
and ``rope.freq_base_swa`` (the local layers' base) override those fixed values.

Phi-3 (``phi3``). Q, K, V are one matrix ``attn_qkv`` and ``ffn_up`` holds gate and up stacked (rows: gate, then
up): the same fused layouts as Hugging Face's ``qkv_proj`` / ``gate_up_proj`` and tinyformer's own. Half-split RoPE.
LongRoPE is stored as two tensors of per-frequency divisors, ``rope_factors_short`` / ``rope_factors_long``, with
``rope.scaling.original_context_length`` (L0) and ``rope.scaling.attn_factor`` (the cos/sin scale): they become
``rope_scaling = {"rope_type": "longrope", ...}`` (attention_factor only when it differs from sqrt(1 + ln(f) /
ln(L0)), f = context / L0, the value Hugging Face derives). ``attention.sliding_window`` (0 = none) gives every layer
the window, as Hugging Face's Phi-3 does (llama.cpp currently ignores it for Phi-3).

Mixtures of experts. ``expert_count`` / ``expert_used_count`` give n_experts and k; the router is ``ffn_gate_inp``;
the experts' matrices are stacked, ``ffn_{gate,up,down}_exps`` of shape (E, rows, cols), or (older files) one
tensor per expert, ``ffn_{gate,up,down}.e``. Each expert is read as its own slice (dequantized alone). A ``llama``
file with experts is a Mixtral (softmax, top k, renormalised); ``qwen3moe`` is Qwen3 with experts of width
``expert_feed_forward_length``, renormalised unless ``expert_weights_norm`` is false (llama.cpp renormalises).
Shared experts and other gating functions are refused.
Llama 3.1 RoPE scaling is stored as a ``rope_freqs`` tensor of per-frequency divisors; it is turned back
into ``rope_scaling = {"rope_type": "llama3", ...}`` and checked to reproduce the tensor.

Tokenizer. ``tokenizer.ggml.model = "gpt2"`` (byte-level BPE: tokens + merges) and ``"llama"``
(SentencePiece BPE: tokens + scores, merges rebuilt from the scores, byte fallback) become a
``tokenizers`` tokenizer.json; control tokens become special tokens; ``tokenizer.chat_template`` goes to
tokenizer_config.json.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tinyformer.devices import parse_dtype
from tinyformer.errors import CheckpointError, ConfigError
from tinyformer.interop import gemma, llama
from tinyformer.interop.convert_pipeline import DEFAULT_SHARD_BYTES, ConvertReport, import_checkpoint, write_json
from tinyformer.interop.tensor_sources import TensorSource

ARCHITECTURES = {**llama.ARCHITECTURES, **gemma.ARCHITECTURES}  # HF model_type -> its *ForCausalLM class

# GGUF general.architecture -> HF model_type (a "llama" file with expert_count > 0 is a Mixtral)
ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "phi3": "phi3",
         "gemma2": "gemma2", "gemma3": "gemma3_text"}
PERMUTED_ARCHS = ("llama",)  # llama.cpp's interleaved (GPT-J style) RoPE
SLIDING_ARCHS = ("phi3", "gemma2", "gemma3")  # archs whose attention.sliding_window llama.cpp's writer sets
GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}  # llama.cpp's fixed pattern: every n-th layer global

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma's four norms per layer; llama.cpp stores every Gemma norm gain as 1 + g (ggml multiplies by the gain)
_GEMMA_BLOCK = {**_BLOCK, "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3: q, k, v fused as attn_qkv; ffn_up holds gate and up stacked (Hugging Face's gate_up_proj)
_PHI3_BLOCK = {**_BLOCK, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
BLOCK_NAMES = {"gemma2": _GEMMA_BLOCK, "gemma3": _GEMMA_BLOCK, "phi3": _PHI3_BLOCK}
NORM_PLUS_ONE_ARCHS = ("gemma2", "gemma3")
GEMMA3_LOCAL_THETA = 10000.0  # llama.cpp's fixed RoPE base of Gemma 3's sliding-window layers
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_EXPERTS_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")  # (E, rows, cols), all experts
_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")  # one expert (older files)
NOT_WEIGHTS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")  # -> rope_scaling


def _gguf():
    try:
        import gguf
    except ModuleNotFoundError:
        raise ConfigError("reading GGUF files needs the 'gguf' package: pip install 'tinyformer[gguf]'") from None
    return gguf


def supported_types() -> dict[Any, torch.dtype]:
    """GGML tensor types this importer reads, and the dtype each becomes."""
    Q = _gguf().GGMLQuantizationType
    out = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
        out[getattr(Q, name)] = torch.float32
    return out


def hf_name(gguf_name: str, arch: str = "llama", model_type: str | None = None) -> str:
    """HF name of a GGUF tensor (unknown names are returned unchanged, to be reported as unknown).

    ``model_type`` (the HF one) names a mixture of experts' router and per-expert tensors; a stacked
    ``ffn_*_exps`` tensor has no single HF name (``expert_names`` gives one per expert)."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    moe = llama.MOE_NAMES.get(model_type or "")
    m = _EXPERT_RE.fullmatch(gguf_name)
    if m and moe:
        return _expert_name(moe, m.group(1), int(m.group(3)), m.group(2))
    block = BLOCK_NAMES.get(arch, _BLOCK)
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and moe and m.group(2) == "ffn_gate_inp":
        return f"model.layers.{m.group(1)}.{moe[0]}.{m.group(3)}"
    if m and m.group(2) in block:
        return f"model.layers.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"
    return gguf_name


def expert_names(gguf_name: str, n_experts: int, model_type: str) -> list[str]:
    """The HF names of the experts stacked in ``blk.i.ffn_{gate,up,down}_exps.weight``, in stacking order."""
    m = _EXPERTS_RE.fullmatch(gguf_name)
    if m is None or model_type not in llama.MOE_NAMES:
        return []
    return [_expert_name(llama.MOE_NAMES[model_type], m.group(1), e, m.group(2)) for e in range(n_experts)]


def _expert_name(moe: tuple[str, ...], layer: str, expert: int, which: str) -> str:
    """HF name of expert ``expert``'s gate, up or down matrix (``which``) in layer ``layer``."""
    _, experts, gate, up, down = moe
    return f"model.layers.{layer}.{experts}.{expert}.{dict(gate=gate, up=up, down=down)[which]}.weight"


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, interleaved pairs back to two halves."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


#: bytes of each fixed-size GGUF metadata value type (uint8, int8, ..., bool = 7, uint64 = 10, float64 = 12)
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def check_declared_sizes(path: Path) -> None:
    """Walk a GGUF header and check every count it declares against the bytes that remain in the file,
    before the gguf package's reader (which loops over a declared count, however large) sees it.

    The layout (little- or big-endian, told by the version field):

        magic "GGUF", version u32, tensor_count u64, kv_count u64
        kv_count x  (key: string, value type u32, value)
        tensor_count x  (name: string, n_dims u32, dims u64[n_dims], ggml type u32, offset u64)
        string = length u64, bytes;  array = item type u32, count u64, items

    A declared count that needs more bytes than remain (a u8 array of 10^12 items in a 133-byte file)
    raises a CheckpointError at once; a string array is walked item by item, each item at least 8 bytes,
    so the walk is bounded by the file's size."""
    size = path.stat().st_size
    if size < 24:
        raise CheckpointError(f"{path} is not a readable GGUF file (truncated: {size} bytes)")
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as f:
        data = f[:24]
        order = "<" if struct.unpack("<I", data[4:8])[0] & 0xFFFF else ">"
        pos = 24

        def need(n: int, what: str) -> None:
            if n < 0 or pos + n > size:
                raise CheckpointError(f"{path} is not a readable GGUF file: {what} needs {n:,} bytes, "
                                      f"only {max(size - pos, 0):,} remain (corrupt or hostile)")

        def u(fmt: str, what: str) -> int:
            nonlocal pos
            n = struct.calcsize(fmt)
            need(n, what)
            pos += n
            return struct.unpack_from(order + fmt, f, pos - n)[0]

        def skip_string(what: str) -> None:
            nonlocal pos
            length = u("Q", what)
            need(length, what)
            pos += length

        def skip_value(kind: int, what: str, depth: int = 0) -> None:
            nonlocal pos
            if kind in _GGUF_SCALAR_BYTES:
                need(_GGUF_SCALAR_BYTES[kind], what)
                pos += _GGUF_SCALAR_BYTES[kind]
            elif kind == _GGUF_STRING:
                skip_string(what)
            elif kind == _GGUF_ARRAY and depth < 8:
                item, count = u("I", what), u("Q", what)
                if item in _GGUF_SCALAR_BYTES:
                    need(count * _GGUF_SCALAR_BYTES[item], f"{what} ({count:,} items)")
                    pos += count * _GGUF_SCALAR_BYTES[item]
                    return
                need(count * 8, f"{what} ({count:,} items)")  # strings and arrays take at least 8 bytes each
                for _ in range(count):
                    skip_value(item, what, depth + 1)
            else:
                raise CheckpointError(f"{path} is not a readable GGUF file: {what} has unknown value type {kind}")

        n_tensors, n_kv = struct.unpack(order + "QQ", data[8:24])
        need(n_kv * 12, f"the metadata ({n_kv:,} entries)")  # key length u64 + value type u32 at least
        for i in range(n_kv):
            skip_string(f"metadata key {i}")
            skip_value(u("I", f"metadata entry {i}"), f"metadata entry {i}")
        need(n_tensors * 24, f"the tensor directory ({n_tensors:,} tensors)")
        for i in range(n_tensors):
            skip_string(f"tensor {i}'s name")
            n_dims = u("I", f"tensor {i}")
            need(n_dims * 8 + 12, f"tensor {i}'s {n_dims:,} dimensions")
            pos += n_dims * 8 + 12


class GGUFFile:
    """A GGUF file's metadata and tensor directory (tensor data stays on disk until read)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"GGUF file {self.path} does not exist")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise CheckpointError(f"{self.path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        gguf = _gguf()
        check_declared_sizes(self.path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as exc:  # the reader raises ValueError, IndexError, struct errors... for bad files
            raise CheckpointError(f"{self.path} is not a readable GGUF file (corrupt or truncated: "
                                  f"{type(exc).__name__}: {exc})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        types = supported_types()
        for t in self.reader.tensors:
            if t.tensor_type not in types:
                raise CheckpointError(f"{self.path}: tensor {t.name!r} uses GGML type {t.tensor_type.name}, which "
                                      f"is not supported (supported: {', '.join(q.name for q in types)})")
            if t.data_offset + t.n_bytes > self.path.stat().st_size:
                raise CheckpointError(f"{self.path} is truncated inside tensor {t.name!r}")

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as exc:
            raise CheckpointError(f"{self.path}: metadata {key!r} is unreadable ({exc})") from None

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.path}: metadata key {key!r} is missing")
        return value

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        """The tensor as numpy, shape (rows, cols): float tensors as stored, quantized ones dequantized.
        ``index``: only slice ``index`` of a 3-D tensor (one expert of a stack), shape (rows, cols)."""
        gguf = _gguf()
        t = self.tensors[name]
        Q = gguf.GGMLQuantizationType
        shape = [int(d) for d in reversed(t.shape.tolist())]
        data = t.data
        if index is not None:  # the reader's view is (E, rows, row bytes or values): one expert's rows
            data, shape = data[index], shape[1:]
        if t.tensor_type in (Q.F32, Q.F16):
            arr = np.array(data, copy=True)
        else:
            arr = gguf.quants.dequantize(data, t.tensor_type)
        self._release(t)
        return arr.reshape(shape)

    def _release(self, t: Any) -> None:
        # The reader memory-maps the whole file: drop the pages just read from this process's resident
        # set (they stay in the page cache), so importing a large file does not look like loading it all.
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise"):
            return
        start = (int(t.data_offset) // mmap.PAGESIZE) * mmap.PAGESIZE
        end = int(t.data_offset) + int(t.n_bytes)
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError, AttributeError):
            pass


def _f32(value: float) -> float:
    # GGUF stores float32: 1e-6 arrives as 9.99999997e-07; take the shortest decimal with the same float32
    return float(str(np.float32(value)))


def llama3_scaling(factors: np.ndarray, head_dim: int, theta: float, path: Path) -> dict[str, Any]:
    """The llama3 ``rope_scaling`` reproducing llama.cpp's ``rope_freqs`` divisors.

    llama.cpp writes, per frequency theta_i with wavelength w_i = 2 pi / theta_i: 1 when w_i < L0/high,
    ``factor`` when w_i > L0/low, else 1 / ((1 - s)/factor + s) with s = (L0/w_i - low)/(high - low).
    Only L0/low and L0/high matter, so L0 = 8192 (Llama 3.1's) is kept and low/high are fitted to the
    in-between frequencies when Meta's 1 and 4 do not reproduce them; the result is checked."""
    from tinyformer.components.rope import default_inv_freq

    factors = np.asarray(factors, dtype=np.float64)
    wavelen = (2 * math.pi / default_inv_freq(head_dim, theta).double()).numpy()
    factor = float(factors.max())
    l0 = 8192
    candidates = [(1.0, 4.0)]
    medium = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    if medium.sum() >= 2 and factor > 1:
        s = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(l0 / wavelen[medium], s, 1)
        low = -intercept / slope
        candidates.append((float(low), float(low + 1 / slope)))

    def divisors(low: float, high: float) -> np.ndarray:
        smooth = (l0 / wavelen - low) / (high - low)
        mid = 1 / ((1 - smooth) / factor + smooth)
        return np.where(wavelen < l0 / high, 1.0, np.where(wavelen > l0 / low, factor, mid))

    for low, high in candidates:
        if 0 < low < high and np.allclose(divisors(low, high), factors, rtol=1e-4, atol=1e-5):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": round(low, 6),
                    "high_freq_factor": round(high, 6), "original_max_position_embeddings": l0}
    raise ConfigError(f"{path}: the rope_freqs tensor matches no llama3 RoPE scaling; other per-frequency "
                      "scalings are not supported")


def hf_config_from_gguf(g: GGUFFile) -> dict[str, Any]:
    """A Hugging Face config.json dict from the GGUF metadata. The architecture string selects the key prefix
    and llama.cpp's fixed choices for that architecture; every other option comes from a key or from which
    tensors the file holds."""
    arch = g.require("general.architecture")
    if arch not in ARCHS:
        raise ConfigError(f"{g.path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHS)})")

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        return g.require(f"{arch}.{name}") if required else g.get(f"{arch}.{name}", default)

    n_experts = int(key("expert_count", 0) or 0)
    model_type = "mixtral" if arch == "llama" and n_experts else ARCHS[arch]
    if n_experts and model_type not in llama.MOE_NAMES:
        raise ConfigError(f"{g.path}: {arch}.expert_count={n_experts}: experts are supported in 'llama' (Mixtral) "
                          "and 'qwen3moe' files only")
    if model_type in llama.MOE_NAMES and not n_experts:
        raise ConfigError(f"{g.path}: metadata key {arch + '.expert_count'!r} is missing")

    n_head = key("attention.head_count", required=True)
    n_kv = key("attention.head_count_kv", n_head)
    if isinstance(n_kv, list):
        if len(set(n_kv)) != 1:
            raise ConfigError(f"{g.path}: a per-layer key/value head count ({sorted(set(n_kv))}) is not supported")
        n_kv = n_kv[0]
    hidden = key("embedding_length", required=True)
    head_dim = key("attention.key_length") or hidden // n_head
    if key("attention.value_length", head_dim) != head_dim:
        raise ConfigError(f"{g.path}: attention.value_length != key_length is not supported")
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ConfigError(f"{g.path}: rope.dimension_count={key('rope.dimension_count')} < head dim {head_dim} "
                          "(partial rotary embedding) is not supported")
    window = key("attention.sliding_window") or None  # Phi-3's converter writes 0 for none
    if window and arch not in SLIDING_ARCHS:
        raise ConfigError(f"{g.path}: attention.sliding_window is not supported for GGUF architecture {arch!r}")
    tokens = g.reader.fields.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None and "token_embd.weight" in g.tensors:
        vocab = int(g.tensors["token_embd.weight"].shape[-1])
    ctx = key("context_length", required=True)
    theta = _f32(key("rope.freq_base", 10000.0))
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "intermediate_size": int(key("feed_forward_length") or key("expert_feed_forward_length", required=True)),
        "num_hidden_layers": int(key("block_count", required=True)),
        "num_attention_heads": int(n_head),
        "num_key_value_heads": int(n_kv),
        "head_dim": int(head_dim),
        "max_position_embeddings": int(ctx),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
    }
    if model_type in ("llama", "qwen3", "qwen3_moe"):
        hf["attention_bias"] = "blk.0.attn_q.bias" in g.tensors
    if model_type == "llama":
        hf["mlp_bias"] = "blk.0.ffn_down.bias" in g.tensors
    elif model_type in ("qwen2", "qwen3", "qwen3_moe"):
        hf["use_sliding_window"] = False
    elif model_type in ("mixtral", "phi3"):
        hf["sliding_window"] = int(window) if window else None
    for name, k in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                    ("pad_token_id", "padding_token_id")):
        value = g.get(f"tokenizer.ggml.{k}")
        if value is not None:
            hf[name] = int(value)
    kind = key("rope.scaling.type")
    if kind in (None, "none"):
        if "rope_freqs.weight" in g.tensors:
            factors = g.read("rope_freqs.weight").reshape(-1)
            hf["rope_parameters"] = {**llama3_scaling(factors, head_dim, theta, g.path), "rope_theta": theta}
    elif kind == "linear":
        hf["rope_parameters"] = {"rope_type": "linear", "factor": _f32(key("rope.scaling.factor", required=True)),
                                 "rope_theta": theta}
    elif kind == "yarn":
        for unsupported in ("rope.scaling.yarn_log_multiplier", "rope.scaling.attn_factor",
                            "rope.scaling.yarn_attn_factor"):
            value = key(unsupported)
            if value not in (None, 0.0, 1.0) or (unsupported.endswith("log_multiplier") and value):
                raise ConfigError(f"{g.path}: {arch}.{unsupported}={value} is not supported")
        params: dict[str, Any] = {"rope_type": "yarn", "factor": _f32(key("rope.scaling.factor", required=True)),
                                  "original_max_position_embeddings": int(key("rope.scaling.original_context_length",
                                                                              ctx)),
                                  "rope_theta": theta}
        for gguf_key, hf_key in (("rope.scaling.yarn_beta_fast", "beta_fast"),
                                 ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if key(gguf_key) is not None:
                params[hf_key] = _f32(key(gguf_key))
        hf["rope_parameters"] = params
    else:
        raise ConfigError(f"{g.path}: RoPE scaling type {kind!r} is not supported (supported: none, linear, yarn, "
                          "and llama3 as a rope_freqs tensor)")
    if {"rope_factors_long.weight", "rope_factors_short.weight"} & set(g.tensors):
        if model_type != "phi3" or kind not in (None, "none"):
            raise ConfigError(f"{g.path}: rope_factors_long/short (LongRoPE) are supported in 'phi3' files without "
                              "another RoPE scaling type")
        hf["rope_parameters"] = _longrope_from_gguf(g, key, theta, int(ctx), head_dim)
    if n_experts:
        hf.update(_experts_from_gguf(g, key, model_type, n_experts))
    if model_type in ("gemma2", "gemma3_text"):
        hf.update(_gemma_from_gguf(g, key, arch, hf, head_dim, window))
    return hf


def _longrope_from_gguf(g: GGUFFile, key: Any, theta: float, ctx: int, head_dim: int) -> dict[str, Any]:
    """Phi-3's LongRoPE: the divisor tensors, L0, and the attention factor when it is not the derived one."""
    factors = {}
    for which in ("short", "long"):
        name = f"rope_factors_{which}.weight"
        if name not in g.tensors:
            raise CheckpointError(f"{g.path}: LongRoPE needs both rope_factors_short and rope_factors_long; "
                                  f"{name} is missing")
        values = g.read(name).reshape(-1)
        if values.size != head_dim // 2:
            raise CheckpointError(f"{g.path}: {name} has {values.size} factors, not head_dim / 2 = {head_dim // 2}")
        factors[which] = [float(v) for v in values]
    l0 = int(key("rope.scaling.original_context_length", required=True))
    params: dict[str, Any] = {"rope_type": "longrope", "rope_theta": theta, "short_factor": factors["short"],
                              "long_factor": factors["long"], "original_max_position_embeddings": l0}
    stored = key("rope.scaling.attn_factor")
    f = ctx / l0
    derived = math.sqrt(1 + math.log(f) / math.log(l0)) if f > 1 else 1.0
    if stored is not None and abs(stored - derived) > 1e-6 * derived:
        params["attention_factor"] = _f32(stored)
    return params


def _experts_from_gguf(g: GGUFFile, key: Any, model_type: str, n_experts: int) -> dict[str, Any]:
    """The mixture-of-experts keys: llama.cpp's llama (Mixtral) and qwen3moe route by softmax, then top k."""
    func = key("expert_gating_func")
    if func not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ConfigError(f"{g.path}: expert_gating_func={func} is not supported (only 1, softmax)")
    shared = [n for n in g.tensors if "_shexp" in n]
    if key("expert_shared_count") or shared:
        raise ConfigError(f"{g.path}: shared experts ({shared[0] if shared else 'expert_shared_count'}) are not "
                          "supported")
    if key("expert_weights_scale") not in (None, 1.0):
        raise ConfigError(f"{g.path}: expert_weights_scale={key('expert_weights_scale')} is not supported")
    used = int(key("expert_used_count", required=True))
    renormalise = bool(key("expert_weights_norm", True))  # llama.cpp renormalises the top-k weights of both
    width = int(key("expert_feed_forward_length") or key("feed_forward_length", required=True))
    if model_type == "mixtral":
        if not renormalise:
            raise ConfigError(f"{g.path}: expert_weights_norm=false is not supported in a 'llama' (Mixtral) file")
        return {"num_local_experts": n_experts, "num_experts_per_tok": used, "intermediate_size": width}
    return {"num_experts": n_experts, "num_experts_per_tok": used, "moe_intermediate_size": width,
            "norm_topk_prob": renormalise, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _gemma_from_gguf(g: GGUFFile, key: Any, arch: str, hf: dict[str, Any], head_dim: int,
                     window: int | None) -> dict[str, Any]:
    """llama.cpp's Gemma 2 / 3: GELU-tanh; scores scaled by attention.scale, else head_dim^-1/2; every n-th layer
    global (2 / 6, or attention.sliding_window_pattern); Gemma 2's soft-caps; Gemma 3's local RoPE base
    (rope.freq_base_swa, else 10000)."""
    for unused in ("hidden_act", "use_sliding_window"):
        hf.pop(unused, None)
    scale = key("attention.scale")
    scalar: float | int = int(head_dim)
    if scale:
        scalar = 1.0 / _f32(scale) ** 2
        scalar = round(scalar) if abs(scalar - round(scalar)) < 1e-4 * scalar else scalar
    out: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
                           "sliding_window": int(window) if window else None}
    pattern = key("attention.sliding_window_pattern", GEMMA_GLOBAL_EVERY[arch])
    if isinstance(pattern, list):  # one flag per layer: true = sliding
        if len(pattern) != hf["num_hidden_layers"]:
            raise ConfigError(f"{g.path}: attention.sliding_window_pattern has {len(pattern)} entries for "
                              f"{hf['num_hidden_layers']} layers")
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        out["sliding_window_pattern"] = int(pattern)
    if arch == "gemma2":
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = key(name)
            out[name] = _f32(value) if value else None
    else:
        out["rope_parameters"] = {"full_attention": hf["rope_parameters"],
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": _f32(key("rope.freq_base_swa",
                                                                               GEMMA3_LOCAL_THETA))}}
    return out


class GGUFSource(TensorSource):
    """The tensors of a GGUF file under their Hugging Face names, dequantized and un-permuted on read."""

    def __init__(self, g: GGUFFile, hf_config: dict[str, Any], arch: str) -> None:
        self.g = g
        self.description = str(g.path)
        model_type = hf_config["model_type"]
        n_experts = int(hf_config.get("num_local_experts") or hf_config.get("num_experts") or 0)
        self._gguf_name: dict[str, str] = {}
        self._expert: dict[str, int] = {}  # HF name -> its slice of a stacked ffn_*_exps tensor
        for n, t in g.tensors.items():
            if n in NOT_WEIGHTS:
                continue
            stacked = expert_names(n, n_experts, model_type)
            if stacked and (len(t.shape) != 3 or int(t.shape[-1]) != n_experts):
                raise CheckpointError(f"{g.path}: {n} has shape {list(reversed(t.shape.tolist()))}, not "
                                      f"{n_experts} stacked experts (expert_count)")
            for e, name in enumerate(stacked):
                self._gguf_name[name], self._expert[name] = n, e
            if not stacked:
                self._gguf_name[hf_name(n, arch, model_type)] = n
        self._norm_shift = arch in NORM_PLUS_ONE_ARCHS
        self._permute: dict[str, int] = {}
        if arch in PERMUTED_ARCHS:
            n_head, n_kv = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
            for name in self._gguf_name:
                if ".self_attn.q_proj." in name:
                    self._permute[name] = n_head
                elif ".self_attn.k_proj." in name:
                    self._permute[name] = n_kv
        self._dtypes = supported_types()

    def names(self) -> list[str]:
        return list(self._gguf_name)

    def meta(self, name: str) -> torch.Tensor:
        t = self.g.tensors[self._gguf_name[name]]
        shape = [int(d) for d in reversed(t.shape.tolist())]
        if name in self._expert:
            shape = shape[1:]
        return torch.empty(shape, dtype=self._dtypes[t.tensor_type], device="meta")

    def read(self, name: str) -> torch.Tensor:
        t = self.g.tensors[self._gguf_name[name]]
        array = self.g.read(self._gguf_name[name], self._expert.get(name))
        tensor = torch.from_numpy(array).to(self._dtypes[t.tensor_type])
        if self._norm_shift and name.endswith("norm.weight"):  # llama.cpp's 1 + g back to Gemma's g
            tensor = tensor - 1
        if name in self._permute:
            n_head = self._permute[name]
            if tensor.shape[0] % (2 * n_head):
                raise CheckpointError(f"{self.g.path}: {t.name} has {tensor.shape[0]} rows, not a multiple of "
                                      f"2 x {n_head} heads")
            tensor = unpermute_rows(tensor, n_head).contiguous()
        return tensor


# --------------------------------------------------------------------------------------------- tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    from tinyformer.data.tokenizer import byte_level_decoder

    return {b: c for c, b in byte_level_decoder().items()}


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE stores no merges, only a score per piece (higher = merged earlier). Every split
    of a piece into two pieces of the vocabulary is a merge, ranked by the piece's score -- the rule
    Hugging Face's converters use, so both give the same tokenization."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str, float]] = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


# llama.cpp pre-tokenizer names -> the split regex of the model they stand for
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                        "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def build_tokenizer(g: GGUFFile) -> tuple[str, dict[str, Any]] | None:
    """(tokenizer.json text, tokenizer_config dict) from the GGUF metadata, or None when it has none."""
    import tokenizers
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    template = g.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    embedded = g.get("tokenizer.huggingface.json")
    model_kind = g.get("tokenizer.ggml.model")
    if embedded:
        tok = tokenizers.Tokenizer.from_str(embedded)
    elif model_kind is None:
        return None
    else:
        tokens: list[str] = g.require("tokenizer.ggml.tokens")
        types: list[int] = g.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if model_kind == "gpt2":
            spelling = _bytes_to_unicode()
            alphabet = set(spelling.values())
            spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
            merges = [tuple(m.split(" ")) for m in (g.get("tokenizer.ggml.merges") or [])]
            if any(len(m) != 2 for m in merges):
                raise CheckpointError(f"{g.path}: tokenizer.ggml.merges has an entry that is not two tokens")
            tok = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=merges,
                                                  dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                                                  fuse_unk=False))
            split = PRE_TOKENIZER_SPLITS.get(g.get("tokenizer.ggml.pre"))
            if split:
                tok.pre_tokenizer = pre_tokenizers.Sequence([
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            else:
                tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            add_bos_default = False
            control = [t for t, k in zip(tokens, types) if k == 3 and set(t) <= alphabet]
        elif model_kind == "llama":
            scores = g.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            unk_id = g.get("tokenizer.ggml.unknown_token_id")
            unk = tokens[unk_id] if unk_id is not None else next((t for t, k in zip(tokens, types) if k == 2), None)
            merges = [tuple(m.split(" ")) for m in g.get("tokenizer.ggml.merges") or []] \
                or _merges_from_scores(tokens, scores)
            tok = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                                  unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None))
            prefix = g.get("tokenizer.ggml.add_space_prefix", True)
            tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                         split=False)
            steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            if prefix:
                steps.append(decoders.Strip(content=" ", left=1, right=0))
            tok.decoder = decoders.Sequence(steps)
            add_bos_default = True
            control = [t for t, k in zip(tokens, types) if k == 3]
        else:
            raise ConfigError(f"{g.path}: GGUF tokenizer model {model_kind!r} is not supported (supported: gpt2 "
                              "byte-level BPE, llama SentencePiece BPE)")
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        user = [t for t, k in zip(tokens, types) if k == 4]
        if user:
            tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
        vocab_tokens = spelled if model_kind == "gpt2" else tokens
        ids: dict[str, int] = {}
        for field, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                           ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
            token_id = g.get(f"tokenizer.ggml.{key}")
            if token_id is not None and 0 <= token_id < len(tokens):
                config[field], ids[field] = vocab_tokens[token_id], int(token_id)
        add_bos = bool(g.get("tokenizer.ggml.add_bos_token", add_bos_default)) and "bos_token" in config
        add_eos = bool(g.get("tokenizer.ggml.add_eos_token", False)) and "eos_token" in config
        config["add_bos_token"], config["add_eos_token"] = add_bos, add_eos
        if add_bos or add_eos:  # what transformers' update_post_processor builds from the same two flags
            bos, eos = config.get("bos_token"), config.get("eos_token")
            single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
            pair = single + " " + " ".join(([f"{bos}:1"] if add_bos else []) + ["$B:1"]
                                           + ([f"{eos}:1"] if add_eos else []))
            specials = dict([(bos, ids["bos_token"])] if add_bos else [])
            if add_eos:
                specials[eos] = ids["eos_token"]
            tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                               special_tokens=list(specials.items()))
    return tok.to_str(), config


def _write_tokenizer(g: GGUFFile, hf_config: dict[str, Any], dst: Path) -> list[str]:
    from tinyformer.utils.io import atomic_write_text

    built = build_tokenizer(g)
    if built is None:
        return [f"{g.path} carries no tokenizer (no tokenizer.ggml.model): the run has no tokenizer"]
    text, config = built
    config.setdefault("model_max_length", hf_config["max_position_embeddings"])
    atomic_write_text(dst / "tokenizer.json", text)
    write_json(dst / "tokenizer_config.json", config)
    gen = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf_config}
    if gen:
        write_json(dst / "generation_config.json", gen)
    return []


def import_gguf(path: str | Path, out: str | Path, *, dtype: str | torch.dtype | None = None,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES, force: bool = False) -> ConvertReport:
    """GGUF file -> tinyformer run folder (config.json, model.safetensors, tokenizer files).

    The default dtype is float16/bfloat16 when every weight matrix is stored in it, float32 otherwise
    (quantized weights are dequantized to float32)."""
    g = GGUFFile(path)
    hf_config = hf_config_from_gguf(g)
    arch = g.get("general.architecture")
    source = GGUFSource(g, hf_config, arch)
    dt = parse_dtype(dtype)
    if dt is None:
        kinds = {source.meta(n).dtype for n in source.names() if source.meta(n).dim() == 2}
        dt = kinds.pop() if len(kinds) == 1 else torch.float32
    return import_checkpoint(hf_config, source, out, write_tokenizer=lambda dst: _write_tokenizer(g, hf_config, dst),
                             dtype=dt, max_shard_bytes=max_shard_bytes, force=force, inputs=(Path(path),),
                             extra={"source": "gguf"})


# --------------------------------------------------------------------------------------------- --keep-quant


def block_parts(raw: np.ndarray, qtype_name: str, rows: int, cols: int) -> dict[str, torch.Tensor]:
    """ggml blocks of 32 values -> the portable int8 / int4 form (``components/quantized.py``), exactly:

        Q8_0 (34 bytes: d f16, q int8[32]):           x = d q        -> int8, scale d
        Q4_0 (18 bytes: d f16, 16 bytes of nibbles):  x = d (u - 8)  -> int4, scale d, zero 0
        Q4_1 (20 bytes: d f16, m f16, nibbles):       x = d u + m    -> int4, scale d, zero m + 8 d

    In a Q4 block byte j holds value j in its low nibble and value j + 16 in its high nibble."""
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows * (cols // 32), -1)
    d = torch.from_numpy(blocks[:, :2].copy().view(np.float16).astype(np.float32)).reshape(rows, cols // 32)
    if qtype_name == "Q8_0":
        q = torch.from_numpy(blocks[:, 2:].copy().view(np.int8)).reshape(rows, cols)
        return {"qweight": q, "scales": d}
    offset = 4 if qtype_name == "Q4_1" else 2
    nibbles = torch.from_numpy(blocks[:, offset:].copy())  # (blocks, 16)
    u = torch.cat([nibbles & 15, nibbles >> 4], dim=1).reshape(rows, cols)
    from tinyformer.components.quantized import pack_int4

    zeros = torch.zeros_like(d)
    if qtype_name == "Q4_1":
        m = torch.from_numpy(blocks[:, 2:4].copy().view(np.float16).astype(np.float32)).reshape(rows, cols // 32)
        zeros = m + 8 * d
    return {"qweight": pack_int4(u), "scales": d, "zeros": zeros}


EXACT_KEEP = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}


def import_gguf_keep_quant(path: str | Path, out: str | Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                           force: bool = False) -> ConvertReport:
    """GGUF file -> quantized run folder that keeps the file's bits: Q8_0 matrices become int8 with groups of 32,
    Q4_0 / Q4_1 int4 with groups of 32, exactly (``block_parts``). The run's type is that of most block matrices;
    matrices stored otherwise (K-quants, F16, the other width) are dequantized and rounded again into it, and
    named in the notes. An untied token table stays float, as in any quantized run (``quantization.py``), and so
    do a mixture of experts' stacked expert matrices (no ``nn.Linear`` there: they are dequantized); its router,
    an ``nn.Linear`` that llama.cpp keeps in F32, is rounded into the run's type."""
    import tempfile
    from collections import Counter

    from tinyformer.components.quantized import QuantSpec, quantize_weight
    from tinyformer.interop.adapter import adapter_for_hf
    from tinyformer.interop.convert_pipeline import staged_output
    from tinyformer.models import build_model
    from tinyformer.quantization import QUANT_KEY, linear_names
    from tinyformer.run_folder import iter_tensors, save_tensors, side_files

    g = GGUFFile(path)
    hf_config = hf_config_from_gguf(g)
    arch = g.get("general.architecture")
    kinds = Counter(t.tensor_type.name for n, t in g.tensors.items() if n.startswith("blk.") and len(t.shape) == 2)
    main = kinds.most_common(1)[0][0] if kinds else "F32"
    if main in EXACT_KEEP:
        spec = QuantSpec(EXACT_KEEP[main], 32)
    elif main in ("Q4_K", "Q5_K", "Q3_K", "Q2_K", "Q5_0", "Q5_1"):
        spec = QuantSpec("int4", 32)
    elif main == "Q6_K":
        spec = QuantSpec("int8", 32)
    else:
        raise ConfigError(f"{g.path}: --keep-quant needs quantized matrices; this file's are {main} (import it "
                          "without --keep-quant)")
    source = GGUFSource(g, hf_config, arch)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.float.", dir=out.parent) as tmp:
        report = import_gguf(path, Path(tmp) / "run", dtype=torch.float32, max_shard_bytes=max_shard_bytes)
        cfg = report.cfg
        # which source rows make up each tinyformer tensor: run the adapter over (source id, row) pairs
        hf_names = source.names()
        index = {}
        for i, name in enumerate(hf_names):
            shape = source.meta(name).shape
            rows = torch.arange(shape[0])
            index[name] = torch.stack([torch.full_like(rows, i), rows], dim=1) if len(shape) == 2 else rows
        adapter = adapter_for_hf(hf_config)
        layout = {k: v for k, v in adapter.hf_to_tinyformer(cfg, index) if v.dim() == 2}
        exact: dict[str, dict[str, torch.Tensor]] = {}
        for name in hf_names:
            t = g.tensors[source._gguf_name[name]]
            if len(t.shape) == 2 and EXACT_KEEP.get(t.tensor_type.name) == spec.type:
                cols, rows = (int(x) for x in t.shape)
                parts = block_parts(t.data, t.tensor_type.name, rows, cols)
                if name in source._permute:
                    parts = {k: unpermute_rows(v, source._permute[name]) for k, v in parts.items()}
                exact[name] = parts
        with torch.device("meta"):  # the layers a quantized run stores quantized (a MoE's router too; its
            linears = set(linear_names(build_model(cfg)))  # stacked experts are no nn.Linear and stay float)
        rounded: Counter[str] = Counter()

        def tensors():
            for key, tensor in iter_tensors(Path(tmp) / "run"):
                layer = "lm_head" if key == "tok_emb.weight" and cfg.tie_embeddings else key.removesuffix(".weight")
                if layer not in linears or not key.endswith(".weight"):
                    yield key, tensor
                    continue
                pieces = layout[key]
                sources = [hf_names[int(s)] for s in pieces[:, 0].unique_consecutive()]
                if all(s in exact for s in sources):
                    parts = {p: torch.cat([exact[s][p] for s in sources]) for p in exact[sources[0]]}
                else:
                    for s in sources:
                        rounded[g.tensors[source._gguf_name[s]].tensor_type.name] += 1
                    parts = quantize_weight(tensor, spec)
                for p, value in parts.items():
                    yield f"{layer}.{p}", value.contiguous()

        with staged_output(out, force, (Path(path),)) as staging:
            save_tensors(staging, tensors(), max_shard_bytes)
            for item in side_files(Path(tmp) / "run"):
                item.replace(staging / item.name)
            cfg = cfg.replace(extra={**cfg.extra, QUANT_KEY: spec.to_dict()})
            cfg.save(staging / "config.json")
            files = sorted(p.name for p in staging.iterdir())
    notes = list(report.notes)
    notes.append(f"kept {main} as {spec.type} with groups of 32" + (" exactly" if main in EXACT_KEEP else
                                                                   " (re-rounded: not exactly representable)"))
    if rounded:
        notes.append("re-rounded into the run's layout (stored in another type): "
                     + ", ".join(f"{n} tensor(s) of {k}" for k, n in sorted(rounded.items())))
    return ConvertReport(out, cfg, torch.int8 if spec.type == "int8" else torch.uint8, report.n_params, files, notes)
