"""Parameter counts of the encoder (BERT) and encoder-decoder (2017 Transformer) stacks, by formula.

``sizing.count_params`` counts an encoder's layers as a decoder's, with ``encoder_extra``, and delegates the
encoder-decoder here; the tests check every total against ``sum(p.numel())`` of the model built on the meta device.

Encoder (d = d_model, V = vocab, f = d_ff, N = n_layer):
  embedding   V d + type_vocab_size d          positions   max_seq_len d (learned only)
  per layer   attention + FFN + 2 norms        (params.attention_params / ffn_params / norm_params)
  extra       embed_norm: a norm;  pooler: d^2 + d;  mlm_head: d^2 + d + a norm + V (the output bias)
  head        the MLM decoder V d, 0 when tied to the token table (only with mlm_head)
  bert-base: 23,442,432 + 393,216 + 1,536 + 12 x 7,087,872 + 590,592 = 109,482,240 (BertModel with pooler)

Encoder-decoder (N_e encoder layers, N decoder layers):
  embedding   V d, plus V d for a separate source table (share_src_tgt_embeddings=false)
  positions   2 max_seq_len d (one learned table per stack; sinusoidal tables are not parameters)
  per decoder layer   self-attention + cross-attention + FFN + 3 norms
  extra       encoder_layers: N_e (attention + FFN + 2 norms);  encoder_final_norm;  embed_norms
  head        V d unless tied to the target table
  transformer-base (d 512, 6+6 layers, f 2048, V 37000 shared): 63,082,496
"""

from __future__ import annotations

from tinyformer.config import ModelConfig
from tinyformer.sizing.params import ParamCount, attention_params, ffn_params, norm_params


def encoder_extra(cfg: ModelConfig) -> dict[str, int]:
    """An encoder's parameters outside its layers and tables: embed_norm, pooler, mlm_head."""
    d, norm = cfg.d_model, norm_params(cfg)
    extra: dict[str, int] = {}
    if cfg.embed_norm:
        extra["embed_norm"] = norm
    if cfg.pooler:
        extra["pooler"] = d * d + d
    if cfg.mlm_head:
        extra["mlm_head"] = d * d + d + norm + cfg.vocab_size
    return extra


def count_params_classic(cfg: ModelConfig) -> ParamCount:
    """Exact parameter count of an ``encoder_decoder`` config, component by component."""
    d, V = cfg.d_model, cfg.vocab_size
    norm = norm_params(cfg)
    n_enc = cfg.n_encoder_layer or cfg.n_layer
    extra = {"encoder_layers": n_enc * (attention_params(cfg) + ffn_params(cfg) + 2 * norm)}
    if cfg.final_norm:
        extra["encoder_final_norm"] = norm
    if cfg.embed_norm:
        extra["embed_norms"] = 2 * norm
    return ParamCount(
        embedding=V * d * (1 if cfg.share_src_tgt_embeddings else 2),
        positions=2 * cfg.max_seq_len * d if cfg.pos == "learned" else 0,
        attention_per_layer=2 * attention_params(cfg),  # self- and cross-attention: the same projections
        ffn_per_layer=ffn_params(cfg),
        norms_per_layer=3 * norm,
        n_layer=cfg.n_layer,
        final_norm=norm if cfg.final_norm else 0,
        head=0 if cfg.tie_embeddings else V * d,
        extra=extra,
    )
