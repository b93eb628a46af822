"""Weight initialisation shared by every model stack (decoder LM, encoder, encoder-decoder).

    W ~ N(0, std)                          every nn.Linear and nn.Embedding (biases zero)
    W_out ~ N(0, std / sqrt(branches))     residual output projections: attn.out, cross_attn.out, ffn.down
    P ~ N(0, std / 2)                      learned position tables
    gains 1, biases 0                      RMSNorm / LayerNorm, as their constructors make them (gain stored
                                           as 1 - offset where it has one)
"""

from __future__ import annotations

import math

from torch import nn

from tinyformer.components.positions import LearnedPositions


def init_weights(model: nn.Module, std: float, residual_branches: int) -> None:
    """N(0, std) for matrices and embeddings, zero biases (norm gains keep their constructors' 1): the
    initialisation of every model here (DecoderLM, the encoder and the encoder-decoder, each with its count
    of branches).

    The output projections of the residual branches (``attn.out``, ``cross_attn.out``, ``ffn.down``)
    get std / sqrt(``residual_branches``): each adds to the residual stream, whose variance would
    otherwise grow with the number of branches (GPT-2's scaled initialisation)."""
    residual_std = std / math.sqrt(max(1, residual_branches))
    for name, module in model.named_modules():
        if hasattr(module, "init_experts"):  # expert matrices are stacked parameters, not nn.Linear
            module.init_experts(std, residual_std)
        if isinstance(module, nn.Linear):
            is_residual = name.endswith(("attn.out", "ffn.down", "ffn.shared.down"))
            nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, LearnedPositions):
            nn.init.normal_(module.weight, mean=0.0, std=std / 2)
