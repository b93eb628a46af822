"""Log-likelihood of continuations, batched and KV-cached: the core of every scored evaluation.

For a request (context c_1..c_P, continuation k_1..k_K):

    logprob   = sum_j log p(k_j | c_1..c_P, k_1..k_{j-1})
    is_greedy = every k_j is the argmax of its next-token distribution

When context + continuation is longer than ``max_length + 1`` tokens the context is cut from the
left, exactly as lm-eval's ``hf`` backend cuts its input ``(c + k)[-(max_length + 1):][:-1]``; the
continuation itself must fit (K <= max_length).

How it is computed. Requests with the same (cut) context form a group (the choices of a
multiple-choice question). Groups are taken ``batch_size`` at a time, longest context first:

    prefill:  the G contexts, left padded to P = max P_g with a padding mask    ids (G, P)
              -> KV cache (G rows) and the last position's logits                 (G, V)
    extend:   continuations longest first, batch_size rows at a time: the rows' cache
              copied from their contexts' rows, k_1..k_{K_r - 1} right padded    ids (n, K - 1)
              -> hidden states; the LM head runs only on real positions

so a shared context is encoded once, not once per choice, and the vocabulary-sized head (the largest
matmul of a small model) runs only where a continuation token is scored. Padding after the real
tokens of a row is causal-invisible to them and masked as keys; its positions stay inside the model's
context. Log-softmax is taken in float32.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from tinyformer.errors import ConfigError

__all__ = ["Score", "score_continuations"]


@dataclass(frozen=True)
class Score:
    """``logprob`` = sum of log p over the continuation tokens; ``is_greedy`` = each was the argmax;
    ``token_logprobs`` = the per-token terms of that sum."""

    logprob: float
    is_greedy: bool
    token_logprobs: tuple[float, ...]


def _cut(ctx: Sequence[int], cont: Sequence[int], max_length: int) -> tuple[int, ...]:
    """The context the model sees: its last max_length + 1 - len(cont) tokens."""
    if len(cont) < 1:
        raise ConfigError("a scored continuation needs at least one token")
    if len(ctx) < 1:
        raise ConfigError("a scored continuation needs a context of at least one token (e.g. BOS)")
    if len(cont) > max_length:
        raise ConfigError(f"a continuation of {len(cont)} tokens does not fit the context of {max_length} tokens")
    return tuple(ctx[-(max_length + 1 - len(cont)):])


@torch.inference_mode()
def score_continuations(model: nn.Module, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                        batch_size: int = 8, max_length: int | None = None,
                        progress: bool = False) -> list[Score]:
    """Score each (context ids, continuation ids) request with a decoder LM; one :class:`Score` per
    request, in order. ``max_length`` (default: the model's ``max_seq_len``) is the longest input;
    no forward pass holds more than ``batch_size`` rows."""
    from tqdm.auto import tqdm

    L = max_length or model.cfg.max_seq_len  # batch_size and max_length checked by the callers' flags
    conts = [tuple(int(t) for t in k) for _, k in requests]
    by_ctx: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, _) in enumerate(requests):
        by_ctx.setdefault(_cut([int(t) for t in ctx], conts[i], L), []).append(i)
    # longest first, as lm-eval does: neighbours have similar lengths (little padding)
    groups = sorted(by_ctx.items(), key=lambda g: (-len(g[0]), -max(len(conts[i]) for i in g[1])))
    device = model.tok_emb.weight.device
    out: list[Score | None] = [None] * len(requests)
    bar = tqdm(total=len(requests), desc="scoring", unit="req", disable=not progress)
    for start in range(0, len(groups), batch_size):
        done = _score_groups(model, groups[start : start + batch_size], conts, batch_size, device)
        for index, score in done:
            out[index] = score
        bar.update(len(done))
    bar.close()
    return out  # type: ignore[return-value]


def _score_groups(model: nn.Module, batch: list[tuple[tuple[int, ...], list[int]]], conts: list[tuple[int, ...]],
                  batch_size: int, device: torch.device) -> list[tuple[int, Score]]:
    """Prefill the (at most batch_size) contexts of ``batch`` once, then extend their continuations,
    longest first, batch_size rows at a time: (request index, score) pairs."""
    G = len(batch)
    P = max(len(ctx) for ctx, _ in batch)
    K = max(len(conts[i]) for _, members in batch for i in members)
    ctx_ids = torch.zeros(G, P, dtype=torch.long)
    ctx_mask = torch.zeros(G, P, dtype=torch.long)
    for g, (ctx, _) in enumerate(batch):
        ctx_ids[g, P - len(ctx):] = torch.tensor(ctx)
        ctx_mask[g, P - len(ctx):] = 1
    padded = bool((ctx_mask == 0).any())
    ctx_ids, ctx_mask = ctx_ids.to(device), ctx_mask.to(device)
    cache = model.new_cache(G, P + K - 1)
    first = model(ctx_ids, attention_mask=ctx_mask if padded else None, cache=cache, last_only=True)[:, -1]  # (G, V)
    # Each forward pass streams every weight from memory, so rows are packed batch_size at a time; sorted
    # by length, the rows of a pass need little padding.
    rows = sorted(((g, i) for g, (_, members) in enumerate(batch) for i in members), key=lambda r: -len(conts[r[1]]))
    done = []
    for j in range(0, len(rows), batch_size):
        chunk = rows[j : j + batch_size]
        scores = _extend(model, cache, first, ctx_mask if padded else None,
                         [g for g, _ in chunk], [conts[i] for _, i in chunk], device)
        done.extend(zip((i for _, i in chunk), scores))
    return done


def _extend(model: nn.Module, cache: Any, first: Tensor, ctx_mask: Tensor | None, groups: list[int],
            conts: list[tuple[int, ...]], device: torch.device) -> list[Score]:
    """Score continuation r after context groups[r]: k_1 from the prefill logits ``first`` (G, V),
    k_2 .. k_K from one pass over k_1 .. k_{K-1} against a copy of the contexts' cache rows."""
    n = len(conts)
    K = max(len(k) for k in conts)
    group = torch.tensor(groups, device=device)
    targets = torch.zeros(n, K, dtype=torch.long)
    real = torch.zeros(n, K, dtype=torch.bool)
    for r, k in enumerate(conts):
        targets[r, : len(k)] = torch.tensor(k)
        real[r, : len(k)] = True
    targets, real = targets.to(device), real.to(device)
    token_lp = torch.zeros(n, K, device=device)
    greedy = ~real
    token_lp[:, 0], greedy[:, 0] = _pick(first.index_select(0, group), targets[:, 0])
    if K > 1:
        part = copy.copy(cache)
        part.reorder(group)  # index_select: new tensors; the prefill cache stays for the next rows
        ext = targets[:, : K - 1]  # k_1 .. k_{K-1}; padding (token 0) after a shorter row's end
        ext_real = real[:, 1:]  # position j predicts k_{j+2}: real where that token exists
        mask = None
        if ctx_mask is not None or not bool(ext_real.all()):
            # padding keys are hidden and padding positions do not advance (they stay inside the context)
            left = ctx_mask.index_select(0, group) if ctx_mask is not None else torch.ones(
                n, part.length, dtype=torch.long, device=device)
            mask = torch.cat([left, ext_real.long()], dim=1)
        h = model.hidden_states(ext, attention_mask=mask, cache=part)  # (n, K - 1, d)
        lp, hit = _pick(model.lm_head(h[ext_real]), targets[:, 1:][ext_real])  # the head on real positions only
        token_lp[:, 1:][ext_real], greedy[:, 1:][ext_real] = lp, hit
    greedy_rows = greedy.all(dim=1).tolist()
    return [Score(float(sum(lps)), greedy_rows[r], tuple(lps))
            for r, lps in enumerate(token_lp[r, : len(k)].tolist() for r, k in enumerate(conts))]


def _pick(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """logits (M, V), targets (M,) -> log p(target) in float32 (M,), and whether it is the argmax (M,)."""
    logits = logits.float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    return lp, logits.argmax(dim=-1) == targets
