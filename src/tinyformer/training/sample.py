"""A short sample from a language model during training, to see what it has learnt.

Special tokens are used as in training: documents are separated by one EOS token, so generation
stops at EOS; an empty prompt starts from EOS (the start of a new document). The sample draws
from its own seeded generator, never from the global RNG, so that sampling mid-run changes
nothing in the training that follows (exact resume depends on it).
"""

from __future__ import annotations

import torch
from torch import nn

from tinyformer.data.tokenizer import Tokenizer
from tinyformer.generation.sampling import (
    HUMAN_TEMPERATURE,
    HUMAN_TOP_K,
    SamplingParams,
    build_processors,
    make_generator,
    sample_next,
)


@torch.no_grad()
def sample_text(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    device: torch.device | str,
    *,
    seed: int = 0,
    temperature: float = HUMAN_TEMPERATURE,
    top_k: int = HUMAN_TOP_K,
) -> str:
    """``prompt`` plus up to ``max_new_tokens`` sampled tokens (fewer at EOS or the context limit), as text."""
    was_training = model.training
    model.eval()
    try:
        ids = tokenizer.encode(prompt) if prompt else []
        if not ids:
            ids = [tokenizer.eos_id if tokenizer.eos_id is not None else 0]
        context = model.cfg.max_seq_len
        ids = ids[-context:]
        budget = max(0, min(max_new_tokens, context - len(ids)))
        params = SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=budget, seed=seed).validate()
        processors = build_processors(params)
        generator = make_generator(params, device)
        cache = model.new_cache(1, len(ids) + budget) if hasattr(model, "new_cache") else None
        x = torch.tensor([ids], device=device)
        logits = model(x, cache=cache, last_only=True)[:, -1] if cache is not None else model(x)[:, -1]
        out: list[int] = []
        for _ in range(budget):
            token, _ = sample_next(logits, params, None, generator, processors=processors)
            if tokenizer.eos_id is not None and int(token) == tokenizer.eos_id:
                break
            out.append(int(token))
            if cache is not None:
                logits = model(token[:, None], cache=cache)[:, -1]
            else:
                logits = model(torch.tensor([ids + out], device=device))[:, -1]
        return tokenizer.decode([i for i in ids if i != tokenizer.eos_id] + out, skip_special_tokens=True)
    finally:
        model.train(was_training)
