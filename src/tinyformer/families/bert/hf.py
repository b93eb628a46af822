"""The bert family's Hugging Face adapter: BERT (``BertModel``, ``BertForMaskedLM``, ``BertForPreTraining``) <->
tinyformer encoder. Learned positions (no RoPE, no rotation convention); no GGUF mapping here.

BERT is the config ``arch=encoder, norm=layernorm (eps 1e-12), norm_placement=post, final_norm=false,
pos=learned, ffn=gelu, type_vocab_size=2, embed_norm=true`` with every bias; ``BertModel`` adds the
pooler, ``BertForMaskedLM`` the masked-LM head (and no pooler), ``BertForPreTraining`` both.

Name mapping, per layer i (HF, after the ``bert.`` prefix of the *For* classes  ->  tinyformer):
  embeddings.word_embeddings.weight                  tok_emb.weight
  embeddings.position_embeddings.weight              pos_emb.weight
  embeddings.token_type_embeddings.weight            type_emb.weight
  embeddings.LayerNorm.{weight,bias}                 emb_norm.{weight,bias}
  encoder.layer.i.attention.self.{query,key,value}   blocks.i.attn.qkv        (rows: q, then k, then v)
  encoder.layer.i.attention.output.dense             blocks.i.attn.out
  encoder.layer.i.attention.output.LayerNorm         blocks.i.attn_norm       (Post-Norm: after the residual)
  encoder.layer.i.intermediate.dense                 blocks.i.ffn.up
  encoder.layer.i.output.dense                       blocks.i.ffn.down
  encoder.layer.i.output.LayerNorm                   blocks.i.ffn_norm
  pooler.dense                                       pooler.dense
  cls.predictions.transform.dense                    mlm_head.dense           (no prefix: it is outside bert.)
  cls.predictions.transform.LayerNorm                mlm_head.norm
  cls.predictions.bias                               lm_head.bias             (lm_head.weight is tok_emb, tied)

The next-sentence head of BertForPreTraining (``cls.seq_relationship``) is not imported.

Sentence-transformers folders (a BERT plus pooling) are ``families/bert/sentence_transformers.py``.
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

PREFIX = "bert."
# architecture -> (tensor-name prefix, pooler, masked-LM head)
ARCHITECTURES = {
    "BertModel": ("", True, False),
    "BertForMaskedLM": (PREFIX, False, True),
    "BertForPreTraining": (PREFIX, True, True),
}
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
EXPORT_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def _prefix(cfg: ModelConfig) -> str:
    hf = imported_hf_config(cfg)
    if hf and hf.get("architectures"):
        return ARCHITECTURES.get(hf["architectures"][0], (PREFIX,))[0]
    return PREFIX if cfg.mlm_head else ""


def align_config(hf: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """``hf`` with ``architectures`` naming the class whose tensors ``names`` are: prefixed or not, with or
    without the pooler and the masked-LM head."""
    names = set(names)
    prefixed = any(n.startswith(PREFIX) for n in names)
    pooler = (PREFIX if prefixed else "") + "pooler.dense.weight" in names
    mlm = "cls.predictions.transform.dense.weight" in names
    arch = {(False, True, False): "BertModel", (True, False, True): "BertForMaskedLM",
            (True, True, True): "BertForPreTraining"}.get((prefixed, pooler, mlm))
    out = dict(hf)
    if arch is not None:
        out["architectures"] = [arch]
    return out


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """A tinyformer ModelConfig from a Hugging Face BERT ``config.json`` dict."""
    arch = (hf.get("architectures") or ["BertModel"])[0]
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{arch} is not supported: the BERT adapter imports {', '.join(ARCHITECTURES)} "
                          "(task heads such as classifiers are not part of tinyformer's encoder)")
    _, pooler, mlm = ARCHITECTURES[arch]
    act = hf.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ConfigError(f"hidden_act {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ConfigError(f"position_embedding_type {hf['position_embedding_type']!r} is not supported "
                          "(only 'absolute' learned positions)")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise ConfigError("BERT used as a decoder (is_decoder / add_cross_attention) is not supported")
    d, n_head = hf["hidden_size"], hf["num_attention_heads"]
    return ModelConfig(
        arch="encoder",
        vocab_size=hf["vocab_size"],
        d_model=d,
        n_layer=hf["num_hidden_layers"],
        n_head=n_head,
        d_ff=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"],
        norm="layernorm",
        norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        norm_placement="post",
        final_norm=False,
        pos="learned",
        ffn=ACTIVATIONS[act],
        attn_bias=True,
        attn_out_bias=True,
        mlp_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        type_vocab_size=hf.get("type_vocab_size", 2),
        embed_norm=True,
        pooler=pooler,
        mlm_head=mlm,
        dropout=float(hf.get("hidden_dropout_prob", 0.0) or 0.0),
        embd_dropout=float(hf.get("hidden_dropout_prob", 0.0) or 0.0),
        attn_dropout=float(hf.get("attention_probs_dropout_prob", 0.0) or 0.0),
        pad_token_id=hf_pad_token_id(hf),
        extra={"source": "bert", "hf_config": dict(hf)},
    )


def export_problem(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` cannot be written as BERT, or None when it can."""
    wanted = {"arch": "encoder", "norm": "layernorm", "norm_bias": True, "norm_placement": "post",
              "final_norm": False, "pos": "learned", "embed_scale": False, "embed_norm": True, "attn_bias": True,
              "attn_out_bias": True, "mlp_bias": True, "ffn": tuple(EXPORT_ACTIVATIONS)}
    if problem := fixed_field_problem(cfg, wanted, "BERT"):
        return problem
    if cfg.type_vocab_size < 1:
        return "BERT needs token-type embeddings (type_vocab_size >= 1)"
    if cfg.n_kv_head != cfg.n_head or cfg.head_dim * cfg.n_head != cfg.d_model:
        return "BERT has n_kv_head = n_head and head_dim = d_model / n_head"
    if cfg.mlm_head and not cfg.tie_embeddings:
        return "BERT's masked-LM decoder is tied to the word embeddings (needs tie_embeddings=true)"
    if not cfg.mlm_head and not cfg.pooler:
        return "a BERT export needs the pooler (BertModel) or the masked-LM head (BertForMaskedLM)"
    return None


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A Hugging Face BERT config dict (the imported original, updated, when there is one)."""
    arch = ("BertForPreTraining" if cfg.pooler else "BertForMaskedLM") if cfg.mlm_head else "BertModel"
    return updated_hf_config(cfg, export_problem, {
        "architectures": [arch],
        "model_type": "bert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "intermediate_size": cfg.d_ff,
        "hidden_act": EXPORT_ACTIVATIONS[cfg.ffn],
        "max_position_embeddings": cfg.max_seq_len,
        "type_vocab_size": cfg.type_vocab_size,
        "layer_norm_eps": cfg.norm_eps,
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attn_dropout,
        "position_embedding_type": "absolute",
    })


_LAYER = (  # (HF name under encoder.layer.i., tinyformer name under blocks.i.)
    ("attention.output.dense", "attn.out"),
    ("attention.output.LayerNorm", "attn_norm"),
    ("intermediate.dense", "ffn.up"),
    ("output.dense", "ffn.down"),
    ("output.LayerNorm", "ffn_norm"),
)
_EMBEDDINGS = (
    ("embeddings.word_embeddings.weight", "tok_emb.weight"),
    ("embeddings.position_embeddings.weight", "pos_emb.weight"),
    ("embeddings.token_type_embeddings.weight", "type_emb.weight"),
    ("embeddings.LayerNorm.weight", "emb_norm.weight"),
    ("embeddings.LayerNorm.bias", "emb_norm.bias"),
)


def _pairs(cfg: ModelConfig, pre: str) -> Iterator[tuple[list[str], str]]:
    """(the HF tensors whose rows it stacks, tinyformer name) of every tensor: q/k/v (last) are stacked, the others
    copied as they are."""
    yield from (([pre + hf], ours) for hf, ours in _EMBEDDINGS)
    for i in range(cfg.n_layer):
        for hf, ours in _LAYER:
            for kind in ("weight", "bias"):
                yield [f"{pre}encoder.layer.{i}.{hf}.{kind}"], f"blocks.{i}.{ours}.{kind}"
    if cfg.pooler:
        yield [pre + "pooler.dense.weight"], "pooler.dense.weight"
        yield [pre + "pooler.dense.bias"], "pooler.dense.bias"
    if cfg.mlm_head:
        for hf, ours in (("transform.dense", "mlm_head.dense"), ("transform.LayerNorm", "mlm_head.norm")):
            for kind in ("weight", "bias"):
                yield [f"cls.predictions.{hf}.{kind}"], f"{ours}.{kind}"
        yield ["cls.predictions.bias"], "lm_head.bias"
    for i in range(cfg.n_layer):
        p = f"{pre}encoder.layer.{i}.attention.self."
        for kind in ("weight", "bias"):
            yield [p + f"{x}.{kind}" for x in ("query", "key", "value")], f"blocks.{i}.attn.qkv.{kind}"


def hf_to_tinyformer(cfg: ModelConfig, hf_sd: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (tinyformer name, tensor) from a HF BERT state dict (or lazy mapping), one at a time."""
    for names, ours in _pairs(cfg, _prefix(cfg)):
        parts = [checkpoint_tensor(hf_sd, name) for name in names]
        yield ours, parts[0] if len(parts) == 1 else torch.cat(parts)


def tinyformer_to_hf(cfg: ModelConfig, sd: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) from a tinyformer state dict; the inverse of ``hf_to_tinyformer``."""
    for names, ours in _pairs(cfg, _prefix(cfg)):
        if len(names) == 1:
            yield names[0], sd[ours]
        else:
            for name, part in zip(names, sd[ours].chunk(3)):
                yield name, part.contiguous()


def ignorable_hf_tensor(cfg: ModelConfig, name: str) -> bool:
    """Entries that are not weights of the imported model: position/token-type id buffers, the tied copies of
    the MLM decoder, the next-sentence head, and a pooler stored by a checkpoint whose class has none."""
    return (name.endswith(("embeddings.position_ids", "embeddings.token_type_ids"))
            or name in ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
            or name.startswith("cls.seq_relationship.")
            or (not cfg.pooler and name.removeprefix(PREFIX).startswith("pooler.")))


ADAPTER = Adapter(name="bert", model_types=("bert",), config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                  hf_to_tinyformer=hf_to_tinyformer, tinyformer_to_hf=tinyformer_to_hf, export_problem=export_problem,
                  ignorable_hf_tensor=ignorable_hf_tensor, align_config=align_config)
