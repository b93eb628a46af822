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
from tinyformer.generation.generator import Generator
from tinyformer.generation.sampling import HUMAN_TEMPERATURE, HUMAN_TOP_K, SamplingParams
from tinyformer.training.objectives.base import eval_mode


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
    """``prompt`` plus up to ``max_new_tokens`` sampled tokens (fewer at EOS or the context limit), as text,
    decoded by the same engine and drawn by the same sampler (:func:`~tinyformer.generation.sampling.sample`)
    as ``tinyformer generate`` (``device`` is where the model already is)."""
    with eval_mode(model):
        ids = tokenizer.encode(prompt) if prompt else []
        if not ids:
            ids = [tokenizer.eos_id if tokenizer.eos_id is not None else 0]
        context = model.cfg.max_seq_len
        ids = ids[-context:]
        budget = max(0, min(max_new_tokens, context - len(ids)))
        params = SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=budget, seed=seed)
        gen = Generator(model, tokenizer)  # puts the model in eval mode
        out = gen.generate([ids], params, logprobs=False)[0].token_ids
        if out and tokenizer.eos_id is not None and out[-1] == tokenizer.eos_id:
            out = out[:-1]
        return tokenizer.decode([i for i in ids if i != tokenizer.eos_id] + out, skip_special_tokens=True)
