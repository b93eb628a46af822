"""Export a run folder of the Llama family (Llama, Mistral, Qwen2/3, Phi-3, Mixtral, Qwen3-MoE) or Gemma 2/3 as a GGUF
file that llama.cpp (and transformers) load.

    tinyformer convert --model RUN --to-gguf FILE [--type f32|f16|bf16|q8_0|q4_0]

The inverse of ``interop/gguf.py``. The run's weights go through the Llama adapter to their Hugging Face
names and then to llama.cpp's (``token_embd``, ``blk.i.attn_q``, ...); the hyper-parameters become the
``llama.*`` metadata keys (context, widths, heads, RMSNorm epsilon, RoPE base, and RoPE scaling: linear and
yarn as keys, llama3 as the ``rope_freqs`` tensor of per-frequency divisors llama.cpp reads).

RoPE. tinyformer (and Hugging Face) rotate the half-split pairs (i, i + d_head/2); llama.cpp's ``llama``
architecture rotates adjacent pairs (2i, 2i+1). So, as llama.cpp's own converter does, each head's rows of
W_q and W_k (and their biases) are permuted:

    gguf = w.reshape(n_head, 2, d_head / 2, d_in).swapaxes(1, 2).reshape(rows, d_in)

A model imported from ``qwen2`` is written as ``qwen2`` (half-split RoPE in llama.cpp too: not permuted), and the
architecture the Llama adapter picks (``export_model_type``) as llama.cpp's: ``qwen3`` (q/k norms ``attn_q_norm`` /
``attn_k_norm``), ``qwen3moe``, ``phi3`` (q/k/v fused as ``attn_qkv``, gate and up as ``ffn_up``; the window as
``attention.sliding_window``; LongRoPE as the ``rope_factors_short`` / ``rope_factors_long`` tensors with
``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor``), and Mixtral as ``llama`` with
``expert_count``. A mixture's experts are stacked per layer into ``ffn_{gate,up,down}_exps`` (E, rows, cols); its
router ``ffn_gate_inp`` stays F32 (as llama.cpp keeps it). llama.cpp's llama, qwen2/3 and qwen3moe have no sliding
window and renormalise a mixture's top-k weights: models that need otherwise are refused.

Gemma 2 / 3 (``gemma2`` / ``gemma3``) go through the Gemma adapter: every norm gain is stored as 1 + g (ggml multiplies
by the stored gain), the four norms of a layer as ``attn_norm``, ``post_attention_norm``, ``ffn_norm`` and
``post_ffw_norm``, Gemma 2's soft-caps as ``attn_logit_softcapping`` / ``final_logit_softcapping``. llama.cpp fixes
the rest, so a model must match it: no biases, a sliding window with every 2nd (Gemma 2) / 6th (Gemma 3) layer
global, scores scaled by head_dim^-1/2, Gemma 2 tied and soft-capped (llama.cpp caps at 50 / 30 otherwise), Gemma 3
uncapped with its local layers at RoPE base 10000.

Weights. 2-D matrices are stored in ``--type``; norms and biases stay F32 (as llama.cpp does). Q8_0 and
Q4_0 are computed with ``gguf.quants.quantize`` (the reference of ggml's formats: Q8_0 x = d q per 32
values, q int8; Q4_0 x = d (u - 8) per 32, u in [0, 15]); they need matrices whose rows are whole 32-value
blocks. A quantized run (``tinyformer quantize``) is dequantized first, then written in ``--type``: its
layouts (float32 scales) are not bit-identical to ggml's (float16 scales), so q8_0 rounds again.

Tokenizer. A byte-level BPE (trained here or imported) is written as ``tokenizer.ggml.model = "gpt2"`` with
its tokens and merges and the pre-tokenizer's llama.cpp name ("gpt-2" for the plain byte-level regex, or a
known model's split regex); a character vocabulary as ``"llama"`` (SentencePiece style: one piece per
character, the space spelled "▁", no merges, no space prefix), which llama.cpp's SentencePiece tokenizer
encodes character by character. Special tokens (BOS/EOS/PAD, control tokens) and the chat template are kept.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tinyformer.errors import CheckpointError, ConfigError
from tinyformer.interop.gguf import GEMMA_GLOBAL_EVERY

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")

_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv",
          "mlp.gate_up_proj": "ffn_up", "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp"}
# the HF model type the Llama adapter writes -> llama.cpp's architecture
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "qwen3_moe": "qwen3moe", "phi3": "phi3"}


_GEMMA_BLOCK = {**_BLOCK, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
GEMMA_ARCH = {"gemma2": "gemma2", "gemma3_text": "gemma3"}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    """llama.cpp's name of a Hugging Face tensor; the inverse of ``interop.gguf.hf_name``."""
    if hf_name in _TOP:
        return _TOP[hf_name]
    rest = hf_name.removeprefix("model.layers.")
    layer, rest = rest.split(".", 1)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{(_GEMMA_BLOCK if arch in GEMMA_GLOBAL_EVERY else _BLOCK)[module]}.{kind}"


def gemma_problem(cfg: Any, arch: str) -> str | None:
    """Why llama.cpp's ``arch`` (gemma2 / gemma3) would compute something else than ``cfg``, or None."""
    every = GEMMA_GLOBAL_EVERY[arch]
    if cfg.attn_bias or cfg.attn_out_bias:
        return "llama.cpp's Gemma has no attention biases"
    if cfg.sliding_window is None or [cfg.layer_window(i) is None for i in range(cfg.n_layer)] != [
            (i + 1) % every == 0 for i in range(cfg.n_layer)]:
        return f"llama.cpp's {arch} needs a sliding window with every {every}th layer global (layer_types)"
    if abs((cfg.attn_scale or cfg.head_dim ** -0.5) - cfg.head_dim ** -0.5) > 1e-9:
        return f"llama.cpp's {arch} scales scores by head_dim^-1/2; attn_scale={cfg.attn_scale}"
    caps = (cfg.attn_logit_softcap, cfg.final_logit_softcap)
    if arch == "gemma2" and (None in caps or not cfg.tie_embeddings):
        return "llama.cpp's gemma2 soft-caps scores and logits (both caps must be set) and ties the output head"
    if arch == "gemma3" and (caps != (None, None) or cfg.rope_local_theta not in (None, 10000.0)
                             or (cfg.rope_local_theta is None and cfg.rope_theta != 10000.0)):
        return "llama.cpp's gemma3 has no soft-caps and its local layers' RoPE base is 10000"
    return None


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Half-split RoPE rows -> llama.cpp's adjacent-pair order, per head (weights and biases)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def float_state_dict(run: Path, cfg: Any) -> dict[str, torch.Tensor]:
    """The run's tensors as float (a quantized run's layers dequantized), tinyformer names, tied head once."""
    from tinyformer.components.quantized import dequantize_weight
    from tinyformer.quantization import PORTABLE_PARTS, quant_spec
    from tinyformer.run_folder import iter_tensors

    stored = dict(iter_tensors(run))
    spec = quant_spec(cfg)
    if spec is None:
        return stored
    out: dict[str, torch.Tensor] = {}
    for name in [n for n in stored if n.endswith(".qweight")]:
        prefix = name.removesuffix(".qweight")
        parts = {p: stored.pop(f"{prefix}.{p}") for p in PORTABLE_PARTS if f"{prefix}.{p}" in stored}
        out[f"{prefix}.weight"] = dequantize_weight(parts, spec.type)
    out.update(stored)
    if cfg.tie_embeddings and "lm_head.weight" in out:
        out["tok_emb.weight"] = out.pop("lm_head.weight")
    return out


# ------------------------------------------------------------------ tokenizer


def _pre_tokenizer_name(spec: dict[str, Any]) -> str | None:
    """llama.cpp's pre-tokenizer name for a byte-level BPE's pre-tokenizer, or None when none matches."""
    from tinyformer.interop.gguf import PRE_TOKENIZER_SPLITS

    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return "gpt-2"
    if pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers", [])
        split = next((p for p in parts if p.get("type") == "Split"), None)
        pattern = (split or {}).get("pattern", {}).get("Regex")
        for name, regex in PRE_TOKENIZER_SPLITS.items():
            if pattern == regex:
                return name
    return None


def write_tokenizer(w: Any, run: Path, vocab_size: int) -> list[str]:
    """Tokenizer metadata from the run's tokenizer.json (+ tokenizer_config.json); notes for the user."""
    from tinyformer.run_folder import load_tokenizer

    if not (run / "tokenizer.json").is_file():
        return [f"{run} has no tokenizer.json: the GGUF file carries no tokenizer (llama.cpp needs one)"]
    tok = load_tokenizer(run)
    spec = json.loads(tok.backend.to_str())
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    by_id = {i: t for t, i in vocab.items()}
    special = {t.content for t in tok.backend.get_added_tokens_decoder().values() if t.special}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [3 if t in special else (1 if i in by_id else 5) for i, t in enumerate(tokens)]  # 5 = unused
    notes: list[str] = []
    if tok.kind == "char":
        w.add_tokenizer_model("llama")
        pieces = [t if t in special else t.replace(" ", "▁") for t in tokens]
        w.add_token_list(pieces)
        w.add_token_scores([0.0] * len(pieces))
        w.add_token_types(types)
        w.add_add_space_prefix(False)
    elif tok.kind == "bpe" and spec.get("model", {}).get("type") == "BPE":
        w.add_tokenizer_model("gpt2")
        name = _pre_tokenizer_name(spec)
        if name is None:
            notes.append("the BPE pre-tokenizer matches no llama.cpp pre-tokenizer name; written as 'default'")
        w.add_tokenizer_pre(name or "default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        merges = spec["model"].get("merges", [])
        w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    else:
        raise ConfigError(f"{run / 'tokenizer.json'}: only byte-level BPE and character tokenizers can be written "
                          f"to GGUF (this one is {spec.get('model', {}).get('type')!r})")
    for token, add in ((tok.bos_token, w.add_bos_token_id), (tok.eos_token, w.add_eos_token_id),
                       (tok.pad_token, w.add_pad_token_id)):
        if token is not None and token in vocab:
            add(vocab[token])
    w.add_add_bos_token(False)  # the trained kinds and byte-level imports add nothing (see Tokenizer.encode)
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)
    return notes


# ------------------------------------------------------------------ the file


def export_gguf(run: str | Path, out: str | Path, qtype: str = "f32", *, force: bool = False) -> list[str]:
    """Run folder -> GGUF file (written to a temporary file, renamed into place when complete). Returns notes."""
    import gguf

    from tinyformer.interop import gemma
    from tinyformer.interop.llama import check_llama_compatible, export_model_type, tinyformer_to_hf
    from tinyformer.run_folder import load_config
    from tinyformer.utils.io import atomic_path

    run, out = Path(run), Path(out)
    if qtype not in GGUF_TYPES:
        raise ConfigError(f"--type {qtype!r} is not one of {', '.join(GGUF_TYPES)}")
    if out.is_dir():
        raise CheckpointError(f"{out} is a folder; give a file name such as model.gguf")
    if out.exists() and not force:
        raise CheckpointError(f"{out} exists; pass --force to replace it")
    cfg = load_config(run)
    if cfg.rope_type == "dynamic":
        raise ConfigError("dynamic NTK RoPE scaling has no GGUF / llama.cpp equivalent")
    if gemma.export_problem(cfg) is None:
        arch, to_hf = GEMMA_ARCH[gemma.export_model_type(cfg)], gemma.tinyformer_to_hf
        problem = gemma_problem(cfg, arch)
        if problem:
            raise ConfigError(problem)
    else:
        check_llama_compatible(cfg)
        arch, to_hf = GGUF_ARCH[export_model_type(cfg)], tinyformer_to_hf
    if cfg.attn_bias != cfg.attn_out_bias and arch != "qwen2":
        raise ConfigError("a model with q/k/v biases but no output bias (or the reverse) is not a llama.cpp "
                          "architecture")
    if cfg.mlp_bias:
        raise ConfigError("mlp_bias (biases on the feed-forward layers) is not supported by llama.cpp's llama")
    if cfg.sliding_window is not None and arch not in ("phi3", *GEMMA_GLOBAL_EVERY):
        raise ConfigError(f"sliding_window: llama.cpp's {arch!r} architecture has no sliding-window attention")
    if cfg.ffn == "moe" and not (cfg.router_norm_topk or cfg.router_order == "topk_softmax"):
        raise ConfigError("llama.cpp renormalises a mixture's top-k router weights; this router does not "
                          "(router_norm_topk false)")
    Q = gguf.GGMLQuantizationType
    matrix_type = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[qtype]
    if qtype in ("q8_0", "q4_0"):
        bad = [n for n, k in (("d_model", cfg.d_model), ("d_ff", cfg.d_ff), ("n_head x head_dim",
                                                                              cfg.n_head * cfg.head_dim)) if k % 32]
        if bad:
            raise ConfigError(f"{qtype} stores rows in blocks of 32 values: {', '.join(bad)} is not a multiple of 32")
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                 "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[qtype]
    sd = float_state_dict(run, cfg)

    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), arch)
        w.add_name(run.name)
        w.add_file_type(int(file_type))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_context_length(cfg.max_seq_len)
        w.add_embedding_length(cfg.d_model)
        w.add_block_count(cfg.n_layer)
        w.add_feed_forward_length(cfg.d_ff)
        w.add_head_count(cfg.n_head)
        w.add_head_count_kv(cfg.n_kv_head)
        if cfg.head_dim != cfg.d_model // cfg.n_head:
            w.add_key_length(cfg.head_dim)
            w.add_value_length(cfg.head_dim)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_vocab_size(cfg.vocab_size)
        if arch in ("phi3", *GEMMA_GLOBAL_EVERY):  # llama.cpp's Phi-3 converter writes 0 for no window
            w.add_sliding_window(cfg.sliding_window or 0)
        if arch == "gemma2":
            w.add_attn_logit_softcapping(float(cfg.attn_logit_softcap))
            w.add_final_logit_softcapping(float(cfg.final_logit_softcap))
        if cfg.ffn == "moe":
            w.add_expert_count(cfg.n_experts)
            w.add_expert_used_count(cfg.experts_per_token)
            w.add_expert_feed_forward_length(cfg.d_ff)
        extra = _rope_metadata(w, cfg, gguf, arch)
        notes = write_tokenizer(w, run, cfg.vocab_size)
        for gname, a in _gguf_tensors(cfg, to_hf(cfg, sd), arch):
            if a.ndim == 1 or matrix_type == Q.F32 or ".ffn_gate_inp." in gname:
                w.add_tensor(gname, a)
            elif matrix_type == Q.F16:
                w.add_tensor(gname, a.astype(np.float16))
            else:
                q = gguf.quants.quantize(a, matrix_type)
                w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=matrix_type)
        for name, values in extra.items():
            w.add_tensor(name, values)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return notes


def _gguf_tensors(cfg: Any, hf_tensors: Any, arch: str) -> Any:
    """(GGUF name, float32 array) from (HF name, tensor): q/k rows permuted for llama.cpp's ``llama``, and each
    layer's experts stacked into ``blk.i.ffn_{gate,up,down}_exps.weight`` once the last expert has arrived."""
    from tinyformer.interop.llama import MOE_NAMES
    from tinyformer.interop.llama import export_model_type as model_type_of

    moe = MOE_NAMES.get(model_type_of(cfg)) if cfg.ffn == "moe" else None  # (Gemma has no experts)
    kinds = dict(zip(moe[2:], ("gate", "up", "down"))) if moe else {}
    pending: dict[tuple[str, str], list[np.ndarray]] = {}
    for name, tensor in hf_tensors:
        a = np.ascontiguousarray(tensor.float().numpy(), dtype=np.float32)
        if moe and f".{moe[1]}." in name:  # model.layers.i.<experts>.e.<kind>.weight
            layer = name.removeprefix("model.layers.").split(".")[0]
            kind = kinds[name.rsplit(".", 2)[1]]
            stack = pending.setdefault((layer, kind), [])
            stack.append(a)
            if len(stack) == cfg.n_experts:
                yield f"blk.{layer}.ffn_{kind}_exps.weight", np.stack(pending.pop((layer, kind)))
            continue
        gname = gguf_name(name, arch)
        if arch in GEMMA_GLOBAL_EVERY and name.endswith("norm.weight"):  # ggml multiplies by the stored 1 + g
            a = a + np.float32(1)
        if arch == "llama" and ".attn_q." in gname:
            a = np.ascontiguousarray(permute_rows(a, cfg.n_head))
        elif arch == "llama" and ".attn_k." in gname:
            a = np.ascontiguousarray(permute_rows(a, cfg.n_kv_head))
        yield gname, a


def _rope_metadata(w: Any, cfg: Any, gguf: Any, arch: str) -> dict[str, np.ndarray]:
    """RoPE scaling keys, and the tensors some scalings are stored as (returned by name): llama3's ``rope_freqs``
    divisors, Phi-3's LongRoPE ``rope_factors_short`` / ``rope_factors_long``."""
    rs = cfg.rope_scaling
    kind = cfg.rope_type
    if kind == "default":
        return {}
    if kind == "longrope":
        if arch != "phi3":
            raise ConfigError(f"LongRoPE is stored in GGUF for llama.cpp's phi3 only, not {arch!r}")
        from tinyformer.components.rope import rope_inv_freq

        _, attention_factor = rope_inv_freq(cfg)
        w.add_rope_scaling_attn_factors(float(attention_factor))
        w.add_rope_scaling_orig_ctx_len(int(rs["original_max_position_embeddings"]))
        return {f"rope_factors_{which}.weight": np.array(rs[f"{which}_factor"], dtype=np.float32)
                for which in ("long", "short")}
    if arch == "phi3":
        raise ConfigError(f"RoPE scaling {kind!r} has no GGUF equivalent for phi3 (LongRoPE only)")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rs["factor"]))
        return {}
    if kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rs["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rs.get("original_max_position_embeddings") or cfg.max_seq_len))
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if rs.get(key) is not None:
                add(float(rs[key]))
        return {}
    if kind == "llama3":
        from tinyformer.components.rope import default_inv_freq, rope_inv_freq

        scaled, _ = rope_inv_freq(cfg)
        divisors = default_inv_freq(cfg.head_dim, cfg.rope_theta).double() / scaled.double()
        return {"rope_freqs.weight": divisors.float().numpy()}
    raise ConfigError(f"RoPE scaling {kind!r} has no GGUF equivalent here (supported: linear, yarn, llama3)")
