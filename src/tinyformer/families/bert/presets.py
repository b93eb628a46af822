"""Named shapes of the bert family (Devlin et al. 2019): Post-Norm encoder, LayerNorm eps 1e-12 after the summed
embeddings, learned positions, 2 token types, GELU. Field values, never a code path."""

from __future__ import annotations

from typing import Any

BERT: dict[str, Any] = dict(
    arch="encoder", norm="layernorm", norm_eps=1e-12, norm_placement="post", final_norm=False, pos="learned",
    ffn="gelu", attn_bias=True, attn_out_bias=True, mlp_bias=True, tie_embeddings=True, type_vocab_size=2,
    embed_norm=True, pooler=True, pad_token_id=0,
)

PRESETS: dict[str, dict[str, Any]] = {
    # bert-base counts as transformers.BertModel with its pooler: 109,482,240.
    "bert-base": dict(BERT, vocab_size=30522, d_model=768, n_layer=12, n_head=12, d_ff=3072, max_seq_len=512),
    # BERT-Tiny's shape (Turc et al. 2019), with the masked-LM head: the CPU default of `--objective mlm`.
    "bert-tiny": dict(BERT, vocab_size=30522, d_model=128, n_layer=2, n_head=2, d_ff=512, max_seq_len=512,
                      mlm_head=True),
}
