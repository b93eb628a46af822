"""The decoder-only language model (GPT / LLaMA family), one readable file.

    h_0 = E[x] (* sqrt(d) if embed_scale) (+ P[pos] for learned/sinusoidal positions)
    h_l = Block_l(h_{l-1})                       l = 1 .. n_layer   (see components/block.py)
    logits = W_head Norm(h_L)                    W_head = E when the embeddings are tied
    (logits = c tanh(logits / c) with final_logit_softcap c)

Shapes: input_ids (B, T) -> logits (B, T, vocab_size). With RoPE, positions enter inside
attention (rotating q and k) instead of being added to h_0.

The model is single-device and knows nothing of training, sampling or file formats; those wrap
it from outside. Incremental decoding passes a ``KVCache``; batches of different lengths pass a
padding ``attention_mask`` (1 = token, 0 = padding; left padding for generation).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tinyformer.components.block import Block
from tinyformer.components.initialization import init_weights
from tinyformer.components.kv_cache import KVCache
from tinyformer.components.loss import drop_ignored, linear_cross_entropy
from tinyformer.components.norm import build_norm
from tinyformer.components.positions import LearnedPositions, SinusoidalPositions
from tinyformer.components.rope import RotaryEmbedding
from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError, GenerationError


def build_attention_mask(attention_mask: torch.Tensor, T: int, start: int, causal: bool = True,
                         window: int | None = None) -> torch.Tensor:
    """Boolean (B, 1, T, S) mask, True = may attend, for T queries at positions start .. start+T-1
    over S = start + T keys. ``attention_mask`` (B, S) marks real tokens with 1 and padding with 0.
    With a ``window`` W query i also needs i - W < j (sliding-window attention).

    A padding query would otherwise see no key at all; it is let see itself, which keeps every
    softmax row finite in every kernel (its output is never used).
    """
    S = start + T
    key_ok = attention_mask[:, None, None, :S].bool()  # (B, 1, 1, S)
    q_pos = torch.arange(start, S, device=attention_mask.device)[:, None]  # (T, 1)
    k_pos = torch.arange(S, device=attention_mask.device)[None, :]  # (1, S)
    allowed = key_ok & (k_pos <= q_pos) if causal else key_ok.expand(-1, -1, T, -1)
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    return allowed | (k_pos == q_pos)


def window_mask(T: int, start: int, window: int, device: torch.device) -> torch.Tensor:
    """(1, 1, T, start + T) causal sliding-window mask without padding: key j visible to query i (at
    position start + i) iff start + i - W < j <= start + i."""
    q_pos = torch.arange(start, start + T, device=device)[:, None]
    k_pos = torch.arange(start + T, device=device)[None, :]
    return ((k_pos <= q_pos) & (k_pos > q_pos - window))[None, None]


def ring_mask(attention_mask: torch.Tensor | None, T: int, start: int, window: int,
              device: torch.device) -> torch.Tensor:
    """(B|1, 1, T, K) mask over the keys a rolling-cache layer attends (``SelfAttention._write_ring``).

    Slot s of the W-slot ring holds the latest position c = p - ((p - s) mod W) with c = s (mod W) up to
    p = start (one new token, written before attending: K = W) or p = start - 1 (a block of T > 1, attending
    the old slots and then its own T keys: K = W + T). A slot with c < 0 was never written. Query i sees key
    column c iff 0 <= c, i - W < c <= i and attention_mask[c] (columns count from the cache's start)."""
    slots = torch.arange(window, device=device)
    last = start if T == 1 else start - 1
    cols = last - torch.remainder(last - slots, window)
    if T > 1:
        cols = torch.cat([cols, torch.arange(start, start + T, device=device)])
    q_pos = torch.arange(start, start + T, device=device)[:, None]
    allowed = (cols >= 0) & (cols <= q_pos) & (cols > q_pos - window)  # (T, K)
    if attention_mask is None:
        return allowed[None, None]
    key_ok = attention_mask[:, cols.clamp_min(0)].bool()[:, None, None, :]  # (B, 1, 1, K)
    return (allowed & key_ok) | (cols == q_pos)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token counted over real tokens only: cumsum(mask) - 1, padding at 0.
    With left padding this gives every row positions 0, 1, 2, ... from its first real token."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp_min(0)


class DecoderLM(nn.Module):
    """Causal language model. ``forward`` returns logits; ``loss`` the next-token cross-entropy."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.arch != "decoder":
            raise ConfigError(f"DecoderLM needs arch='decoder', got {cfg.arch!r}")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rope = RotaryEmbedding(cfg) if cfg.pos == "rope" else None
        # the sliding-window layers' own RoPE base (Gemma 3), unscaled
        self.local_rope = (RotaryEmbedding(cfg.replace(rope_theta=cfg.rope_local_theta, rope_scaling=None))
                           if cfg.pos == "rope" and cfg.rope_local_theta is not None else None)
        self.pos_emb: nn.Module | None = None
        if cfg.pos == "learned":
            self.pos_emb = LearnedPositions(cfg.max_seq_len, cfg.d_model)
        elif cfg.pos == "sinusoidal":
            self.pos_emb = SinusoidalPositions(cfg.max_seq_len, cfg.d_model)
        self.emb_scale = math.sqrt(cfg.d_model) if cfg.embed_scale else 1.0
        self.emb_drop = nn.Dropout(cfg.embd_dropout) if cfg.embd_dropout > 0 else nn.Identity()
        self.blocks = nn.ModuleList(Block(cfg, causal=True) for _ in range(cfg.n_layer))
        self.norm = build_norm(cfg) if cfg.final_norm else nn.Identity()
        self.last_moe_losses: dict[str, torch.Tensor] = {}
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    # ------------------------------------------------------------------ initialisation
    def reset_parameters(self) -> None:
        """N(0, init_std) for matrices and embeddings; each block adds two residual branches (attention,
        feed-forward), so their output projections get init_std / sqrt(2 n_layer): see ``init_weights``."""
        init_weights(self, self.cfg.init_std, 2 * self.cfg.n_layer)

    # ------------------------------------------------------------------ forward
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        cache_positions: torch.Tensor | None = None,
        kv_len: int | None = None,
    ) -> torch.Tensor:
        """input_ids (B, T) -> final hidden states (B, T, d), after the final norm.

        ``cache_positions`` (B,) decodes one token per row at a different position per row
        (continuous batching): row b's token sits at cache_positions[b], sees cache positions
        0 .. cache_positions[b], and RoPE/learned positions use that index too. The rows attend over
        cache slots [0, kv_len), each masked beyond its own position; by default kv_len is the furthest
        position + 1 (read back to the host). A ``kv_len`` from the caller (``cache.max_len``, or the
        generator's span length, a symbolic size under ``torch.compile``) needs no host read-back, so the
        step can be captured by ``torch.compile``; the caller then guarantees that the positions fit.
        """
        B, T = input_ids.shape
        if cache_positions is not None:
            return self._decode_rows(input_ids, cache, cache_positions, kv_len)
        start = cache.length if cache is not None else 0
        if cache is not None and start + T > cache.max_len:
            raise GenerationError(
                f"the KV cache holds {cache.max_len} positions; {start} are used and {T} more were given"
            )
        if position_ids is None and attention_mask is not None:
            position_ids = positions_from_mask(attention_mask)[:, start : start + T]
        if position_ids is None:
            max_pos = start + T - 1
        else:
            max_pos = int(position_ids.max()) if position_ids.numel() else 0
        if max_pos >= self.cfg.max_seq_len and not (self.cfg.rope_type == "dynamic"):
            raise GenerationError(
                f"position {max_pos} is beyond the model's context (max_seq_len={self.cfg.max_seq_len})"
            )

        x = self.tok_emb(input_ids)
        if self.emb_scale != 1.0:
            x = x * self.emb_scale
        if self.pos_emb is not None:
            positions = position_ids if position_ids is not None else torch.arange(start, start + T,
                                                                                 device=input_ids.device)
            x = x + self.pos_emb(positions)
        x = self.emb_drop(x)
        rope = self.rope(start, T, position_ids) if self.rope is not None else None
        local_rope = self.local_rope(start, T, position_ids) if self.local_rope is not None else rope

        masks: dict[tuple[int | None, bool], torch.Tensor | None] = {}  # one per (window, rolling) kind of layer
        for i, block in enumerate(self.blocks):
            window = self.cfg.layer_window(i)
            rolling = cache is not None and cache.rolling[i]
            if (window, rolling) not in masks:
                masks[window, rolling] = self._mask(attention_mask, T, start, window, rolling, input_ids.device)
            layer_cache = cache.layers[i] if cache is not None else None
            x = block(x, rope if window is None else local_rope, masks[window, rolling], layer_cache, start, 0,
                      rolling)
        if cache is not None:
            cache.length = start + T
        return self.norm(x)

    @staticmethod
    def _mask(attention_mask: torch.Tensor | None, T: int, start: int, window: int | None, rolling: bool,
              device: torch.device) -> torch.Tensor | None:
        """The boolean mask of one kind of layer (None: plain causal, left to the attention kernel)."""
        if rolling:
            assert window is not None
            return ring_mask(attention_mask, T, start, window, device)
        if attention_mask is not None:
            return build_attention_mask(attention_mask, T, start, window=window)
        if window is not None and start + T > window:  # some query has keys beyond its window
            return window_mask(T, start, window, device)
        return None

    def _decode_rows(self, input_ids: torch.Tensor, cache: KVCache | None, pos: torch.Tensor,
                     kv_len: int | None = None) -> torch.Tensor:
        if cache is None or input_ids.shape[1] != 1:
            raise ValueError("cache_positions needs a KV cache and exactly one token per row")
        if kv_len is None:
            kv_len = int(pos.max()) + 1
            if kv_len > cache.max_len:
                raise GenerationError(f"the KV cache holds {cache.max_len} positions; position {kv_len - 1} was asked")
            if kv_len > self.cfg.max_seq_len and self.cfg.rope_type != "dynamic":
                raise GenerationError(
                    f"position {kv_len - 1} is beyond the model's context (max_seq_len={self.cfg.max_seq_len})"
                )
        position_ids = pos[:, None]  # (B, 1)
        x = self.tok_emb(input_ids)
        if self.emb_scale != 1.0:
            x = x * self.emb_scale
        if self.pos_emb is not None:
            x = x + self.pos_emb(position_ids)
        rope = self.rope(0, 1, position_ids) if self.rope is not None else None
        local_rope = self.local_rope(0, 1, position_ids) if self.local_rope is not None else rope
        keys = torch.arange(kv_len, device=input_ids.device)
        mask = (keys[None, :] <= pos[:, None])[:, None, None, :]  # (B, 1, 1, kv_len)
        for i, block in enumerate(self.blocks):
            window, rolling = self.cfg.layer_window(i), cache.rolling[i]
            layer_mask, layer_len = mask, kv_len
            if rolling:  # slot s holds a position within the window once written: s <= pos, or every slot
                assert window is not None
                layer_len = window
                layer_mask = (torch.arange(window, device=pos.device)[None, :] <= pos[:, None])[:, None, None, :]
            elif window is not None:
                layer_mask = mask & (keys[None, :] > pos[:, None] - window)[:, None, None, :]
            x = block(x, rope if window is None else local_rope, layer_mask, cache.layers[i], pos, layer_len,
                      rolling)
        return self.norm(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        cache_positions: torch.Tensor | None = None,
        kv_len: int | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits (B, T, vocab), or (B, 1, vocab) with ``last_only`` (prefill needs only the last row:
        the head is the largest matmul of a small model, so skipping T-1 rows of it matters)."""
        h = self.hidden_states(input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                               cache_positions=cache_positions, kv_len=kv_len)
        if last_only:
            h = h[:, -1:]
        return self._softcap(self.lm_head(h))

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """logits -> c tanh(logits / c) with c = final_logit_softcap (Gemma 2), else unchanged."""
        c = self.cfg.final_logit_softcap
        return logits if c is None else torch.tanh(logits / c) * c

    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
             attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy: -1/N sum_t log softmax(logits_t)[targets_t] over targets != ignore_index.

        The head and the cross-entropy are fused (components/loss.py): same value, but the (B, T, vocab)
        logit matrix is never stored, which is most of a small model's activation memory; positions whose
        target is ignore_index (masked prompts in SFT) skip the head altogether."""
        h = self.hidden_states(input_ids, attention_mask=attention_mask)
        if self.cfg.final_logit_softcap is not None:  # the capped logits are needed: no fused head
            # ignored positions add nothing: only the others go through the head
            h, targets, _ = drop_ignored(h.flatten(0, 1), targets.flatten(), ignore_index)
            logits = self._softcap(self.lm_head(h))
            if logits.dtype not in (torch.float32, torch.float64):  # half precision: softmax in float32
                logits = logits.float()
            loss = F.cross_entropy(logits, targets, ignore_index=ignore_index)
        else:
            loss = linear_cross_entropy(h, self.lm_head.weight, targets, ignore_index)
        if self.training and self.cfg.ffn == "moe":
            loss = loss + self.router_loss(attention_mask)
        return loss

    def moe_losses(self, attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The MoE auxiliary losses of the last training forward (components/moe.py), over the router logits
        of every layer pooled, padding rows left out: {"moe_balance": L_bal, "moe_z": L_z}."""
        from tinyformer.components.moe import balance_loss, z_loss

        logits = [b.ffn.router_logits for b in self.blocks if getattr(b.ffn, "router_logits", None) is not None]
        if not logits:
            return {}
        rows = torch.cat(logits)
        if attention_mask is not None:
            rows = rows[attention_mask.reshape(-1).bool().repeat(len(logits))]
        return {"moe_balance": balance_loss(rows, self.cfg.experts_per_token), "moe_z": z_loss(rows)}

    def router_loss(self, attention_mask: torch.Tensor | None = None) -> torch.Tensor | float:
        """router_aux_loss_coef * L_bal + router_z_loss_coef * L_z, added to the training loss of a MoE model;
        the terms are kept (detached) in ``last_moe_losses`` for the training log."""
        terms = self.moe_losses(attention_mask)
        if not terms:
            return 0.0
        self.last_moe_losses = {k: v.detach() for k, v in terms.items()}
        return self.cfg.router_aux_loss_coef * terms["moe_balance"] + self.cfg.router_z_loss_coef * terms["moe_z"]

    def new_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None,
                  rolling: bool = True) -> KVCache:
        """A KV cache for ``max_len`` positions; sliding-window layers get W-slot rings unless ``rolling`` is
        False (then every layer keeps every position and the window is a mask only)."""
        p = next(self.parameters())  # not tok_emb.weight: a quantized model's token table has none
        return KVCache(self.cfg, batch_size, max_len or self.cfg.max_seq_len, p.device, dtype or p.dtype,
                       rolling=rolling)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (shared tensors once); ``non_embedding`` leaves out token and position tables
        (and the head when it is tied to the token table)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_emb.weight.numel()
            if isinstance(self.pos_emb, LearnedPositions):
                n -= self.pos_emb.weight.numel()
        return n
