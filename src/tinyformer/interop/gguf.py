"""Import GGUF files (llama.cpp's format): weights, config and tokenizer, for the architectures the model families
list (llama and Mixtral-style llama, qwen2, qwen3, qwen3moe, phi3, gemma2, gemma3).

A GGUF file is a header of typed key/value metadata followed by tensors, each stored as float
(F32, F16, BF16) or in one of ggml's block quantizations. This module turns one into the pair a
Hugging Face folder would give -- a ``config.json`` dict and HF-named tensors -- and hands both to the
same pipeline as ``hf_folder.import_hf`` (``convert_pipeline.import_checkpoint``), so the family's adapter does the
rest.

Weights. Quantized tensors are dequantized to float32 with ``gguf.quants.dequantize`` (the reference
Python implementation of ggml's formats, e.g. Q8_0: x = d * q, with one float16 scale d per block of 32
int8 values; Q4_K: 256-value super-blocks of eight 32-value blocks, x = d * s_j * q - dmin * m_j with
6-bit block scales s_j and mins m_j). Float tensors are copied as they are.

Architectures. What differs between llama.cpp's architectures -- the metadata that becomes the Hugging Face config,
the layer tensors' names, which RoPE rotation the file uses, Gemma's 1 + g norm gains -- is the family's
(``families/<family>/gguf.py``, a ``GGUFArch`` found in ``families.GGUF_ARCHS`` by ``general.architecture``).

RoPE. Where llama.cpp rotates adjacent pairs (``rope_interleaved``: the ``llama`` architecture, see
``families/llama/gguf.py``), reading undoes its q/k row permutation here, at the file boundary (``unpermute_rows``).

Mixtures of experts. The experts' matrices are stacked, ``ffn_{gate,up,down}_exps`` of shape (E, rows, cols), or
(older files) one tensor per expert, ``ffn_{gate,up,down}.e``; each expert is read as its own slice (dequantized
alone).

Tokenizer. ``tokenizer.ggml.model = "gpt2"`` (byte-level BPE: tokens + merges) and ``"llama"``
(SentencePiece BPE: tokens + scores, merges rebuilt from the scores, byte fallback) become a
``tokenizers`` tokenizer.json; control tokens become special tokens; ``tokenizer.chat_template`` goes to
tokenizer_config.json.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tinyformer.devices import parse_dtype
from tinyformer.errors import CheckpointError, ConfigError
from tinyformer.families import GGUF_ARCHS, adapter_for_hf
from tinyformer.families.family import GGUFArch
from tinyformer.families.llama.gguf import expert_names, hf_name
from tinyformer.interop.convert_pipeline import ConvertReport, import_checkpoint, write_json
from tinyformer.interop.tensor_sources import TensorSource
from tinyformer.safetensors_io import DEFAULT_SHARD_BYTES

NOT_WEIGHTS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")  # -> rope_scaling


def _gguf():
    try:
        import gguf
    except ModuleNotFoundError:
        raise ConfigError("reading GGUF files needs the 'gguf' package: pip install 'tinyformer[gguf]'") from None
    return gguf


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (weights and biases): per head, interleaved pairs back to two halves,
    ``hf = gguf.reshape(n_head, d_head / 2, 2, d_in).swapaxes(1, 2).reshape(rows, d_in)`` (n_head: the key/value
    head count for W_k)."""
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

        def skip(n: int, what: str) -> None:
            nonlocal pos
            need(n, what)
            pos += n

        def u(fmt: str, what: str) -> int:
            n = struct.calcsize(fmt)
            skip(n, what)
            return struct.unpack_from(order + fmt, f, pos - n)[0]

        def skip_value(kind: int, what: str, depth: int = 0) -> None:
            if kind in _GGUF_SCALAR_BYTES:
                skip(_GGUF_SCALAR_BYTES[kind], what)
            elif kind == _GGUF_STRING:
                skip(u("Q", what), what)
            elif kind == _GGUF_ARRAY and depth < 8:
                item, count = u("I", what), u("Q", what)
                if item in _GGUF_SCALAR_BYTES:
                    skip(count * _GGUF_SCALAR_BYTES[item], f"{what} ({count:,} items)")
                    return
                need(count * 8, f"{what} ({count:,} items)")  # strings and arrays take at least 8 bytes each
                for _ in range(count):
                    skip_value(item, what, depth + 1)
            else:
                raise CheckpointError(f"{path} is not a readable GGUF file: {what} has unknown value type {kind}")

        n_tensors, n_kv = struct.unpack(order + "QQ", data[8:24])
        need(n_kv * 12, f"the metadata ({n_kv:,} entries)")  # key length u64 + value type u32 at least
        for i in range(n_kv):
            skip_value(_GGUF_STRING, f"metadata key {i}")
            skip_value(u("I", f"metadata entry {i}"), f"metadata entry {i}")
        need(n_tensors * 24, f"the tensor directory ({n_tensors:,} tensors)")
        for i in range(n_tensors):
            skip_value(_GGUF_STRING, f"tensor {i}'s name")
            n_dims = u("I", f"tensor {i}")
            skip(n_dims * 8 + 12, f"tensor {i}'s {n_dims:,} dimensions")


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
        Q = gguf.GGMLQuantizationType  # the GGML types this importer reads -> the dtype each is read as
        blocks = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
        self.dtypes = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16,
                       **{Q[n]: torch.float32 for n in blocks}}
        for t in self.reader.tensors:
            if t.tensor_type not in self.dtypes:
                raise CheckpointError(f"{self.path}: tensor {t.name!r} uses GGML type {t.tensor_type.name}, which "
                                      f"is not supported (supported: {', '.join(q.name for q in self.dtypes)})")
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

    def key(self, name: str, default: Any = None, required: bool = False) -> Any:
        """The architecture's metadata value ``<general.architecture>.<name>``."""
        full = f"{self.get('general.architecture')}.{name}"
        return self.require(full) if required else self.get(full, default)

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


def hf_config_from_gguf(g: GGUFFile) -> tuple[GGUFArch, dict[str, Any]]:
    """The file's architecture entry and the Hugging Face config.json dict its metadata states (the family's
    ``config_from_gguf``: the architecture string selects the key prefix and llama.cpp's fixed choices; every other
    option comes from a key or from which tensors the file holds)."""
    name = g.require("general.architecture")
    if name not in GGUF_ARCHS:
        raise ConfigError(f"{g.path}: GGUF architecture {name!r} is not supported (supported: {', '.join(GGUF_ARCHS)})")
    arch = GGUF_ARCHS[name]
    n_experts = int(g.key("expert_count", 0) or 0)
    if n_experts and arch.moe is None:
        raise ConfigError(f"{g.path}: {name}.expert_count={n_experts}: experts are supported in 'llama' (Mixtral) "
                          "and 'qwen3moe' files only")
    return arch, arch.config_from_gguf(g)


class GGUFSource(TensorSource):
    """The tensors of a GGUF file under their Hugging Face names, dequantized and un-permuted on read."""

    def __init__(self, g: GGUFFile, hf_config: dict[str, Any], arch: GGUFArch) -> None:
        self.g = g
        self.description = str(g.path)
        n_experts = int(hf_config.get("num_local_experts") or hf_config.get("num_experts") or 0)
        moe = arch.moe if n_experts else None
        self._gguf_name: dict[str, str] = {}
        self._expert: dict[str, int] = {}  # HF name -> its slice of a stacked ffn_*_exps tensor
        for n, t in g.tensors.items():
            if n in NOT_WEIGHTS:
                continue
            stacked = expert_names(n, n_experts, moe)
            if stacked and (len(t.shape) != 3 or int(t.shape[-1]) != n_experts):
                raise CheckpointError(f"{g.path}: {n} has shape {list(reversed(t.shape.tolist()))}, not "
                                      f"{n_experts} stacked experts (expert_count)")
            for e, name in enumerate(stacked):
                self._gguf_name[name], self._expert[name] = n, e
            if not stacked:
                self._gguf_name[hf_name(n, arch, moe)] = n
        self._norm_shift = arch.norm_plus_one
        self._permute: dict[str, int] = {}
        if arch.rope_interleaved:  # llama.cpp's adjacent pairs back to half-split
            n_head, n_kv = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
            for name in self._gguf_name:
                if ".self_attn.q_proj." in name:
                    self._permute[name] = n_head
                elif ".self_attn.k_proj." in name:
                    self._permute[name] = n_kv

    def names(self) -> list[str]:
        return list(self._gguf_name)

    def meta(self, name: str) -> torch.Tensor:
        t = self.g.tensors[self._gguf_name[name]]
        shape = [int(d) for d in reversed(t.shape.tolist())]
        if name in self._expert:
            shape = shape[1:]
        return torch.empty(shape, dtype=self.g.dtypes[t.tensor_type], device="meta")

    def read(self, name: str) -> torch.Tensor:
        t = self.g.tensors[self._gguf_name[name]]
        array = self.g.read(self._gguf_name[name], self._expert.get(name))
        tensor = torch.from_numpy(array).to(self.g.dtypes[t.tensor_type])
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

    from tinyformer.data.tokenizer import byte_level_decoder

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
            spelling = {b: c for c, b in byte_level_decoder().items()}  # byte -> its byte-level character
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
    arch, hf_config = hf_config_from_gguf(g)
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
# the run's type for a file of mostly these blocks (the others rounded again into it)
KEEP_AS = {**EXACT_KEEP, "Q6_K": "int8", **dict.fromkeys(("Q4_K", "Q5_K", "Q3_K", "Q2_K", "Q5_0", "Q5_1"), "int4")}


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
    from tinyformer.interop.convert_pipeline import staged_output
    from tinyformer.models import meta_model
    from tinyformer.run_folder import QUANT_KEY, iter_tensors, linear_names, save_tensors, side_files

    g = GGUFFile(path)
    arch, hf_config = hf_config_from_gguf(g)
    kinds = Counter(t.tensor_type.name for n, t in g.tensors.items() if n.startswith("blk.") and len(t.shape) == 2)
    main = kinds.most_common(1)[0][0] if kinds else "F32"
    if main not in KEEP_AS:
        raise ConfigError(f"{g.path}: --keep-quant needs quantized matrices; this file's are {main} (import it "
                          "without --keep-quant)")
    spec = QuantSpec(KEEP_AS[main], 32)
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
        # the layers a quantized run stores quantized (a MoE's router too; its stacked experts are no
        linears = set(linear_names(meta_model(cfg)))  # nn.Linear and stay float)
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
