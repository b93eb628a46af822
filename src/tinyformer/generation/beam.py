"""Beam search: the most probable continuations under a model that decodes one token per step.

One search for every model type, stepped by the one decode loop, the engine
(:class:`~tinyformer.generation.engine.BatchEngine`): a search is the engine's way of picking tokens for
its rows instead of sampling them. Each step it takes the next-token logits of its B*K rows and returns

    tokens (B*K,), index (B*K,)       row i next feeds tokens[i], after taking over the cache row index[i]

(greedy search, ``num_beams=1``, never moves a row). A decoder-only model's rows are its prompt's
(:meth:`Generator.beam_search <tinyformer.generation.generator.Generator.beam_search>`); an
encoder-decoder's are its decoder's, against the encoder's memory (:func:`tinyformer.generation.seq2seq.beam_search`).

Names, defaults and results are Hugging Face ``generate(num_beams=K, do_sample=False)``'s
(transformers' vectorised beam search), so that the same arguments give the same hypotheses:

    score(y) = sum_i log p(y_i | x, y_<i) / |y| ** length_penalty

where |y| counts the generated tokens, the end token included. ``length_penalty`` 1.0 (the default)
ranks by mean log-probability per token; 0 by total log-probability; > 0 favours longer sequences.

Each step, with K = ``num_beams`` and E end tokens, and for each source row:

1. every open hypothesis (total log-prob s) is extended by every token v: candidates s + log p(v);
   the best max(2, 1 + E) * K of them are kept, best first;
2. a candidate ending in an end token, or any candidate once ``max_new_tokens`` are generated,
   finishes, but only if it ranks among the first K candidates (HF's rule: the others are only
   there to refill the open beams); the K best finished hypotheses by score are kept;
3. the K best candidates that did not finish are the open hypotheses of the next step.

The search of a row stops (it takes no more finished hypotheses) when K hypotheses have finished and

* ``early_stopping=True``: at once;
* ``early_stopping=False`` (default): the best open hypothesis, scored at its current length, does
  not beat the worst finished one (HF's heuristic: with ``length_penalty`` > 0 a longer continuation
  could still win, so this can stop too soon);
* ``early_stopping="never"``: the best open hypothesis cannot beat the worst finished one at any length:
  log-probabilities only fall, so with ``length_penalty`` > 0 its best case is s / max_new_tokens **
  length_penalty, else its current score. This bound is exact: with K at least every open prefix the
  search then returns the best sequences (with ``length_penalty`` <= 0 the default is exact too).

and at ``max_new_tokens`` in any case. ``num_beams=1`` is greedy decoding, as in HF (whose
``generate`` decodes one beam greedily): each row takes its argmax through the one sampler
(:func:`tinyformer.generation.sampling.sample`'s greedy case) and stops when it emits an end token,
whatever ``early_stopping`` says; the argmax is the top candidate, so the rules above give the same.
The result of a row is its finished hypotheses, best score first, ``num_return_sequences`` of them.

One difference from HF, on degenerate inputs only: both start with K copies of the prompt, all but
one scored -1e9 in HF, which takes candidates from those copies when the first beam has fewer than
max(2, 1 + E) * K tokens to offer (a vocabulary smaller than 2K); here they score -inf and are
never taken, so no hypothesis is ever a copy of another.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from tinyformer.errors import GenerationError
from tinyformer.generation.sampling import GREEDY, sample

__all__ = ["DEFAULT_EARLY_STOPPING", "DEFAULT_LENGTH_PENALTY", "DEFAULT_NUM_RETURN_SEQUENCES", "BeamHypothesis",
           "BeamSearch", "EarlyStopping", "GreedySearch", "new_search", "validate_beam_args"]

EarlyStopping = bool | Literal["never"]

# HF generate's defaults (GenerationConfig): every beam search entry point takes these.
DEFAULT_LENGTH_PENALTY = 1.0
DEFAULT_EARLY_STOPPING: EarlyStopping = False
DEFAULT_NUM_RETURN_SEQUENCES = 1

_NEG_INF = float("-inf")


@dataclass
class BeamHypothesis:
    """One finished hypothesis.

    ``token_ids``: the generated ids, with the end token when it ended on one; ``token_logprobs[i]`` =
    log p(token_ids[i] | x, token_ids[:i]); ``logprob`` = their sum; ``score`` = logprob /
    len(token_ids) ** length_penalty (the ranking); ``finish_reason`` "stop" (an end token) or
    "length" (``max_new_tokens``).
    """

    token_ids: list[int]
    token_logprobs: list[float]
    logprob: float
    score: float
    finish_reason: str

    @property
    def output_ids(self) -> list[int]:
        """``token_ids`` without the end token."""
        return self.token_ids[:-1] if self.finish_reason == "stop" else self.token_ids


def validate_beam_args(num_beams: object, length_penalty: object, early_stopping: object,
                       num_return_sequences: object) -> None:
    """Raise :class:`GenerationError` naming the first invalid beam search argument."""
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise GenerationError(f"num_beams must be an integer >= 1, got {num_beams!r}")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) \
            or not math.isfinite(length_penalty):
        raise GenerationError(f"length_penalty must be a finite number, got {length_penalty!r}")
    if early_stopping not in (True, False, "never") or not isinstance(early_stopping, (bool, str)):
        raise GenerationError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    if isinstance(num_return_sequences, bool) or not isinstance(num_return_sequences, int) \
            or not 1 <= num_return_sequences <= num_beams:
        raise GenerationError(f"num_return_sequences must be an integer in [1, num_beams={num_beams}], "
                              f"got {num_return_sequences!r}")


def new_search(sources: int, num_beams: int, max_new_tokens: int, eos_token_ids: Sequence[int] = (),
               length_penalty: float = DEFAULT_LENGTH_PENALTY,
               early_stopping: EarlyStopping = DEFAULT_EARLY_STOPPING) -> GreedySearch | BeamSearch:
    """The search of ``sources`` source rows (the module docstring gives the rules), for the engine to step
    (:class:`~tinyformer.generation.engine.EngineRow`'s ``search``): its B*K rows, row b*K + j beam j of
    source b, all start from their source's prompt. Each step ``advance(logits (B*K, V))`` returns the rows'
    next tokens (B*K,) and the row each extends (B*K,) (None: every row extends itself), or None when the
    search is over (at ``max_new_tokens``, at least 1, or once every source has its hypotheses); then
    ``results(n)`` gives each source's best ``n`` (``num_return_sequences``) hypotheses, best score first.
    ``num_beams=1`` is greedy search. Log-probabilities are computed in float32 (float64 for float64 logits)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    ends = sorted({int(t) for t in eos_token_ids})
    if num_beams == 1:  # greedy, as HF generate decodes num_beams=1
        return GreedySearch(max_new_tokens, ends, length_penalty)
    return BeamSearch(sources, num_beams, max_new_tokens, ends, length_penalty, early_stopping)


class GreedySearch:
    """Greedy search: every row takes its argmax (``sample`` with the greedy sampler) until it emits an
    end token; the search stops when every row has, or at ``max_new_tokens``. Log-probabilities and
    scores are computed as the beam search computes them (log-softmax in float32 or float64, summed step
    by step), so that a search of one beam gives what a beam search of one beam would."""

    def __init__(self, max_new_tokens: int, ends: list[int], length_penalty: float) -> None:
        self.T, self.ends, self.length_penalty = max_new_tokens, ends, length_penalty
        self.tokens: list[Tensor] = []  # (B,) per step
        self.logprobs: list[Tensor] = []
        self.done: Tensor | None = None  # (B,) bool: the rows that have emitted an end token

    def advance(self, logits: Tensor) -> tuple[Tensor, None] | None:
        token = sample(logits, GREEDY, want_logprobs=False)[0]
        self.tokens.append(token)
        dtype = torch.promote_types(logits.dtype, torch.float32)
        self.logprobs.append(torch.log_softmax(logits.to(dtype), dim=-1).gather(1, token[:, None])[:, 0])
        if self.done is None:
            self.done = torch.zeros_like(token, dtype=torch.bool)
        if self.ends:
            self.done |= torch.isin(token, token.new_tensor(self.ends))
        if len(self.tokens) == self.T or bool(self.done.all()):
            return None
        return token, None

    def results(self, num_return_sequences: int = 1) -> list[list[BeamHypothesis]]:
        ends = set(self.ends)
        lps = torch.stack(self.logprobs, dim=1)  # (B, steps)
        ids = torch.stack(self.tokens, dim=1).tolist()
        lengths = [next((i + 1 for i, y in enumerate(row) if y in ends), len(row)) for row in ids]  # to its end
        # the running total, added step by step as the beam search adds it, at each row's last token
        totals = lps.cumsum(dim=1).gather(1, torch.tensor(lengths, device=lps.device)[:, None] - 1)[:, 0]
        divisors = torch.tensor([n**self.length_penalty for n in lengths], dtype=torch.float64, device=lps.device)
        scores = totals / divisors.to(totals.dtype)
        return [[BeamHypothesis(row[:n], lp[:n], total, score, "stop" if row[n - 1] in ends else "length")]
                for row, lp, n, total, score in zip(ids, lps.tolist(), lengths, totals.tolist(), scores.tolist())]


class BeamSearch:
    """The beam search of the module docstring, one step per :meth:`advance` for B sources of K rows each.
    Before the first step the K rows of a source hold the same prompt; beam 0 stands for it and the others
    score -inf (they are never extended)."""

    def __init__(self, sources: int, num_beams: int, max_new_tokens: int, ends: list[int], length_penalty: float,
                 early_stopping: EarlyStopping) -> None:
        self.B, self.K, self.T, self.ends = sources, num_beams, max_new_tokens, ends
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.width = max(2, 1 + len(ends)) * num_beams  # candidates kept per step, as in HF
        self.n = 0  # tokens per hypothesis so far

    def _start(self, logits: Tensor) -> None:
        """The empty hypotheses, in the dtype and on the device of the first logits."""
        B, K, T, device = self.B, self.K, self.T, logits.device
        self.dtype = dtype = torch.promote_types(logits.dtype, torch.float32)
        self.end_ids = torch.tensor(self.ends, dtype=torch.long, device=device)
        self.rows = torch.arange(B, device=device)[:, None]
        # open hypotheses, K per source: total log-prob, tokens and their log-probs
        self.scores = torch.full((B, K), _NEG_INF, dtype=dtype, device=device)
        self.scores[:, 0] = 0.0
        self.seqs = torch.zeros(B, K, 0, dtype=torch.long, device=device)
        self.seq_lps = torch.zeros(B, K, 0, dtype=dtype, device=device)
        # finished hypotheses: K slots per source, best first; score -inf marks an empty slot
        self.fin_scores = torch.full((B, K), _NEG_INF, dtype=dtype, device=device)
        self.fin_totals = torch.full((B, K), _NEG_INF, dtype=dtype, device=device)
        self.fin_seqs = torch.zeros(B, K, T, dtype=torch.long, device=device)
        self.fin_lps = torch.zeros(B, K, T, dtype=dtype, device=device)
        self.fin_lens = torch.zeros(B, K, dtype=torch.long, device=device)
        self.fin_ended = torch.zeros(B, K, dtype=torch.bool, device=device)
        self.improvable = torch.ones(B, dtype=torch.bool, device=device)  # may a row still take finished ones

    def advance(self, logits: Tensor) -> tuple[Tensor, Tensor] | None:
        """Rank the candidates of the next step: the next tokens of the open beams and the rows they extend
        (indices into the rows ``logits`` came from), or None when the search is over."""
        if self.n == 0:
            self._start(logits)
        B, K, T, V, rows = self.B, self.K, self.T, logits.shape[-1], self.rows
        length_penalty, early_stopping = self.length_penalty, self.early_stopping
        self.n = n = self.n + 1  # the candidates' length
        logp = torch.log_softmax(logits.to(self.dtype), dim=-1).view(B, K, V)
        cand = (self.scores[:, :, None] + logp).view(B, K * V)
        C = min(self.width, K * V)  # >= K: the width is at least 2K
        top_scores, top_index = cand.topk(C, dim=-1)  # (B, C), best first
        beam, token = top_index // V, top_index % V
        token_lp = logp[rows, beam, token]
        valid = top_scores > _NEG_INF
        ended = torch.isin(token, self.end_ids) if self.ends else torch.zeros_like(valid)
        finishes = ended | (n == T)  # at the length limit every candidate finishes

        # 2. the finished candidates among the first K join the finished slots (if the row takes them)
        full = (self.fin_scores > _NEG_INF).all(dim=-1)
        takes = self.improvable & ~(full & (early_stopping is True))
        ranked = torch.arange(C, device=logits.device)[None, :] < K
        new_fin = finishes & valid & ranked & takes[:, None]
        new_scores = torch.where(new_fin, top_scores / (n**length_penalty), _NEG_INF)
        cand_seqs = torch.cat([self.seqs[rows, beam], token[..., None]], dim=-1)  # (B, C, n)
        cand_lps = torch.cat([self.seq_lps[rows, beam], token_lp[..., None]], dim=-1)
        pad = T - n
        merged_scores = torch.cat([self.fin_scores, new_scores], dim=1)
        keep = merged_scores.topk(K, dim=-1).indices  # (B, K)
        self.fin_scores = merged_scores.gather(1, keep)
        self.fin_totals = torch.cat([self.fin_totals, top_scores], dim=1).gather(1, keep)
        self.fin_seqs = _gather(torch.cat([self.fin_seqs, torch.nn.functional.pad(cand_seqs, (0, pad))], dim=1), keep)
        self.fin_lps = _gather(torch.cat([self.fin_lps, torch.nn.functional.pad(cand_lps, (0, pad))], dim=1), keep)
        self.fin_lens = torch.cat([self.fin_lens, torch.full_like(token, n)], dim=1).gather(1, keep)
        self.fin_ended = torch.cat([self.fin_ended, ended], dim=1).gather(1, keep)
        if n == T:
            return None

        # 3. the best K candidates that did not finish stay open
        open_scores = top_scores.masked_fill(finishes, _NEG_INF)
        scores, chosen = open_scores.topk(K, dim=-1)  # best first
        beam, token = beam.gather(1, chosen), token.gather(1, chosen)
        self.scores = scores
        self.seqs, self.seq_lps = _gather(cand_seqs, chosen), _gather(cand_lps, chosen)

        # can a row still improve its finished set? (HF's _check_early_stop_heuristic)
        full = (self.fin_scores > _NEG_INF).all(dim=-1)
        horizon = T if early_stopping == "never" and length_penalty > 0 else n  # the length its best is scored at
        best_possible = scores[:, 0] / (horizon**length_penalty)
        worst = self.fin_scores[:, -1]
        self.improvable &= ~full | (best_possible > worst)
        self.improvable &= scores[:, 0] > _NEG_INF  # no open hypothesis left
        if not bool((self.improvable & ~(full & (early_stopping is True))).any()):
            return None
        return token.view(-1), (rows * K + beam).view(-1)

    def results(self, num_return_sequences: int = 1) -> list[list[BeamHypothesis]]:
        out: list[list[BeamHypothesis]] = []
        for b in range(self.B):
            hyps = []
            for j in range(min(self.K, num_return_sequences)):
                if self.fin_scores[b, j] == _NEG_INF:
                    break
                n = int(self.fin_lens[b, j])
                hyps.append(BeamHypothesis(self.fin_seqs[b, j, :n].tolist(), self.fin_lps[b, j, :n].tolist(),
                                           float(self.fin_totals[b, j]), float(self.fin_scores[b, j]),
                                           "stop" if bool(self.fin_ended[b, j]) else "length"))
            out.append(hyps)
        return out


def _gather(x: Tensor, index: Tensor) -> Tensor:
    """``x[b, index[b, j], ...]`` for x (B, M, ...) and index (B, J): (B, J, ...)."""
    return x[torch.arange(x.shape[0], device=x.device)[:, None], index]
