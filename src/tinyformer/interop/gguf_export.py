"""Export a run folder as a GGUF file that llama.cpp (and transformers) load, for the families with llama.cpp
architectures (llama: Llama, Mistral, Mixtral; qwen: Qwen2/3, Qwen3-MoE; phi3; gemma: Gemma 2/3).

    tinyformer convert --model RUN --to-gguf FILE [--type f32|f16|bf16|q8_0|q4_0]

The inverse of ``interop/gguf.py``. The family registry picks the family that writes the model (as for a Hugging
Face export) and the family the llama.cpp architecture (``families/<family>/gguf.py``); the run's weights go through
the family's adapter to their Hugging Face names and then to llama.cpp's (``token_embd``, ``blk.i.attn_q``, ...); the
hyper-parameters become the ``<arch>.*`` metadata keys (context, widths, heads, RMSNorm epsilon, RoPE base, and RoPE
scaling: linear and yarn as keys, llama3 as the ``rope_freqs`` tensor of per-frequency divisors llama.cpp reads,
LongRoPE (phi3) as the ``rope_factors_short`` / ``rope_factors_long`` tensors), the window as
``attention.sliding_window`` where the architecture has one, and the architecture's own keys (Gemma 2's soft-caps).
A mixture's experts are stacked per layer into ``ffn_{gate,up,down}_exps`` (E, rows, cols); its router
``ffn_gate_inp`` stays F32 (as llama.cpp keeps it). llama.cpp renormalises a mixture's top-k weights and has no MLP
biases: models that need otherwise are refused, and so are models that differ from an architecture's fixed choices
(``GGUFArch.export_problem``, e.g. Gemma's layer pattern).

RoPE. Where llama.cpp rotates adjacent pairs (``rope_interleaved``, see ``families/llama/gguf.py``), W_q / W_k rows
(and biases) are permuted here, at the file boundary, as llama.cpp's own converter does (``permute_rows``). Gemma's
norm gains are stored as 1 + g (``norm_plus_one``: ggml multiplies by the stored gain).

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
from tinyformer.families.family import GGUFArch
from tinyformer.families.llama.gguf import gguf_name

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")

def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Half-split RoPE rows -> llama.cpp's adjacent-pair order, per head (weights and biases):
    ``gguf = w.reshape(n_head, 2, d_head / 2, d_in).swapaxes(1, 2).reshape(rows, d_in)``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def float_state_dict(run: Path, cfg: Any) -> dict[str, torch.Tensor]:
    """The run's tensors as float (a quantized run's layers dequantized), tinyformer names, tied head once."""
    from tinyformer.components.quantized import dequantize_weight
    from tinyformer.run_folder import PORTABLE_PARTS, iter_tensors, quant_spec

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

    from tinyformer.families import GGUF_ARCHS, gguf_family_for
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
    family = gguf_family_for(cfg)
    assert family.gguf_arch_for is not None, f"family {family.name} lists GGUF architectures but no choice among them"
    spec = GGUF_ARCHS[family.gguf_arch_for(cfg)]
    arch, to_hf = spec.name, family.adapter.tinyformer_to_hf
    if problem := spec.export_problem(cfg):
        raise ConfigError(problem)
    if cfg.attn_bias != cfg.attn_out_bias and not spec.split_qkv_bias:
        raise ConfigError("a model with q/k/v biases but no output bias (or the reverse) is not a llama.cpp "
                          "architecture")
    if cfg.mlp_bias:
        raise ConfigError("mlp_bias (biases on the feed-forward layers) is not supported by llama.cpp's llama")
    if cfg.sliding_window is not None and not spec.sliding_window:
        raise ConfigError(f"sliding_window: llama.cpp's {arch!r} architecture has no sliding-window attention")
    if cfg.ffn == "moe" and not (cfg.router_norm_topk or cfg.router_order == "topk_softmax"):
        raise ConfigError("llama.cpp renormalises a mixture's top-k router weights; this router does not "
                          "(router_norm_topk false)")
    Q = gguf.GGMLQuantizationType
    matrix_type = Q[qtype.upper()]  # F32, F16, BF16, Q8_0, Q4_0
    if qtype in ("q8_0", "q4_0"):
        bad = [n for n, k in (("d_model", cfg.d_model), ("d_ff", cfg.d_ff), ("n_head x head_dim",
                                                                              cfg.n_head * cfg.head_dim)) if k % 32]
        if bad:
            raise ConfigError(f"{qtype} stores rows in blocks of 32 values: {', '.join(bad)} is not a multiple of 32")
    file_type = gguf.LlamaFileType["ALL_F32" if qtype == "f32" else f"MOSTLY_{qtype.upper()}"]
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
        if spec.sliding_window:  # llama.cpp's Phi-3 converter writes 0 for no window
            w.add_sliding_window(cfg.sliding_window or 0)
        if cfg.attn_logit_softcap is not None:  # Gemma 2's (every other architecture's export_problem refuses them)
            w.add_attn_logit_softcapping(float(cfg.attn_logit_softcap))
            w.add_final_logit_softcapping(float(cfg.final_logit_softcap))
        if cfg.ffn == "moe":
            w.add_expert_count(cfg.n_experts)
            w.add_expert_used_count(cfg.experts_per_token)
            w.add_expert_feed_forward_length(cfg.d_ff)
        extra = _rope_metadata(w, cfg, gguf, spec)
        notes = write_tokenizer(w, run, cfg.vocab_size)
        for gname, a in _gguf_tensors(cfg, to_hf(cfg, sd), spec):
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


def _gguf_tensors(cfg: Any, hf_tensors: Any, arch: GGUFArch) -> Any:
    """(GGUF name, float32 array) from (HF name, tensor): norm gains as 1 + g where the architecture stores them so,
    q/k rows permuted where it rotates adjacent pairs (llama), and each layer's experts stacked into
    ``blk.i.ffn_{gate,up,down}_exps.weight`` once the last expert has arrived."""
    moe = arch.moe if cfg.ffn == "moe" else None
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
        if arch.norm_plus_one and name.endswith("norm.weight"):  # ggml multiplies by the stored 1 + g
            a = a + np.float32(1)
        if arch.rope_interleaved and ".attn_q." in gname:
            a = np.ascontiguousarray(permute_rows(a, cfg.n_head))
        elif arch.rope_interleaved and ".attn_k." in gname:
            a = np.ascontiguousarray(permute_rows(a, cfg.n_kv_head))
        yield gname, a


def _rope_metadata(w: Any, cfg: Any, gguf: Any, spec: GGUFArch) -> dict[str, np.ndarray]:
    """RoPE scaling keys, and the tensors some scalings are stored as (returned by name): llama3's ``rope_freqs``
    divisors, Phi-3's LongRoPE ``rope_factors_short`` / ``rope_factors_long``."""
    arch = spec.name
    rs = cfg.rope_scaling
    kind = cfg.rope_type
    if kind == "default":
        return {}
    if kind == "longrope":
        if not spec.longrope:
            raise ConfigError(f"LongRoPE is stored in GGUF for llama.cpp's phi3 only, not {arch!r}")
        from tinyformer.components.rope import rope_inv_freq

        _, attention_factor = rope_inv_freq(cfg)
        w.add_rope_scaling_attn_factors(float(attention_factor))
        w.add_rope_scaling_orig_ctx_len(int(rs["original_max_position_embeddings"]))
        return {f"rope_factors_{which}.weight": np.array(rs[f"{which}_factor"], dtype=np.float32)
                for which in ("long", "short")}
    if spec.longrope:
        raise ConfigError(f"RoPE scaling {kind!r} has no GGUF equivalent for {arch} (LongRoPE only)")
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
