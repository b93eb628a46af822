"""Decoding an encoder-decoder model: greedy search and beam search.

Both run the encoder once, project each decoder layer's cross-attention K/V once (``cross_kv``),
and hand the decoder to the one decode loop, the engine (:class:`~tinyformer.generation.engine.BatchEngine`),
as a decoder-only model over fixed sources (:class:`SourceDecoder`): its rows start from BOS and feed one
token per step through the decoder's self-attention KV cache,

    logits(y_t) = lm_head(decoder(y_t | self-attention cache, cross K/V of the row's source))   (N, V)

Greedy:  y_t = argmax_v log p(v | y_<t, x), until EOS or ``max_new_tokens``.

The engine's rows take their tokens from the search of :mod:`tinyformer.generation.beam` (the one shared
with decoder-only models: HF ``generate(num_beams=...)``'s rules, names and defaults); greedy is its
``num_beams=1`` case, which takes each row's argmax through the sampler
(:func:`tinyformer.generation.sampling.sample`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tinyformer.errors import GenerationError
from tinyformer.generation.beam import (
    DEFAULT_EARLY_STOPPING,
    DEFAULT_LENGTH_PENALTY,
    DEFAULT_NUM_RETURN_SEQUENCES,
    BeamHypothesis,
    EarlyStopping,
    new_search,
    validate_beam_args,
)
from tinyformer.generation.engine import BatchEngine, EngineRow
from tinyformer.generation.sampling import SamplingParams
from tinyformer.generation.streaming import TextState


class SourceDecoder(nn.Module):
    """The decoder of an encoder-decoder over N fixed source rows, called as a decoder-only model is:
    ``self(ids (N, T), cache=...)`` -> logits (N, T, V), row n attending to the cross-attention K/V of
    source row n (``cross``: each layer's (k, v), (N, H, S, d_head)) under its padding mask ``src_mask``
    (N, S). The engine that steps it holds exactly these N rows and feeds them all together, and the same
number of tokens to each (so it never asks for ``hidden_states``)."""

    def __init__(self, model: nn.Module, cross: list[tuple[Tensor, Tensor]], src_mask: Tensor | None) -> None:
        super().__init__()
        self.model, self.cfg, self.cross, self.src_mask = model, model.cfg, cross, src_mask

    def new_cache(self, batch_size: int, max_len: int | None = None, spare_slots: int = 0):
        return self.model.new_cache(batch_size, max_len)

    def forward(self, input_ids: Tensor, *, cache, last_only: bool = False) -> Tensor:
        h = self.model.decode(input_ids, self.cross, self.src_mask, cache)  # (N, T, d)
        return self.model.lm_head(h[:, -1:] if last_only else h)


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
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if max_new_tokens > model.cfg.max_seq_len:
        raise GenerationError(f"max_new_tokens={max_new_tokens} exceeds the decoder's context "
                              f"(max_seq_len={model.cfg.max_seq_len})")
    validate_beam_args(num_beams, length_penalty, early_stopping, num_return_sequences)
    B, K = src_ids.shape[0], num_beams
    search = new_search(B, K, max_new_tokens, [eos_id], length_penalty, early_stopping)
    # rows b*K .. b*K + K - 1 are source b's beams: they share its cross K/V and its mask, which a beam
    # search's moves (always within a source's rows) leave in place
    memory = model.encode(src_ids, src_mask)
    cross = [(k.repeat_interleave(K, 0), v.repeat_interleave(K, 0)) for k, v in model.cross_kv(memory)]
    mask = src_mask.repeat_interleave(K, 0) if src_mask is not None else None
    engine = BatchEngine(SourceDecoder(model, cross, mask), max_batch=B * K, max_len=max_new_tokens)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    for _ in range(B * K):
        engine.add(EngineRow([bos_id], params, TextState(lambda token: b""), search=search))
    for _ in engine.run():
        pass
    return search.results(num_return_sequences)
