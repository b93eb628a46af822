"""Decoding an encoder-decoder model: greedy search and beam search.

Both run the encoder once, project each decoder layer's cross-attention K/V once (``cross_kv``),
and feed the decoder one token per step through its self-attention KV cache.

Greedy:  y_t = argmax_v log p(v | y_<t, x), until EOS or ``max_new_tokens``.

Beam search keeps K live prefixes per source. A prefix's score is its log-probability
s(y) = sum_t log p(y_t | y_<t, x). At each step every live prefix closed by EOS becomes a
candidate finished hypothesis, and the K best non-EOS extensions stay live. A finished
hypothesis (ended by EOS, or cut at ``max_new_tokens``) is ranked by s(y) / |y|^alpha,
|y| counting generated tokens (EOS included)
and alpha the ``length_penalty`` (0 = raw log-probability; > 0 favours longer outputs, as in
Wu et al. 2016 and Hugging Face). Search stops for a source once it has K finished hypotheses and
no live prefix can still beat the worst of them: log-probabilities only decrease, so a prefix
with score s at length L can reach at most s / L_max^alpha (alpha > 0) or s / (L+1)^alpha
(alpha <= 0). With this exact bound, beam search with K at least the number of live prefixes
returns the true best sequence (tested against brute force).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyformer.errors import GenerationError


@dataclass
class Hypothesis:
    tokens: list[int]  # generated tokens, EOS excluded
    score: float  # s(y) / |y|^alpha
    logprob: float  # s(y)


def _check(model, max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if max_new_tokens > model.cfg.max_seq_len:
        raise GenerationError(f"max_new_tokens={max_new_tokens} exceeds the decoder's context "
                              f"(max_seq_len={model.cfg.max_seq_len})")


@torch.no_grad()
def greedy_decode(model, src_ids: torch.Tensor, src_mask: torch.Tensor | None = None, *, bos_id: int,
                  eos_id: int, max_new_tokens: int) -> list[list[int]]:
    """The greedy output of each source row (B lists of token ids, EOS excluded)."""
    _check(model, max_new_tokens)
    B = src_ids.shape[0]
    cross = model.cross_kv(model.encode(src_ids, src_mask))
    cache = model.new_cache(B, max_new_tokens)
    tok = torch.full((B, 1), bos_id, dtype=torch.long, device=src_ids.device)
    done = torch.zeros(B, dtype=torch.bool, device=src_ids.device)
    steps = []
    for _ in range(max_new_tokens):
        logits = model.lm_head(model.decode(tok, cross, src_mask, cache))[:, -1]
        nxt = logits.argmax(dim=-1).masked_fill(done, eos_id)
        steps.append(nxt)
        done |= nxt == eos_id
        if bool(done.all()):
            break
        tok = nxt[:, None]
    out = torch.stack(steps, dim=1).tolist()
    return [row[: row.index(eos_id)] if eos_id in row else row for row in out]


@torch.no_grad()
def beam_search(model, src_ids: torch.Tensor, src_mask: torch.Tensor | None = None, *, bos_id: int, eos_id: int,
                max_new_tokens: int, beam_size: int = 4, length_penalty: float = 0.0) -> list[Hypothesis]:
    """The best hypothesis of each source row under beam search (see the module docstring)."""
    _check(model, max_new_tokens)
    if beam_size < 1:
        raise GenerationError(f"beam_size must be at least 1, got {beam_size}")
    B, K, device = src_ids.shape[0], beam_size, src_ids.device
    memory = model.encode(src_ids, src_mask)
    # every beam of a source shares its memory: repeat rows once; beams never move across sources
    cross = [(k.repeat_interleave(K, 0), v.repeat_interleave(K, 0)) for k, v in model.cross_kv(memory)]
    mask = src_mask.repeat_interleave(K, 0) if src_mask is not None else None
    cache = model.new_cache(B * K, max_new_tokens)
    # only beam 0 is live at the start (the others would duplicate it)
    scores = torch.full((B, K), float("-inf"), device=device, dtype=torch.float64)
    scores[:, 0] = 0.0
    prefixes: list[list[list[int]]] = [[[] for _ in range(K)] for _ in range(B)]
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    closed = [False] * B
    tok = torch.full((B * K, 1), bos_id, dtype=torch.long, device=device)

    def normalised(logprob: float, length: int) -> float:
        return logprob / (length ** length_penalty)

    def add_finished(b: int, hyp: Hypothesis) -> None:
        finished[b].append(hyp)
        finished[b].sort(key=lambda h: h.score, reverse=True)
        del finished[b][K:]

    for step in range(max_new_tokens):
        length = step + 1  # tokens generated once this step's token is appended
        logits = model.lm_head(model.decode(tok, cross, mask, cache))[:, -1]
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        logp = torch.log_softmax(logits, dim=-1).view(B, K, -1)
        V = logp.shape[-1]
        ended = (scores + logp[:, :, eos_id]).tolist()  # each live prefix closed by EOS now
        logp[:, :, eos_id] = float("-inf")
        top_scores, top_index = (scores[:, :, None] + logp).view(B, K * V).topk(K, dim=-1)
        new_scores = torch.full((B, K), float("-inf"), device=device, dtype=torch.float64)
        origin = torch.arange(B * K, device=device).view(B, K).clone()  # the rows the next step continues
        new_prefixes: list[list[list[int]]] = [[[] for _ in range(K)] for _ in range(B)]
        for b in range(B):
            if closed[b]:
                continue
            for beam in range(K):
                if ended[b][beam] != float("-inf"):
                    add_finished(b, Hypothesis(list(prefixes[b][beam]), normalised(ended[b][beam], length),
                                               ended[b][beam]))
            for rank, (s, idx) in enumerate(zip(top_scores[b].tolist(), top_index[b].tolist())):
                if s == float("-inf"):
                    break
                beam, token = divmod(idx, V)
                if length == max_new_tokens:  # out of room: the prefix is cut here
                    add_finished(b, Hypothesis(prefixes[b][beam] + [token], normalised(s, length), s))
                    continue
                new_scores[b, rank] = s
                origin[b, rank] = b * K + beam
                new_prefixes[b][rank] = prefixes[b][beam] + [token]
            best_live = float(new_scores[b].max())
            if best_live == float("-inf"):
                closed[b] = True
            elif len(finished[b]) >= K:
                reach = length + 1 if length_penalty <= 0 else max_new_tokens
                closed[b] = normalised(best_live, reach) <= finished[b][-1].score
        if all(closed) or length == max_new_tokens:
            break
        for b in range(B):
            if closed[b]:
                new_scores[b] = float("-inf")
        scores, prefixes = new_scores, new_prefixes
        cache.reorder(origin.view(-1))
        tok = (top_index % V).view(B * K, 1)
    return [finished[b][0] for b in range(B)]
