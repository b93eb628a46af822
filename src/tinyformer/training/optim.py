"""AdamW with decoupled weight decay on matrices only, and the learning-rate schedule.

AdamW (Loshchilov & Hutter 2019), per parameter theta with gradient g at update t:
    m_t = b1 m_{t-1} + (1 - b1) g            v_t = b2 v_{t-1} + (1 - b2) g^2
    theta <- theta - lr_t (m_t / (1 - b1^t)) / (sqrt(v_t / (1 - b2^t)) + eps) - lr_t wd theta

Weight decay goes to tensors with 2+ dimensions: the weight matrices, and (as nanoGPT does) the
embedding tables unless ``decay_embeddings`` is off; a tied LM head is the embedding table, the
largest matrix of a small model, so leaving it undecayed would exempt most of the parameters.
Norm gains and biases (1-D) are never decayed: shrinking a gain towards 0 shrinks a whole
channel, which is not the "prefer small weights" prior decay stands for.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tinyformer.training.train_config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool = True) -> list[dict]:
    """Two AdamW groups: decayed (2D+ tensors) and not decayed (1-D tensors; embeddings if asked).

    Parameters are listed once each (tied weights share one tensor) in ``named_parameters`` order,
    which is what makes a saved optimizer state line up with the model on load.
    """
    from tinyformer.components.positions import LearnedPositions

    tables = (nn.Embedding, LearnedPositions)  # lookup tables: token, token-type and position embeddings
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, tables)}
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # yields a shared (tied) tensor once
        if not p.requires_grad:
            continue
        is_matrix = p.dim() >= 2 and (decay_embeddings or id(p) not in embedding_params)
        (decay if is_matrix else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: TrainConfig, device_type: str) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups`, fused (one kernel for all tensors) where the device has it."""
    groups = param_groups(model, cfg.weight_decay, cfg.decay_embeddings)
    fused = device_type in ("cuda", "cpu", "xpu", "mps")
    try:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)
    except (RuntimeError, TypeError):  # an older torch or a device without the fused kernel
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for update t = ``step`` (0-based): linear warm-up over W = warmup_steps, then decay to the
    floor = min_lr (default lr / 10) at D = decay_steps (default max_steps).

        t < W:        lr (t + 1) / W
        W <= t < D:   floor + (lr - floor) s(p),  p = (t - W) / (D - W)
        t >= D:       floor
    s(p) = (1 + cos(pi p)) / 2 for "cosine", 1 - p for "linear"; "constant" keeps lr after warm-up.
    """
    warmup, decay_end, floor = cfg.warmup_steps, cfg.total_decay_steps, cfg.lr_floor
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if step >= decay_end:
        return floor
    p = (step - warmup) / (decay_end - warmup)
    s = 0.5 * (1.0 + math.cos(math.pi * p)) if cfg.lr_schedule == "cosine" else 1.0 - p
    return floor + (cfg.lr - floor) * s
