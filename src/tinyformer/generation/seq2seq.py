"""Decoding an encoder-decoder model: greedy search and beam search.

Both run the encoder once, project each decoder layer's cross-attention K/V once (``cross_kv``),
and feed the decoder one token per step through its self-attention KV cache, starting from BOS:

    step(y_t) = lm_head(decoder(y_t | self-attention cache, cross K/V of the source))   (N, V)

Greedy:  y_t = argmax_v log p(v | y_<t, x), until EOS or ``max_new_tokens``.

Both are :func:`tinyformer.generation.beam.beam_search` over this step (the one search shared with
decoder-only models, run by the one token loop :func:`tinyformer.generation.beam.decode`: HF
``generate(num_beams=...)``'s rules, names and defaults); greedy is its ``num_beams=1`` case, which
takes each row's argmax through the sampler (:func:`tinyformer.generation.sampling.sample`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tinyformer.errors import GenerationError
from tinyformer.generation import beam
from tinyformer.generation.beam import (
    DEFAULT_EARLY_STOPPING,
    DEFAULT_LENGTH_PENALTY,
    DEFAULT_NUM_RETURN_SEQUENCES,
    BeamHypothesis,
    EarlyStopping,
)


def _check(model, max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if max_new_tokens > model.cfg.max_seq_len:
        raise GenerationError(f"max_new_tokens={max_new_tokens} exceeds the decoder's context "
                              f"(max_seq_len={model.cfg.max_seq_len})")


class DecoderState:
    """What the decoder needs per row besides the token: its self-attention cache, the cross-attention
    K/V of the row's source and the source's padding mask.

    ``reorder(index)`` keeps rows ``index``. The beam search only ever reorders rows within a source's
    block (after the first reorder, from B sources to B*K beams), so the cross K/V and the mask, which
    depend on the source alone, are gathered only when the row count changes.
    """

    def __init__(self, model, src_ids: Tensor, src_mask: Tensor | None, max_new_tokens: int) -> None:
        self.model = model
        self.cross = model.cross_kv(model.encode(src_ids, src_mask))
        self.mask = src_mask
        self.cache = model.new_cache(src_ids.shape[0], max_new_tokens)

    def reorder(self, index: Tensor) -> None:
        if index.numel() != self.cache.batch_size:
            self.cross = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.cross]
            self.mask = self.mask.index_select(0, index) if self.mask is not None else None
        self.cache.reorder(index)

    def step(self, tokens: Tensor) -> Tensor:
        """Feed one token per row (N,): next-token logits (N, V)."""
        return self.model.lm_head(self.model.decode(tokens[:, None], self.cross, self.mask, self.cache))[:, -1]


def _step(tokens: Tensor, state: DecoderState) -> Tensor:
    return state.step(tokens)


@torch.no_grad()
def greedy_decode(model, src_ids: Tensor, src_mask: Tensor | None = None, *, bos_id: int,
                  eos_id: int, max_new_tokens: int) -> list[list[int]]:
    """The greedy output of each source row (B lists of token ids, EOS excluded): the search of one beam."""
    hyps = beam_search(model, src_ids, src_mask, bos_id=bos_id, eos_id=eos_id, max_new_tokens=max_new_tokens,
                       num_beams=1)
    return [h[0].output_ids for h in hyps]


@torch.no_grad()
def beam_search(model, src_ids: Tensor, src_mask: Tensor | None = None, *, bos_id: int, eos_id: int,
                max_new_tokens: int, num_beams: int, length_penalty: float = DEFAULT_LENGTH_PENALTY,
                early_stopping: EarlyStopping = DEFAULT_EARLY_STOPPING,
                num_return_sequences: int = DEFAULT_NUM_RETURN_SEQUENCES) -> list[list[BeamHypothesis]]:
    """The best ``num_return_sequences`` hypotheses of each source row, best first (see
    :mod:`tinyformer.generation.beam` for the rules and the score). ``BeamHypothesis.output_ids`` is a
    hypothesis without its EOS."""
    _check(model, max_new_tokens)
    beam.validate_beam_args(num_beams, length_penalty, early_stopping, num_return_sequences)
    state = DecoderState(model, src_ids, src_mask, max_new_tokens)
    bos = torch.full((src_ids.shape[0],), bos_id, dtype=torch.long, device=src_ids.device)
    return beam.beam_search(_step, state.step(bos), state, num_beams=num_beams, max_new_tokens=max_new_tokens,
                            eos_token_ids=[eos_id], length_penalty=length_penalty, early_stopping=early_stopping,
                            num_return_sequences=num_return_sequences)
