"""Position-wise feed-forward networks, x: (B, T, d) -> (B, T, d).

SwiGLU (Shazeer 2020; LLaMA):  FFN(x) = W_down (silu(W_gate x) * (W_up x)),   silu(z) = z * sigmoid(z)
GeGLU-tanh (Gemma):             FFN(x) = W_down (gelu_tanh(W_gate x) * (W_up x))
GELU MLP (GPT-2, BERT):         FFN(x) = W_2 gelu(W_1 x + b_1) + b_2   (exact erf GELU, or its tanh approximation)
ReLU MLP (Vaswani et al. 2017): FFN(x) = W_2 max(0, W_1 x + b_1) + b_2
Mixture of experts:             FFN(x) = sum_k g_k SwiGLU_k(x) over the router's top k experts (components/moe.py)

The SwiGLU gate and up projections are stored as one (2 d_ff, d) matrix ``gate_up`` — rows
[0, d_ff) are W_gate, rows [d_ff, 2 d_ff) are W_up — so that one matmul computes both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _SiluMul(torch.autograd.Function):
    """silu(g) * u from the fused projection output gu = [g, u] (..., 2 f) -> (..., f).

    Backward, with s = sigmoid(g):  dL/du = dL/dy silu(g),   dL/dg = dL/dy u s (1 + g (1 - s)).
    Both halves are written into one (..., 2 f) gradient, which is what the fused gate_up matmul needs:
    autograd's split backward would zero-fill such a tensor and copy the two halves in. Only gu is kept
    for backward (the sigmoid is recomputed), not gu and silu(g) as the unfused ops keep."""

    @staticmethod
    def forward(ctx, gu: torch.Tensor, f: int) -> torch.Tensor:
        gate, up = gu.split(f, dim=-1)
        ctx.save_for_backward(gu)
        ctx.f = f
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (gu,) = ctx.saved_tensors
        f = ctx.f
        gate, up = gu.split(f, dim=-1)
        grad_gu = torch.empty_like(gu)
        # dL/dg in one fused pass: silu_backward(v, g) = v s (1 + g (1 - s)), with v = dL/dy u
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gu[..., :f])
        torch.mul(grad, F.silu(gate), out=grad_gu[..., f:])
        return grad_gu, None


def silu_mul(gu: torch.Tensor, f: int) -> torch.Tensor:
    """silu(gu[..., :f]) * gu[..., f:] with a single fused gradient for gu (see ``_SiluMul``)."""
    return _SiluMul.apply(gu, f)


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The elementwise non-linearity ``name``: relu, gelu_tanh, else the exact (erf) GELU."""
    if name == "relu":
        return F.relu(x)
    return F.gelu(x, approximate="tanh" if name == "gelu_tanh" else "none")


class SwiGLU(nn.Module):
    """The gated FFN with silu (SwiGLU); ``GeGLU`` is its GELU-tanh sibling."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = False) -> None:
        super().__init__()
        self.d_ff = d_ff
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=bias)
        self.down = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            # eager: the hand-fused gradient; under torch.compile the plain ops below, which the compiler
            # fuses itself (and which it traces without a graph break)
            return self.down(silu_mul(self.gate_up(x), self.d_ff))
        gate, up = self.gate_up(x).split(self.d_ff, dim=-1)  # (B, T, d_ff) each
        return self.down(F.silu(gate) * up)


class GeGLU(SwiGLU):
    """The gated FFN with GELU's tanh approximation (Gemma): W_down (gelu_tanh(W_gate x) * (W_up x))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.d_ff, dim=-1)  # (B, T, d_ff) each
        return self.down(F.gelu(gate, approximate="tanh") * up)


class MLP(nn.Module):
    """Two-matrix MLP with an elementwise activation: 'gelu', 'gelu_tanh' or 'relu'."""

    def __init__(self, d_model: int, d_ff: int, activation: str, bias: bool = True) -> None:
        super().__init__()
        self.activation = activation
        self.up = nn.Linear(d_model, d_ff, bias=bias)
        self.down = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(activation(self.activation, self.up(x)))

