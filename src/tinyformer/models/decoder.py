"""The decoder-only language model (GPT / LLaMA family), one readable file.

    h_0 = E[x] (* sqrt(d) if embed_scale) (+ P[pos] for learned/sinusoidal positions)
    h_l = Block_l(h_{l-1})                       l = 1 .. n_layer   (see components/block.py)
    logits = W_head Norm(h_L)                    W_head = E when the embeddings are tied
    (logits = c tanh(logits / c) with final_logit_softcap c)

Shapes: input_ids (B, T) -> logits (B, T, vocab_size). With RoPE, positions enter inside
attention (rotating q and k) instead of being added to h_0.

Every variant is chosen once, at construction: the norm and its placement (components/norm.py, block.py),
the position encoding (``pos_emb``: a table or ``NoPositions``; the rotary tables), the attention variant
and kernel, dense or MoE FFN, the embedding scale and the head's soft-cap (``nn.Identity`` when off). A
forward then reads like the formula above. Each call asks its cache (``KVCache``, or ``NoCache`` without one)
to ``begin`` it: the answer (a ``Step``, components/kv_cache.py) holds the tokens' positions and, per layer,
what attention attends. Incremental decoding passes a ``KVCache``; rows at positions of their own
(continuous batching) pass ``cache.at(positions)``; batches of different lengths pass a padding
``attention_mask`` (1 = token, 0 = padding; left padding for generation).

The model is single-device and knows nothing of training, sampling or file formats; those wrap it from outside.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tinyformer.components import quant_kernels
from tinyformer.components.block import Block
from tinyformer.components.initialization import init_weights
from tinyformer.components.kv_cache import KVCache, NoCache, RowCalls
from tinyformer.components.loss import drop_ignored, linear_cross_entropy
from tinyformer.components.norm import build_norm
from tinyformer.components.positions import build_positions
from tinyformer.components.rope import RotaryEmbedding
from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError


class Scale(nn.Module):
    """x -> c x (the embedding scale sqrt(d) of Gemma and the 2017 Transformer)."""

    def __init__(self, c: float) -> None:
        super().__init__()
        self.c = c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.c


class SoftCap(nn.Module):
    """logits -> c tanh(logits / c) (Gemma 2's final_logit_softcap): every logit inside (-c, c)."""

    def __init__(self, c: float) -> None:
        super().__init__()
        self.c = c

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.tanh(logits / self.c) * self.c


class DecoderLM(nn.Module):
    """Causal language model. ``forward`` returns logits; ``loss`` the next-token cross-entropy."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.arch != "decoder":
            raise ConfigError(f"DecoderLM needs arch='decoder', got {cfg.arch!r}")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_scale = Scale(math.sqrt(cfg.d_model)) if cfg.embed_scale else nn.Identity()
        self.pos_emb = build_positions(cfg)
        self.rope = RotaryEmbedding(cfg) if cfg.pos == "rope" else None
        # the sliding-window layers' own RoPE base (Gemma 3), unscaled
        self.local_rope = (RotaryEmbedding(cfg.replace(rope_theta=cfg.rope_local_theta, rope_scaling=None))
                           if cfg.pos == "rope" and cfg.rope_local_theta is not None else None)
        # each layer's rotary tables, as an index into [tables of each rope] + [None]: the sliding-window layers
        # take the last rope (local_rope when there is one); without RoPE every index finds None
        self.ropes = tuple(r for r in (self.rope, self.local_rope) if r is not None)
        self.rope_of_layer = tuple(len(self.ropes) - 1 if cfg.layer_window(i) is not None else 0
                                   for i in range(cfg.n_layer))
        self.emb_drop = nn.Dropout(cfg.embd_dropout) if cfg.embd_dropout > 0 else nn.Identity()
        self.blocks = nn.ModuleList(Block(cfg, causal=True, layer=i) for i in range(cfg.n_layer))
        self.norm = build_norm(cfg) if cfg.final_norm else nn.Identity()
        self.last_moe_losses: dict[str, torch.Tensor] = {}
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.logit_cap = SoftCap(cfg.final_logit_softcap) if cfg.final_logit_softcap is not None else nn.Identity()
        self.uncached = NoCache(cfg)
        # each block adds two residual branches (attention, feed-forward): output projections get std / sqrt(2 L)
        init_weights(self, cfg.init_std, 2 * cfg.n_layer)

    # ------------------------------------------------------------------ forward
    def hidden_states(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None,
                      cache: KVCache | RowCalls | None = None) -> torch.Tensor:
        """input_ids (B, T) -> final hidden states Norm(h_L) (B, T, d).

        ``cache``: a ``KVCache`` (the T tokens continue what it holds, at positions length ..), or
        ``cache.at(positions)`` (row b's tokens at positions[b] ..: continuous batching, see KVCache.at)."""
        step = (self.uncached if cache is None else cache).begin(input_ids, attention_mask, position_ids)
        tables = [rope.tables(step.positions, step.seen) for rope in self.ropes] + [None]
        step.rope = [tables[i] for i in self.rope_of_layer]
        x = self.emb_drop(self.pos_emb.add_to(self.embed_scale(self.tok_emb(input_ids)), step.positions))
        for block in self.blocks:
            x = block(x, step)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: KVCache | RowCalls | None = None,
                last_only: bool = False) -> torch.Tensor:
        """Logits (B, T, vocab), or (B, 1, vocab) with ``last_only`` (prefill needs only the last row:
        the head is the largest matmul of a small model, so skipping T-1 rows of it matters)."""
        h = self.hidden_states(input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache)
        return self.logits(h[:, -1:] if last_only else h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states (..., d) -> logits (..., vocab): W_head h, soft-capped c tanh(. / c) when the model
        has a final_logit_softcap c (Gemma 2)."""
        return self.logit_cap(self.lm_head(h))

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
            logits = self.logits(h)
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
                  rolling: bool = True, spare_slots: int = 0) -> KVCache:
        """A KV cache for ``max_len`` positions; sliding-window layers get rings of W + ``spare_slots`` slots
        (which can roll back ``spare_slots`` + 1 tokens) unless ``rolling`` is False (then every layer keeps
        every position and the window is a mask only)."""
        p = next(self.parameters())  # not tok_emb.weight: a quantized model's token table has none
        return KVCache(self.cfg, batch_size, max_len or self.cfg.max_seq_len, p.device, dtype or p.dtype,
                       rolling=rolling, spare_slots=spare_slots, row_kernel=quant_kernels.uses_kernels(self))

    def num_params(self) -> int:
        """Parameter count (shared tensors once)."""
        return sum(p.numel() for p in self.parameters())
