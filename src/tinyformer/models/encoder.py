"""The encoder-only model (BERT family), one readable file.

    h_0 = Norm_emb(E[x] (* sqrt(d) if embed_scale) + P[pos] + S[token_type])    (Norm_emb when embed_norm)
    h_l = Block_l(h_{l-1}),  bidirectional: every token attends to every non-padding token
    pooled = tanh(W_p h_L[:, 0] + b_p)                                           (pooler: the [CLS] token)
    logits = W_dec Norm(gelu(W_t h_L + b_t)) + b_dec,  W_dec = E when tied       (mlm_head)

Shapes: input_ids, token_type_ids, attention_mask (B, T) -> hidden states (B, T, d);
pooled (B, d); MLM logits (B, T, vocab). ``attention_mask`` marks real tokens with 1 and padding
with 0 (right padding, as BERT uses; positions are 0 .. T-1 whatever the padding).

BERT is the config ``norm=layernorm, norm_placement=post, pos=learned, ffn=gelu, type_vocab_size=2,
embed_norm=True, final_norm=False`` plus biases (see ``families/bert/``).

Sentence embeddings (Reimers & Gurevych 2019) pool the hidden states over the real tokens:
mean  e = sum_t m_t h_t / sum_t m_t;   cls  e = h_0;   max  e_i = max_{t: m_t = 1} h_{t,i};
then e / ||e||_2 so that a dot product is the cosine similarity.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tinyformer.components.block import Block
from tinyformer.components.cross_attention import source_padding_mask
from tinyformer.components.ffn import activation
from tinyformer.components.initialization import init_weights
from tinyformer.components.kv_cache import Step
from tinyformer.components.norm import build_norm
from tinyformer.components.positions import build_positions
from tinyformer.components.rope import RotaryEmbedding
from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError, GenerationError

POOLING_MODES = ("mean", "cls", "max")


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None, mode: str = "mean") -> torch.Tensor:
    """Pool (B, T, d) hidden states over the real tokens of each row -> (B, d). See the module docstring."""
    if mode not in POOLING_MODES:
        raise ConfigError(f"pooling mode {mode!r} is not one of {', '.join(POOLING_MODES)}")
    if mode == "cls":
        return hidden[:, 0]
    if attention_mask is None:
        attention_mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    if mode == "max":
        return hidden.masked_fill(m == 0, float("-inf")).amax(dim=1)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp_min(1e-9)


class Pooler(nn.Module):
    """pooled = tanh(W h[:, 0] + b): BERT's summary of the sequence, read from the first ([CLS]) token."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class MLMTransform(nn.Module):
    """Norm(act(W_t h + b_t)): the transform BERT applies before the vocabulary projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.norm = build_norm(cfg)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(activation(self.cfg.ffn, self.dense(hidden)))  # GELU for the gated SwiGLU


class EncoderModel(nn.Module):
    """Bidirectional Transformer encoder. ``forward`` returns the final hidden states (B, T, d)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.arch != "encoder":
            raise ConfigError(f"EncoderModel needs arch='encoder', got {cfg.arch!r}")
        self.cfg = cfg
        d = cfg.d_model
        self.tok_emb = nn.Embedding(cfg.vocab_size, d)
        self.type_emb = nn.Embedding(cfg.type_vocab_size, d) if cfg.type_vocab_size > 0 else None
        self.rope = RotaryEmbedding(cfg) if cfg.pos == "rope" else None
        self.pos_emb = build_positions(cfg)
        self.emb_scale = math.sqrt(d) if cfg.embed_scale else 1.0
        self.emb_norm = build_norm(cfg) if cfg.embed_norm else None
        self.emb_drop = nn.Dropout(cfg.embd_dropout) if cfg.embd_dropout > 0 else nn.Identity()
        self.blocks = nn.ModuleList(Block(cfg, causal=False) for _ in range(cfg.n_layer))
        self.norm = build_norm(cfg) if cfg.final_norm else nn.Identity()
        self.pooler = Pooler(d) if cfg.pooler else None
        self.mlm_head = MLMTransform(cfg) if cfg.mlm_head else None
        self.lm_head: nn.Linear | None = None
        if cfg.mlm_head:
            self.lm_head = nn.Linear(d, cfg.vocab_size, bias=True)  # the MLM decoder and its output bias
            if cfg.tie_embeddings:
                self.lm_head.weight = self.tok_emb.weight
        init_weights(self, cfg.init_std, 2 * cfg.n_layer)

    # ------------------------------------------------------------------ forward
    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """h_0 (B, T, d): token (+ position) (+ token-type) embeddings, then the embedding norm."""
        B, T = input_ids.shape
        if T > self.cfg.max_seq_len:
            raise GenerationError(f"sequence of {T} tokens is longer than the model's context "
                                  f"(max_seq_len={self.cfg.max_seq_len})")
        x = self.tok_emb(input_ids)
        if self.emb_scale != 1.0:
            x = x * self.emb_scale
        x = self.pos_emb.add_to(x, position_ids if position_ids is not None else torch.arange(T, device=x.device))
        if self.type_emb is not None:
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            x = x + self.type_emb(types)
        elif token_type_ids is not None and bool(token_type_ids.any()):
            raise ConfigError("token_type_ids were given but the model has no token-type embeddings "
                              "(type_vocab_size=0)")
        if self.emb_norm is not None:
            x = self.emb_norm(x)
        return self.emb_drop(x)

    def forward(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Final hidden states (B, T, d), as ``transformers.BertModel``'s ``last_hidden_state``."""
        x = self.embed(input_ids, token_type_ids, position_ids)
        positions = position_ids if position_ids is not None else torch.arange(input_ids.shape[1])[None]
        rope = self.rope.tables(positions.to(input_ids.device)) if self.rope is not None else None
        # (B, 1, 1, T): padding keys hidden from every query
        step = Step.whole(source_padding_mask(attention_mask), rope)
        for block in self.blocks:
            x = block(x, step)
        return self.norm(x)

    def pooled(self, hidden: torch.Tensor) -> torch.Tensor:
        """The pooler output (B, d) from hidden states (needs ``pooler=True``)."""
        if self.pooler is None:
            raise ConfigError("this encoder has no pooler (pooler=false)")
        return self.pooler(hidden)

    def mlm_logits(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                   token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Masked-LM logits (B, T, vocab) (needs ``mlm_head=True``)."""
        if self.mlm_head is None or self.lm_head is None:
            raise ConfigError("this encoder has no masked-LM head (mlm_head=false)")
        h = self(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return self.lm_head(self.mlm_head(h))

    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
             attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Masked-LM cross-entropy: -1/|M| sum_{t in M} log softmax(logits_t)[targets_t], M = {t: targets_t !=
        ignore_index} (the masked positions; see ``training/objectives/mlm.py`` for how they are chosen)."""
        logits = self.mlm_logits(input_ids, attention_mask=attention_mask)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.reshape(-1), ignore_index=ignore_index)

    @torch.no_grad()
    def sentence_embedding(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                           mode: str = "mean") -> torch.Tensor:
        """Pooled (B, d) sentence vectors, L2-normalised (see the module docstring)."""
        h = self(input_ids, attention_mask=attention_mask)
        return F.normalize(pool(h, attention_mask, mode), dim=-1)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
