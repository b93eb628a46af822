"""Speculative decoding: cheap draft tokens, checked by the model in one forward over K + 1 positions.

A decode step reads every weight once for one token; on a CPU that read is the whole cost of a small
model's step, and a forward over K + 1 positions costs little more than over one. A *proposer* guesses the
next K tokens d_1 .. d_K of a row; the model (the target) scores its pending token y_0 and the drafts in
one row call at positions P .. P + K (``BatchEngine``), which gives the target's next-token logits after
each prefix y_0 d_1 .. d_j, j = 0 .. K; the drafts it agrees with are kept, the others rolled back with
``KVCache.truncate`` (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling")::

    proposers    ngram   prompt lookup: the K tokens that followed the latest earlier occurrence of the last
                         n tokens of prompt + output, n = max_ngram .. min_ngram (the first n that occurs);
                         q is a point mass on each draft (a deterministic proposal)
                 draft   a smaller model with the same tokenizer, with its own KV cache: d_j ~ q_j, q_j its
                         (processed) next-token distribution; argmax for greedy rows
    target       p_j = softmax(processors(logits_j)), the distribution ``sample`` draws from at that
                 position (temperature, top-k / top-p / min-p, penalties over prompt + output + d_1..d_j)
    greedy       keep the longest prefix d_1 .. d_m with d_{j+1} = argmax p_j, then emit argmax p_m:
                 token for token what plain greedy decoding emits, m + 1 tokens for one forward
    sampling     for j = 1 .. K: keep d_j with probability min(1, p_{j-1}(d_j) / q_j(d_j)); at the first
                 rejection emit y ~ norm(max(0, p_{j-1} - q_j)) and stop; if all K are kept emit y ~ p_K.
                 Every emitted token is then distributed exactly as p (the theorem of both papers); with a
                 point mass q_j = delta(d_j) the rule keeps d_j with probability p_{j-1}(d_j) and resamples
                 from p_{j-1} without d_j
    rollback     the target's cache wrote P .. P + T - 1 (T = 1 + drafts, rows padded to the longest); row b
                 keeps P + 1 + m of them (``KVCache.truncate``); a ring of a sliding-window layer needs
                 W + K slots for it (``new_cache(spare_slots=K)``)

Adaptive (``RowDrafts``): a verification of k drafts costs a forward over k + 1 positions, on a loaded CPU up
to 2.5 one-token steps (docs/benchmarks/speculative.md), and yields m + 1 tokens, so rejected drafts must
cost little. Three rules, chosen by replaying them against the greedy outputs of the benchmark's prompts and
then timing the best (docs/benchmarks/speculative.md, "Choosing the adaptive rule"):

    match        prompt lookup drafts only after a match of the last n >= min_ngram (2) tokens: a match of
                 the last token alone is a weak guess, most often rejected on text that does not copy
    length       each row's next k: k + 2 after a verification that kept every draft, k - 1 after one
                 that did not, within [1, K] (the heuristic of HF transformers' assisted generation); K =
                 ``draft_tokens`` is the maximum and the first k
    pause        a verification of k = 1 draft that kept nothing pauses the row's proposals for 1, 2, 4, ..
                 16 steps (doubling while it keeps failing, reset by one that keeps every draft): a row
                 whose drafts are always rejected then pays one two-position forward per 17 steps, at most

The rules change only which drafts are verified, never which token is emitted: greedy output stays token
for token the plain one, as far as a forward over k + 1 positions computes the same logits as k + 1 one-
position steps (an int8 SmolLM2-135M's differed by up to 0.25, so a near tie can go the other way:
docs/benchmarks/speculative.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tinyformer.errors import GenerationError
from tinyformer.generation.sampling import Penalty, Sampler, processed_logits, sample

__all__ = ["DEFAULT_DRAFT_TOKENS", "DEFAULT_MAX_NGRAM", "DEFAULT_MIN_NGRAM", "METHODS", "DraftModel", "NgramIndex",
           "RowDrafts", "SpeculativeConfig", "accept_greedy", "accept_sampled"]

METHODS = ("ngram", "draft")
DEFAULT_DRAFT_TOKENS = 4  # docs/benchmarks/speculative.md: 8 gained little over 4 in fp32 and lost in int8
DEFAULT_MAX_NGRAM = 3
# a one-token match drafted mostly rejected tokens on free writing (docs/benchmarks/speculative.md)
DEFAULT_MIN_NGRAM = 2
MAX_DRAFT_TOKENS = 64
MAX_BACKOFF = 16  # steps without proposals after repeated failed verifications, at most

# draws from softmax(x) of already-processed logits x (no processor of its own)
_PLAIN = Sampler()


@dataclass
class SpeculativeConfig:
    """How a row speculates: ``method`` "ngram" (prompt lookup) or "draft" (a draft model, given to the
    engine); ``draft_tokens`` K drafts per step at most; prompt lookup matches the last n tokens, n =
    ``max_ngram`` .. ``min_ngram``; ``adaptive`` varies each row's number of drafts and pauses its proposals
    after failed verifications (module docstring); without it every step proposes K."""

    method: str = "ngram"
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    max_ngram: int = DEFAULT_MAX_NGRAM
    min_ngram: int = DEFAULT_MIN_NGRAM
    adaptive: bool = True

    def validate(self) -> SpeculativeConfig:
        """GenerationError naming the first bad field; ``self`` when every field is valid."""
        if self.method not in METHODS:
            raise GenerationError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name, x, top, shown in (("draft tokens", self.draft_tokens, MAX_DRAFT_TOKENS, MAX_DRAFT_TOKENS),
                                    ("max ngram", self.max_ngram, 16, 16),
                                    ("min ngram", self.min_ngram, self.max_ngram, f"max ngram = {self.max_ngram}")):
            if isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= top:
                raise GenerationError(f"{name} must be an integer in [1, {shown}], got {x!r}")
        return self


class NgramIndex:
    """Prompt lookup over one growing sequence, O(max_n) per token: ``latest[n][g]`` is the start of the latest
    occurrence of n-gram g that some token follows (the sequence's own suffix has none yet, so a lookup of
    the suffix finds an earlier occurrence); ``propose`` matches suffixes of min_n .. max_n tokens."""

    def __init__(self, max_n: int, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]

    def extend(self, seq: Sequence[int]) -> None:
        """Catch up with ``seq``, which continues the tokens seen so far."""
        toks, latest = self.tokens, self.latest
        for t in seq[len(toks):]:
            end = len(toks)  # the n-grams ending just before the new token are now followed by it
            toks.append(int(t))
            for n in range(1, min(self.max_n, end) + 1):
                latest[n][tuple(toks[end - n : end])] = end - n

    def propose(self, k: int) -> list[int]:
        """The k tokens (fewer at the end) after the latest earlier occurrence of the longest suffix of
        min_n <= n <= max_n tokens that occurred before; [] when none did."""
        toks = self.tokens
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            j = self.latest[n].get(tuple(toks[len(toks) - n :]))
            if j is not None:
                return toks[j + n : j + n + k]
        return []


class RowDrafts:
    """One row's speculation: its config, prompt-lookup index, draft-model position, adaptive pause and
    counts (``proposed`` drafts verified, ``accepted`` of them kept)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.ngram = NgramIndex(config.max_ngram, config.min_ngram) if config.method == "ngram" else None
        self.draft_pos = 0  # draft model: the positions of the sequence its cache row holds
        self.base = 0  # draft model: the sequence's length when it last proposed
        self.q: Tensor | None = None  # draft model, sampling: (k, V) distributions of the last drafts
        self.proposed = 0
        self.accepted = 0
        self.k = config.draft_tokens  # drafts of the next proposal, in [1, K]
        self._pause = 0
        self._backoff = 0

    def budget(self, room: int) -> int:
        """Drafts to propose this step: the current k, at most ``room``; 0 while paused."""
        if self._pause > 0:
            self._pause -= 1
            return 0
        return max(0, min(self.k, room))

    def record(self, proposed: int, accepted: int) -> None:
        """Count a verification of ``proposed`` drafts that kept ``accepted``; with ``adaptive``, the next k
        = min(K, k + 2) if all were kept else max(1, k - 1), and a pause of 1, 2, 4 .. 16 steps after one
        draft that was rejected (module docstring)."""
        self.proposed += proposed
        self.accepted += accepted
        if not self.config.adaptive or proposed == 0:
            return
        if accepted == proposed:
            self.k = min(self.config.draft_tokens, self.k + 2)
            self._backoff = 0
        else:
            # the pause waits until k has come down to 1: a partly kept longer draft says the text still
            # copies, so it is shortened rather than stopped
            if accepted == 0 and proposed == 1:
                self._backoff = min(max(1, 2 * self._backoff), MAX_BACKOFF)
                self._pause = self._backoff
            self.k = max(1, self.k - 1)


def accept_greedy(targets: Sequence[int], drafts: Sequence[int]) -> tuple[int, int]:
    """(m, y): the longest prefix d_1 .. d_m of ``drafts`` equal to the target's argmaxes ``targets`` (K + 1
    of them, after y_0, d_1, ...), and the token emitted after it, targets[m]."""
    m = 0
    while m < len(drafts) and drafts[m] == targets[m]:
        m += 1
    return m, int(targets[m])


def accept_sampled(x: Tensor, drafts: Sequence[int], q: Tensor | None,
                   generator: torch.Generator | None) -> tuple[int, int]:
    """(m, y) by the speculative sampling rule (module docstring): ``x`` (K + 1, V) the target's processed
    logits after each prefix (p_j = softmax(x_j)), ``q`` (K, V) the draft distributions the drafts were drawn
    from, or None for point masses (prompt lookup). One uniform per examined draft and one draw for y, from
    ``generator`` (None: the global RNG); with every draft kept, y is ``sample``'s own draw from x_K (so a row
    without drafts draws exactly what plain decoding draws)."""
    k = len(drafts)
    m = 0
    if k:
        p = torch.softmax(x[:k], dim=-1)
        d = torch.tensor(list(drafts), device=x.device)
        pd = p.gather(1, d[:, None]).squeeze(1)  # p_{j-1}(d_j)
        ratio = pd if q is None else pd / q.gather(1, d[:, None]).squeeze(1).clamp_min(1e-30)
        u = torch.rand(k, generator=generator, dtype=p.dtype, device=p.device)
        ok = (u < ratio.clamp(max=1.0)).tolist()
        m = ok.index(False) if False in ok else k
        if m < k:  # d_{m+1} rejected: draw from the residual max(0, p_m - q_{m+1}), normalised by the draw
            residual = p[m].clone()
            if q is None:
                residual[drafts[m]] = 0.0
            else:
                residual = (residual - q[m]).clamp_min(0.0)
            if not bool(residual.sum() > 0):  # p_m <= q_{m+1} everywhere only by rounding: p_m itself
                residual = p[m]
            y, _ = sample(residual.log()[None], _PLAIN, None, generator, want_logprobs=False)
            return m, int(y[0])
    y, _ = sample(x[m : m + 1], _PLAIN, None, generator, want_logprobs=False)
    return m, int(y[0])


class DraftModel:
    """A draft model with its own KV cache, a row per engine slot: ``propose`` feeds a row's new tokens and
    decodes k drafts from them, ``rollback`` forgets the drafts the target rejected."""

    def __init__(self, model: nn.Module, max_batch: int, max_len: int, max_draft: int) -> None:
        self.model = model
        self.max_len = min(max_len, model.cfg.max_seq_len)
        self.cache = model.new_cache(max_batch, self.max_len, spare_slots=max_draft)
        self.device = next(model.parameters()).device

    def propose(self, slot: int, seq: Sequence[int], state: RowDrafts, k: int, sampler: Sampler,
                generator: torch.Generator | None) -> list[int]:
        """Up to k drafts after ``seq`` (prompt + output) for the row in ``slot``; [] when the draft's cache
        has no room. Sets ``state.q`` (k, V) for a sampling row (None for greedy)."""
        k = min(k, self.max_len - len(seq))
        if k <= 0 or state.draft_pos >= len(seq):
            return []
        view = self.cache.row_view(slot)
        view.length = state.draft_pos
        feed = torch.tensor([list(seq[state.draft_pos:])], device=self.device)
        logits = self.model(feed, cache=view, last_only=True)[:, -1]
        # the draft's sampler: the warping (temperature, top-k/p, min-p) without the penalties, which need a
        # history; any q keeps the rule exact, one close to p keeps more drafts
        warp = Sampler([p for p in sampler.processors if not isinstance(p, Penalty)], greedy=sampler.greedy)
        drafts: list[int] = []
        qs: list[Tensor] = []
        for i in range(k):
            if warp.greedy:
                tok = int(logits.argmax(-1))
            else:
                x = processed_logits(logits, [warp])
                qs.append(torch.softmax(x, dim=-1)[0])
                tok = int(sample(x, _PLAIN, None, generator, want_logprobs=False)[0][0])
            drafts.append(tok)
            if i + 1 < k:
                logits = self.model(torch.tensor([[tok]], device=self.device), cache=view)[:, -1]
        state.base, state.draft_pos = len(seq), len(seq) + k - 1  # the last draft is not fed
        state.q = torch.stack(qs) if qs else None
        return drafts

    def rollback(self, slot: int, state: RowDrafts, keep: int) -> None:
        """Keep the first ``keep`` positions of the slot's draft row (the tokens the target kept)."""
        if keep < state.draft_pos:
            self.cache.row_view(slot).truncate(keep, old=state.draft_pos)
            state.draft_pos = keep
