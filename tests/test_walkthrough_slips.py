"""The behaviours the walkthrough's corrections state, shown with the project's real layers.

Each test proves one correction of docs/walkthrough.md ("Corrections to common figures") by running the
layer it is about, not by restating the formula: attention without positions permutes its outputs with
its inputs; a block without the causal mask lets a position see the tokens after it; SwiGLU has three
matrices; convolution, recurrence and self-attention cost what Vaswani et al.'s Table 1 says per layer
(FLOPs counted by PyTorch's FlopCounterMode on real modules, :func:`layer_flops`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tinyformer.components.attention import SelfAttention, reference_attention
from tinyformer.config import ModelConfig
from tinyformer.models.decoder import DecoderLM


def _count(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def layer_flops(n: int, d: int, k: int) -> dict[str, int]:
    """FLOPs of one layer over n positions of width d, as PyTorch counts them (a multiply-add is 2):

    convolution: nn.Conv1d(d, d, k) over the sequence;
    recurrence:  n steps of nn.RNNCell(d, d), h_t = tanh(x_t W_x + h_{t-1} W_h);
    self-attention: softmax(q k^T / sqrt(d)) v of one head (the n x n part; the q, k, v, o projections are
    per-token matmuls, counted apart as ``projections``)."""
    torch.manual_seed(0)
    x = torch.randn(1, d, n)
    conv = nn.Conv1d(d, d, k, padding=k // 2, bias=False)
    cell = nn.RNNCell(d, d, bias=False)
    seq = torch.randn(n, 1, d)

    def recur() -> None:
        h = torch.zeros(1, d)
        for t in range(n):
            h = cell(seq[t], h)

    q = k_ = v = torch.randn(1, 1, n, d)
    proj = nn.Linear(d, d, bias=False)
    tokens = torch.randn(n, d)
    return {"convolution": _count(lambda: conv(x)), "recurrence": _count(recur),
            "self-attention": _count(lambda: reference_attention(q, k_, v)),
            "projections": 4 * _count(lambda: proj(tokens))}


def test_layer_costs_are_k_n_d2_for_convolution_n_d2_for_recurrence_n2_d_for_self_attention():
    n, d, k = 64, 32, 3
    base, long, wide = layer_flops(n, d, k), layer_flops(2 * n, d, k), layer_flops(n, 2 * d, k)
    assert base["convolution"] == 2 * k * n * d * d
    assert base["recurrence"] == 4 * n * d * d
    assert base["self-attention"] == 4 * n * n * d
    # twice the sequence: convolution and recurrence double, self-attention quadruples
    assert [long[c] / base[c] for c in ("convolution", "recurrence", "self-attention")] == [2, 2, 4]
    # twice the width: convolution and recurrence quadruple, self-attention doubles
    assert [wide[c] / base[c] for c in ("convolution", "recurrence", "self-attention")] == [4, 4, 2]


def _attention(causal: bool) -> SelfAttention:
    cfg = ModelConfig(vocab_size=16, d_model=32, n_layer=1, n_head=4, n_kv_head=4, max_seq_len=16, pos="none")
    torch.manual_seed(0)
    return SelfAttention(cfg, causal=causal).eval()


@torch.no_grad()
def test_attention_without_positions_permutes_its_outputs_with_its_inputs_instead_of_keeping_them():
    attn = _attention(causal=False)
    x = torch.randn(1, 7, 32)
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    out, shuffled = attn(x), attn(x[:, perm])
    torch.testing.assert_close(shuffled, out[:, perm], atol=1e-6, rtol=0)  # equivariant: moved with its token
    assert (shuffled - out).abs().max() > 0.1  # not "exactly the same output"
    torch.testing.assert_close(shuffled.mean(1), out.mean(1), atol=1e-6, rtol=0)  # only a pool over positions is


@torch.no_grad()
def test_with_the_causal_mask_even_equivariance_is_gone():
    attn = _attention(causal=True)
    x = torch.randn(1, 7, 32)
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    assert (attn(x[:, perm]) - attn(x)[:, perm]).abs().max() > 0.01  # each token now sees other predecessors


@torch.no_grad()
def test_without_the_causal_mask_a_position_sees_the_tokens_after_it():
    """The popular block code passes attn_mask=None: position 0's output then changes with token 5."""
    x = torch.randn(1, 6, 32)
    later = x.clone()
    later[:, 5] += 1.0
    for causal, changes in ((True, False), (False, True)):
        attn = _attention(causal)
        moved = (attn(later)[:, 0] - attn(x)[:, 0]).abs().max() > 1e-4
        assert moved == changes


@torch.no_grad()
def test_swiglu_is_two_input_projections_multiplied_then_one_output_projection():
    """(silu(x W_gate) * x W_up) W_down: 3 d d_ff weights, and zeroing either input projection zeroes it all
    (a GLU's product), which a one-projection "SwiGLU(x W1 + b1) W2" cannot do."""
    d, f = 32, 48
    cfg = ModelConfig(vocab_size=16, d_model=d, n_layer=1, n_head=4, max_seq_len=8, ffn="swiglu", d_ff=f)
    ffn = DecoderLM(cfg).blocks[0].ffn
    matrices = [p for p in ffn.parameters() if p.dim() == 2]
    assert sum(p.numel() for p in matrices) == 3 * d * f
    fused = next(p for p in matrices if p.shape == (2 * f, d))  # W_gate and W_up stacked: one matmul for both
    x = torch.randn(2, 3, d)
    assert ffn(x).abs().max() > 0
    for half in (slice(0, f), slice(f, 2 * f)):
        kept = fused[half].clone()
        fused[half] = 0
        assert ffn(x).abs().max() == 0
        fused[half] = kept
