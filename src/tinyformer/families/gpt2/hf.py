"""The gpt2 family's Hugging Face adapter: GPT-2 (``GPT2LMHeadModel`` / ``GPT2Model``) <-> tinyformer decoder.

GPT-2 is the config ``norm=layernorm (eps 1e-5), norm_placement=pre, pos=learned, ffn=gelu_tanh``
(HF's ``gelu_new``) with every bias and a tied head; attention scales scores by 1/sqrt(d_head). No RoPE (learned
positions), so there is no rotation convention to convert; GPT-2 has no GGUF mapping here.

GPT-2's projections are ``Conv1D`` modules whose weight is stored as (in, out), the transpose of a
``torch.nn.Linear`` (out, in): every matrix is transposed on the way in and on the way out.

Name mapping, per layer i (HF, after the ``transformer.`` prefix of GPT2LMHeadModel  ->  tinyformer):
  wte.weight                          tok_emb.weight            (and lm_head.weight, tied)
  wpe.weight                          pos_emb.weight
  h.i.ln_1.{weight,bias}              blocks.i.attn_norm.{weight,bias}
  h.i.attn.c_attn.weight (d, 3d)      blocks.i.attn.qkv.weight (3d, d)     columns q | k | v -> rows q, k, v
  h.i.attn.c_attn.bias                blocks.i.attn.qkv.bias
  h.i.attn.c_proj.{weight^T,bias}     blocks.i.attn.out.{weight,bias}
  h.i.ln_2.{weight,bias}              blocks.i.ffn_norm.{weight,bias}
  h.i.mlp.c_fc.{weight^T,bias}        blocks.i.ffn.up.{weight,bias}
  h.i.mlp.c_proj.{weight^T,bias}      blocks.i.ffn.down.{weight,bias}
  ln_f.{weight,bias}                  norm.{weight,bias}

Checkpoints saved from ``GPT2LMHeadModel`` carry the ``transformer.`` prefix; those of ``GPT2Model``
do not. The prefix follows the ``architectures`` entry of config.json; ``align_config`` rewrites that
entry to match the tensor names actually stored (the original OpenAI upload on the hub lists
GPT2LMHeadModel but stores unprefixed names).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError
from tinyformer.families.adapter import (
    Adapter,
    checkpoint_tensor,
    fixed_field_problem,
    hf_pad_token_id,
    imported_hf_config,
    updated_hf_config,
)

ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
               "gelu": "gelu", "relu": "relu"}
EXPORT_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
PREFIX = "transformer."


def _prefix(cfg: ModelConfig) -> str:
    archs = (imported_hf_config(cfg) or {}).get("architectures") or ["GPT2LMHeadModel"]
    return "" if archs[0] == "GPT2Model" else PREFIX


def align_config(hf: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """``hf`` with ``architectures`` naming the class whose tensor names ``names`` are (prefixed or not)."""
    out = dict(hf)
    prefixed = any(n.startswith(PREFIX) for n in names)
    if not prefixed:
        out["architectures"] = ["GPT2Model"]
    elif (out.get("architectures") or ["GPT2Model"])[0] == "GPT2Model":
        out["architectures"] = ["GPT2LMHeadModel"]
    return out


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """A tinyformer ModelConfig from a Hugging Face GPT-2 ``config.json`` dict."""
    archs = hf.get("architectures") or ["GPT2LMHeadModel"]
    if archs[0] not in ("GPT2LMHeadModel", "GPT2Model"):
        raise ConfigError(f"{archs[0]} is not supported: the GPT-2 adapter imports GPT2LMHeadModel and GPT2Model")
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ConfigError(f"activation_function {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise ConfigError("scale_attn_by_inverse_layer_idx=true (attention scaled by 1/layer) is not supported")
    if hf.get("scale_attn_weights", True) is False:
        raise ConfigError("scale_attn_weights=false (unscaled attention scores) is not supported")
    d = hf["n_embd"]
    return ModelConfig(
        arch="decoder",
        vocab_size=hf["vocab_size"],
        d_model=d,
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        d_ff=hf.get("n_inner") or 4 * d,
        max_seq_len=hf.get("n_positions") or hf.get("n_ctx") or 1024,
        norm="layernorm",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        norm_placement="pre",
        pos="learned",
        ffn=ACTIVATIONS[act],
        attn_bias=True,
        attn_out_bias=True,
        mlp_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        dropout=float(hf.get("resid_pdrop", 0.0) or 0.0),
        attn_dropout=float(hf.get("attn_pdrop", 0.0) or 0.0),
        embd_dropout=float(hf.get("embd_pdrop", 0.0) or 0.0),
        pad_token_id=hf_pad_token_id(hf),
        extra={"source": "gpt2", "hf_config": dict(hf)},
    )


def export_problem(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` cannot be written as GPT-2, or None when it can."""
    wanted = {"arch": "decoder", "norm": "layernorm", "norm_bias": True, "norm_placement": "pre", "pos": "learned",
              "final_norm": True, "embed_scale": False, "attn_bias": True, "attn_out_bias": True, "mlp_bias": True,
              "ffn": tuple(EXPORT_ACTIVATIONS)}
    if problem := fixed_field_problem(cfg, wanted, "GPT-2"):
        return problem
    if cfg.n_kv_head != cfg.n_head or cfg.head_dim * cfg.n_head != cfg.d_model:
        return "GPT-2 has n_kv_head = n_head and head_dim = d_model / n_head"
    return None


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A Hugging Face GPT-2 config dict (the imported original, updated, when there is one)."""
    hf = updated_hf_config(cfg, export_problem, {
        "architectures": ["GPT2LMHeadModel"] if _prefix(cfg) else ["GPT2Model"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.d_ff,
        "n_positions": cfg.max_seq_len,
        "activation_function": EXPORT_ACTIVATIONS[cfg.ffn],
        "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": cfg.dropout,
        "attn_pdrop": cfg.attn_dropout,
        "embd_pdrop": cfg.embd_dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
    })
    hf.pop("n_ctx", None)
    return hf


def _pairs(cfg: ModelConfig) -> Iterator[tuple[str, str, bool]]:
    """(HF name after the prefix, tinyformer name, stored transposed) of every tensor but an untied lm_head."""
    yield "wte.weight", "tok_emb.weight", False
    yield "wpe.weight", "pos_emb.weight", False
    for i in range(cfg.n_layer):
        p, a = f"h.{i}.", f"blocks.{i}."
        for hf_name, ours, conv1d in (("ln_1", "attn_norm", False), ("ln_2", "ffn_norm", False),
                                      ("attn.c_attn", "attn.qkv", True), ("attn.c_proj", "attn.out", True),
                                      ("mlp.c_fc", "ffn.up", True), ("mlp.c_proj", "ffn.down", True)):
            yield p + hf_name + ".weight", a + ours + ".weight", conv1d  # Conv1D weights are stored (in, out)
            yield p + hf_name + ".bias", a + ours + ".bias", False
    yield "ln_f.weight", "norm.weight", False
    yield "ln_f.bias", "norm.bias", False


def hf_to_tinyformer(cfg: ModelConfig, hf_sd: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (tinyformer name, tensor) from a HF GPT-2 state dict (or lazy mapping), one at a time."""
    pre = _prefix(cfg)
    for hf_name, ours, transposed in _pairs(cfg):
        tensor = checkpoint_tensor(hf_sd, pre + hf_name)
        yield ours, tensor.t().contiguous() if transposed else tensor
    if not cfg.tie_embeddings:
        yield "lm_head.weight", checkpoint_tensor(hf_sd, "lm_head.weight", "tie_word_embeddings=false")


def tinyformer_to_hf(cfg: ModelConfig, sd: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) from a tinyformer state dict; the inverse of ``hf_to_tinyformer``."""
    pre = _prefix(cfg)
    for hf_name, ours, transposed in _pairs(cfg):
        yield pre + hf_name, sd[ours].t().contiguous() if transposed else sd[ours]
    if not cfg.tie_embeddings:
        yield "lm_head.weight", sd["lm_head.weight"]


def ignorable_hf_tensor(cfg: ModelConfig, name: str) -> bool:
    """Entries that are not weights: the causal-mask buffers old checkpoints store (``h.i.attn.bias``,
    ``h.i.attn.masked_bias``) and the copy of the embedding saved as ``lm_head`` of a tied model."""
    return name.endswith((".attn.bias", ".attn.masked_bias")) or (cfg.tie_embeddings and name == "lm_head.weight")


ADAPTER = Adapter(name="gpt2", model_types=("gpt2",), config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                  hf_to_tinyformer=hf_to_tinyformer, tinyformer_to_hf=tinyformer_to_hf, export_problem=export_problem,
                  ignorable_hf_tensor=ignorable_hf_tensor, align_config=align_config)
