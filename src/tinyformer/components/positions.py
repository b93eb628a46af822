"""Absolute position encodings added to the token embeddings (the classic family).

Sinusoidal (Vaswani et al. 2017):  PE(pos, 2i) = sin(pos / 10000^(2i/d)),  PE(pos, 2i+1) = cos(pos / 10000^(2i/d))
Learned (GPT-2, BERT): a trainable table P of shape (max_seq_len, d).
``add_to(x, positions)`` is x + P[positions], positions (T,) or (B|1, T).
RoPE, which rotates q and k instead, is in rope.py; a RoPE model's ``pos_emb`` is ``NoPositions``.
"""

from __future__ import annotations

import torch
from torch import nn

from tinyformer.config import ModelConfig


def sinusoidal_table(length: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """The (length, dim) table PE with even columns sin(pos / base^(2i/d)) and odd columns cos(...)."""
    pos = torch.arange(length, dtype=torch.float64).unsqueeze(1)  # (T, 1)
    two_i = torch.arange(0, dim, 2, dtype=torch.float64)  # (d/2,)
    angle = pos / (base ** (two_i / dim))  # (T, d/2)
    pe = torch.zeros(length, dim, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)
    return pe.float()


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal encodings (no parameters)."""

    def __init__(self, max_seq_len: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("table", sinusoidal_table(max_seq_len, dim), persistent=False)

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recompute the table on ``device`` (after a meta-device build: it is not in the checkpoint)."""
        self.table = sinusoidal_table(self.table.shape[0], self.table.shape[1]).to(device)

    def add_to(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, T, d) + PE[positions]."""
        return x + self.table[positions]


class LearnedPositions(nn.Module):
    """A trainable position table; ``weight`` has shape (max_seq_len, d)."""

    def __init__(self, max_seq_len: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(max_seq_len, dim))

    def add_to(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, T, d) + P[positions]."""
        return x + self.weight[positions]


class NoPositions(nn.Module):
    """No added position encoding (RoPE models: positions enter inside attention)."""

    def add_to(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x


def build_positions(cfg: ModelConfig) -> nn.Module:
    """The table added to the embeddings: learned, sinusoidal, or none (RoPE)."""
    if cfg.pos == "learned":
        return LearnedPositions(cfg.max_seq_len, cfg.d_model)
    if cfg.pos == "sinusoidal":
        return SinusoidalPositions(cfg.max_seq_len, cfg.d_model)
    return NoPositions()
