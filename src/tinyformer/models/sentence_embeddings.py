"""Sentence embeddings of texts from an encoder run: what ``tinyformer embed`` prints and the server's
``POST /v1/embeddings`` returns.

    ids_i = tokenize(text_i) with the tokenizer's special tokens ([CLS] ... [SEP] for BERT)
    e_i   = pool(Encoder(ids_i)) / ||pool(Encoder(ids_i))||_2        (N, d)

Pooling over the real (non-padding) tokens is the run's: the one a sentence-transformers import recorded
(``cfg.extra["sentence_transformers"]["pooling"]``), else mean (see models/encoder.py for the formulas).
The vectors are L2-normalised, so E E^T is the cosine-similarity matrix. A text longer than the limit
(the model's ``max_seq_len``, the imported ``max_seq_length`` and any ``max_length`` asked for, the
smallest) loses its last content tokens, never its special tokens, as sentence-transformers does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tinyformer.errors import DataError

__all__ = ["embed", "embed_ids", "embedding_limit", "encode_texts"]


def _sentence_transformers(model) -> dict:
    extra = model.cfg.extra
    return (extra.get("sentence_transformers") or {}) if isinstance(extra, dict) else {}


def embedding_limit(model, max_length: int | None = None) -> int:
    """The most tokens a text keeps: the smallest of max_seq_len, the imported max_seq_length, max_length."""
    return min(x for x in (model.cfg.max_seq_len, _sentence_transformers(model).get("max_seq_length"), max_length)
               if x)


def encode_texts(model, tokenizer, texts: Sequence[str], max_length: int) -> list[list[int]]:
    """Token ids per text: the tokenizer's own special tokens (BERT's [CLS] .. [SEP]); a model trained with
    ``--objective mlm`` gets the [CLS] id it was trained with in front. A text longer than ``max_length``
    loses its last content tokens, never the special tokens."""
    cls_id = (model.cfg.extra.get("mlm") or {}).get("cls_token_id") if isinstance(model.cfg.extra, dict) else None
    out = []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=True)
        prefix = [cls_id] if cls_id is not None and (not ids or ids[0] != cls_id) else []
        if len(prefix) + len(ids) > max_length:  # cut the text, keep the special tokens (as sentence-transformers)
            ids = tokenizer.encode(text, add_special_tokens=True, max_length=max_length - len(prefix))
        ids = prefix + ids
        if not ids:
            raise DataError(f"text {text!r} has no tokens")
        out.append(ids)
    return out


@torch.no_grad()
def embed_ids(model, ids: Sequence[Sequence[int]], pad_id: int | None, pooling: str | None = None,
              batch_size: int = 32) -> torch.Tensor:
    """(N, d) L2-normalised embeddings of token-id rows, ``batch_size`` rows per forward pass (right-padded
    with ``pad_id``, 0 when None, under an attention mask)."""
    pooling = pooling or _sentence_transformers(model).get("pooling", "mean")
    pad_id = 0 if pad_id is None else pad_id
    device = next(model.parameters()).device
    vectors = []
    for i in range(0, len(ids), batch_size):
        chunk = ids[i : i + batch_size]
        L = max(map(len, chunk))
        x = torch.tensor([list(row) + [pad_id] * (L - len(row)) for row in chunk], device=device)  # (b, L)
        mask = torch.tensor([[1] * len(row) + [0] * (L - len(row)) for row in chunk], device=device)  # (b, L)
        vectors.append(model.sentence_embedding(x, mask, mode=pooling).float())
    return torch.cat(vectors)


def embed(model, tokenizer, texts: Sequence[str], pooling: str | None = None, max_length: int | None = None,
          batch_size: int = 32) -> torch.Tensor:
    """(N, d) L2-normalised sentence embeddings of ``texts``."""
    ids = encode_texts(model, tokenizer, texts, embedding_limit(model, max_length))
    return embed_ids(model, ids, tokenizer.pad_id, pooling, batch_size)
