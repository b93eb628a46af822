"""The encoder-decoder Transformer (Vaswani et al. 2017, "Attention Is All You Need"), one readable file.

    encoder:  m_0 = E_src[x] * sqrt(d) + PE(pos);   m_l = EncBlock_l(m_{l-1})        (bidirectional)
    decoder:  h_0 = E[y] * sqrt(d) + PE(pos)
              per layer, Post-Norm (the paper; Pre-Norm when norm_placement="pre"):
                a = Norm(h + SelfAttn(h))            causal: position t sees targets <= t
                c = Norm(a + CrossAttn(a, m_L))      every non-padding source position
                h' = Norm(c + FFN(c))
    logits = W_head h_L,  W_head = E when tied (the paper shares E_src = E = W_head)

Shapes: src_ids (B, S), tgt_ids (B, T) -> logits (B, T, vocab). ``src_mask`` (B, S) marks real source
tokens with 1 and padding with 0. Targets are right-padded; the causal mask already keeps real target
positions from seeing the padding after them, and padded positions are left out of the loss.

Decoding: the encoder runs once; each decoder layer's cross-attention K/V are projected from its
output once (``cross_kv``); the decoder's self-attention K/V are appended to a ``KVCache`` one
token at a time, so a step costs one token's worth of decoder work. Greedy and beam search are in
``tinyformer.generation.seq2seq``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tinyformer.components.attention import SelfAttention
from tinyformer.components.block import Block, build_ffn
from tinyformer.components.cross_attention import CrossAttention, source_padding_mask
from tinyformer.components.initialization import init_weights
from tinyformer.components.kv_cache import WHOLE_SEQUENCE, KVCache, RowCalls, Step
from tinyformer.components.norm import build_norm
from tinyformer.components.positions import LearnedPositions, build_positions
from tinyformer.components.rope import RotaryEmbedding
from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError, GenerationError

CrossKV = list[tuple[torch.Tensor, torch.Tensor]]


class DecoderBlock(nn.Module):
    """Masked self-attention, cross-attention and FFN, each wrapped in a residual and a norm.

    Post-Norm: y = Norm(x + F(x)) per sublayer; Pre-Norm: y = x + F(Norm(x)) (see components/block.py)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.pre_norm = cfg.norm_placement == "pre"
        self.attn_norm = build_norm(cfg)
        self.attn = SelfAttention(cfg, causal=True, layer=layer)
        self.cross_norm = build_norm(cfg)
        self.cross_attn = CrossAttention(cfg)
        self.ffn_norm = build_norm(cfg)
        self.ffn = build_ffn(cfg)
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, memory_kv: tuple[torch.Tensor, torch.Tensor], src_mask: torch.Tensor | None,
                step: Step = WHOLE_SEQUENCE) -> torch.Tensor:
        """x (B, T, d) -> (B, T, d). ``src_mask`` (B, 1, 1, S) bool or None; ``step`` the call's positions and
        self-attention cache (components/kv_cache.py)."""
        if self.pre_norm:
            x = x + self.drop(self.attn(self.attn_norm(x), step))
            x = x + self.drop(self.cross_attn(self.cross_norm(x), memory_kv, src_mask))
            return x + self.drop(self.ffn(self.ffn_norm(x)))
        x = self.attn_norm(x + self.drop(self.attn(x, step)))
        x = self.cross_norm(x + self.drop(self.cross_attn(x, memory_kv, src_mask)))
        return self.ffn_norm(x + self.drop(self.ffn(x)))


class Seq2SeqModel(nn.Module):
    """Encoder-decoder Transformer. ``forward(src, tgt)`` returns teacher-forced logits (B, T, vocab)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.arch != "encoder_decoder":
            raise ConfigError(f"Seq2SeqModel needs arch='encoder_decoder', got {cfg.arch!r}")
        self.cfg = cfg
        d = cfg.d_model
        self.tok_emb = nn.Embedding(cfg.vocab_size, d)  # the target (decoder) table; shared with the source
        self.src_emb = None if cfg.share_src_tgt_embeddings else nn.Embedding(cfg.vocab_size, d)
        self.rope = RotaryEmbedding(cfg) if cfg.pos == "rope" else None
        self.pos_emb = build_positions(cfg)
        # learned: one table per stack (source and target positions mean different things); a fixed function
        # (sinusoidal) serves both
        self.src_pos_emb = LearnedPositions(cfg.max_seq_len, d) if cfg.pos == "learned" else None
        self.emb_scale = math.sqrt(d) if cfg.embed_scale else 1.0
        self.src_emb_norm = build_norm(cfg) if cfg.embed_norm else None
        self.emb_norm = build_norm(cfg) if cfg.embed_norm else None
        self.emb_drop = nn.Dropout(cfg.embd_dropout) if cfg.embd_dropout > 0 else nn.Identity()
        self.encoder = nn.ModuleList(Block(cfg, causal=False) for _ in range(cfg.n_encoder_layer))
        self.encoder_norm = build_norm(cfg) if cfg.final_norm else nn.Identity()
        self.decoder = nn.ModuleList(DecoderBlock(cfg, layer=i) for i in range(cfg.n_layer))
        self.norm = build_norm(cfg) if cfg.final_norm else nn.Identity()
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # residual branches per stream: 2 per encoder layer; 3 per decoder layer
        init_weights(self, cfg.init_std, max(2 * cfg.n_encoder_layer, 3 * cfg.n_layer))

    # ------------------------------------------------------------------ embeddings
    def _embed(self, ids: torch.Tensor, table: nn.Embedding, positions: nn.Module, norm: nn.Module | None,
               pos: torch.Tensor | None = None) -> torch.Tensor:
        """ids (B, T) -> (B, T, d); ``pos`` the tokens' positions (B|1, T), by default 0 .. T - 1."""
        T = ids.shape[1]
        if pos is None:
            if T > self.cfg.max_seq_len:
                raise GenerationError(f"position {T - 1} is beyond the model's context "
                                      f"(max_seq_len={self.cfg.max_seq_len})")
            pos = torch.arange(T, device=ids.device)[None]  # (1, T)
        x = table(ids)
        if self.emb_scale != 1.0:
            x = x * self.emb_scale
        x = positions.add_to(x, pos)
        if norm is not None:
            x = norm(x)
        return self.emb_drop(x)

    # ------------------------------------------------------------------ encoder
    def encode(self, src_ids: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Source ids (B, S) -> memory (B, S, d), the encoder's output."""
        table = self.src_emb if self.src_emb is not None else self.tok_emb
        positions = self.src_pos_emb if self.src_pos_emb is not None else self.pos_emb
        x = self._embed(src_ids, table, positions, self.src_emb_norm)
        rope = self.rope(0, src_ids.shape[1]) if self.rope is not None else None
        step = Step.whole(source_padding_mask(src_mask), rope)
        for block in self.encoder:
            x = block(x, step)
        return self.encoder_norm(x)

    def cross_kv(self, memory: torch.Tensor) -> CrossKV:
        """Each decoder layer's cross-attention (k, v) of the memory: computed once per source."""
        return [block.cross_attn.project_memory(memory) for block in self.decoder]

    # ------------------------------------------------------------------ decoder
    def decode(self, tgt_ids: torch.Tensor, cross: CrossKV, src_mask: torch.Tensor | None = None,
               cache: KVCache | RowCalls | None = None) -> torch.Tensor:
        """Target ids (B, T) -> decoder hidden states (B, T, d), attending to the source through
        ``cross`` (from ``cross_kv``). With a ``cache``, the T tokens continue what it holds (``cache.at``:
        row b from its own position, as the engine feeds rows)."""
        step = cache.begin(tgt_ids) if cache is not None else Step.whole()  # the cache checks its room
        x = self._embed(tgt_ids, self.tok_emb, self.pos_emb, self.emb_norm, step.positions)
        if step.positions is None:  # no cache: positions 0 .. T - 1
            step.positions = torch.arange(tgt_ids.shape[1], device=tgt_ids.device)[None]  # (1, T)
        step.rope = [self.rope.tables(step.positions, step.seen) if self.rope is not None else None] \
            * len(self.decoder)
        mask = source_padding_mask(src_mask)
        for i, block in enumerate(self.decoder):
            x = block(x, cross[i], mask, step)
        return self.norm(x)

    def forward(self, src_ids: torch.Tensor, tgt_ids: torch.Tensor, *, src_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Teacher forcing: logits (B, T, vocab) for every target position at once."""
        memory = self.encode(src_ids, src_mask)
        return self.lm_head(self.decode(tgt_ids, self.cross_kv(memory), src_mask))

    def loss(self, src_ids: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor,
             src_mask: torch.Tensor | None = None, ignore_index: int = -100) -> torch.Tensor:
        """Mean cross-entropy of the next target token over positions with tgt_out != ignore_index.
        tgt_in = [BOS, y_1 .. y_n], tgt_out = [y_1 .. y_n, EOS] (shifted by one)."""
        logits = self(src_ids, tgt_in, src_mask=src_mask)
        return F.cross_entropy(logits.flatten(0, 1).float(), tgt_out.reshape(-1), ignore_index=ignore_index)

    def new_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """An empty self-attention cache for the decoder's ``n_layer`` layers."""
        p = self.tok_emb.weight
        return KVCache(self.cfg, batch_size, max_len or self.cfg.max_seq_len, p.device, dtype or p.dtype)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
