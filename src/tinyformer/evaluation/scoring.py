"""Log-likelihood of continuations, batched and KV-cached: the core of every scored evaluation.

For a request (context c_1..c_P, continuation k_1..k_K):

    logprob   = sum_j log p(k_j | c_1..c_P, k_1..k_{j-1})
    is_greedy = every k_j is the argmax of its next-token distribution

When context + continuation is longer than ``max_length + 1`` tokens the context is cut from the
left, exactly as lm-eval's ``hf`` backend cuts its input ``(c + k)[-(max_length + 1):][:-1]``; the
continuation itself must fit (K <= max_length).

How it is computed. Requests with the same (cut) context form a group (the choices of a
multiple-choice question). A batch holds up to ``batch_size`` continuations from G groups:

    prefill:  the G contexts, left padded to P = max P_g with a padding mask    ids (G, P)
              -> KV cache (G rows) and the last position's logits                 (G, V)
    expand:   cache rows copied to the N continuations (row g(r) for continuation r)
    extend:   k_1..k_{K_r - 1} of every continuation, right padded to K - 1       ids (N, K - 1)
              against the cache -> hidden states; the LM head runs only on real positions

so a shared context is encoded once, not once per choice, and the vocabulary-sized head (the largest
matmul of a small model) runs only where a continuation token is scored. Padding after the real
tokens of a row is causal-invisible to them and masked as keys; its positions stay inside the model's
context. Log-softmax is taken in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def _batches(groups: list[tuple[tuple[int, ...], list[int]]], batch_size: int):
    """Split groups (context, request indices) into batches of at most ``batch_size`` continuations;
    a group larger than a batch is split into several (its context is then encoded once per part)."""
    batch: list[tuple[tuple[int, ...], list[int]]] = []
    rows = 0
    for ctx, members in groups:
        for i in range(0, len(members), batch_size):
            part = members[i : i + batch_size]
            if rows + len(part) > batch_size:
                yield batch
                batch, rows = [], 0
            batch.append((ctx, part))
            rows += len(part)
    if batch:
        yield batch


@torch.inference_mode()
def score_continuations(model: nn.Module, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                        batch_size: int = 8, max_length: int | None = None,
                        progress: bool = False) -> list[Score]:
    """Score each (context ids, continuation ids) request with a decoder LM; one :class:`Score` per
    request, in order. ``max_length`` (default: the model's ``max_seq_len``) is the longest input."""
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise ConfigError(f"batch size must be positive, got {batch_size}")
    L = max_length or model.cfg.max_seq_len
    if not 1 <= L <= model.cfg.max_seq_len and model.cfg.rope_type != "dynamic":
        raise ConfigError(f"max length {L} must be in [1, max_seq_len={model.cfg.max_seq_len}]")
    conts = [tuple(int(t) for t in k) for _, k in requests]
    by_ctx: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, _) in enumerate(requests):
        by_ctx.setdefault(_cut([int(t) for t in ctx], conts[i], L), []).append(i)
    # longest first, as lm-eval does: neighbours have similar lengths (little padding)
    groups = sorted(by_ctx.items(), key=lambda g: -(len(g[0]) + max(len(conts[i]) for i in g[1])))
    device = model.tok_emb.weight.device
    out: list[Score | None] = [None] * len(requests)
    bar = tqdm(total=len(requests), desc="scoring", unit="req", disable=not progress)
    for batch in _batches(groups, batch_size):
        members = [i for _, part in batch for i in part]
        for index, score in zip(members, _score_batch(model, batch, conts, device)):
            out[index] = score
        bar.update(len(members))
    bar.close()
    return out  # type: ignore[return-value]


def _score_batch(model: nn.Module, batch: list[tuple[tuple[int, ...], list[int]]], conts: list[tuple[int, ...]],
                 device: torch.device) -> list[Score]:
    G = len(batch)
    P = max(len(ctx) for ctx, _ in batch)
    rows = [(g, conts[i]) for g, (_, members) in enumerate(batch) for i in members]  # (group, continuation)
    N = len(rows)
    K = max(len(k) for _, k in rows)
    ctx_ids = torch.zeros(G, P, dtype=torch.long)
    ctx_mask = torch.zeros(G, P, dtype=torch.long)
    for g, (ctx, _) in enumerate(batch):
        ctx_ids[g, P - len(ctx):] = torch.tensor(ctx)
        ctx_mask[g, P - len(ctx):] = 1
    padded = bool((ctx_mask == 0).any())
    ctx_ids, ctx_mask = ctx_ids.to(device), ctx_mask.to(device)
    cache = model.new_cache(G, P + K - 1)
    first = model(ctx_ids, attention_mask=ctx_mask if padded else None, cache=cache, last_only=True)[:, -1]  # (G, V)
    group = torch.tensor([g for g, _ in rows], device=device)
    targets = torch.zeros(N, K, dtype=torch.long)
    real = torch.zeros(N, K, dtype=torch.bool)
    for r, (_, k) in enumerate(rows):
        targets[r, : len(k)] = torch.tensor(k)
        real[r, : len(k)] = True
    targets, real = targets.to(device), real.to(device)
    token_lp = torch.zeros(N, K, device=device)
    greedy = ~real
    # k_1 of every row is predicted by its context's last position
    lp, hit = _pick(first.index_select(0, group), targets[:, 0])
    token_lp[:, 0], greedy[:, 0] = lp, hit
    if K > 1:
        cache.reorder(group)
        ext = targets[:, : K - 1]  # k_1 .. k_{K-1}; padding (token 0) after a shorter row's end
        ext_real = real[:, 1:]  # position j predicts k_{j+2}: real where that token exists
        mask = None
        if padded or not bool(ext_real.all()):
            # padding keys are hidden and padding positions do not advance (they stay inside the context)
            mask = torch.cat([ctx_mask.index_select(0, group), ext_real.long()], dim=1)
        h = model.hidden_states(ext, attention_mask=mask, cache=cache)  # (N, K - 1, d)
        lp, hit = _pick(model.lm_head(h[ext_real]), targets[:, 1:][ext_real])  # head on real positions only
        token_lp[:, 1:][ext_real], greedy[:, 1:][ext_real] = lp, hit
    greedy_rows = greedy.all(dim=1).tolist()
    scores = []
    for r, (_, k) in enumerate(rows):
        lps = token_lp[r, : len(k)].tolist()
        scores.append(Score(float(sum(lps)), greedy_rows[r], tuple(lps)))
    return scores


def _pick(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """logits (M, V), targets (M,) -> log p(target) in float32 (M,), and whether it is the argmax (M,)."""
    logits = logits.float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    return lp, logits.argmax(dim=-1) == targets
