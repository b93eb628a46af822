import pytest
import torch
import torch.nn.functional as F

from tinyformer.components import loss as loss_mod
from tinyformer.components.loss import linear_cross_entropy


@pytest.mark.parametrize("chunk", [2**23, 7 * 50])  # one chunk, and several uneven chunks
def test_fused_linear_cross_entropy_equals_unfused_float64(chunk, monkeypatch):
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", chunk)
    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 50, (37,))
    y[[3, 10, 11]] = -100  # ignored positions
    ours = linear_cross_entropy(h, w, y)
    (g_h, g_w) = torch.autograd.grad(ours * 2.5, (h, w))
    ref = F.cross_entropy(h @ w.T, y, ignore_index=-100)
    (r_h, r_w) = torch.autograd.grad(ref * 2.5, (h, w))
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_h, r_h, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_w, r_w, rtol=1e-10, atol=1e-12)
    assert g_h[3].abs().max() == 0  # an ignored row gets no gradient


def test_model_loss_gradients_equal_unfused_head_with_tied_weights():
    from tinyformer.config import ModelConfig
    from tinyformer.models.decoder import DecoderLM

    cfg = ModelConfig(vocab_size=61, d_model=32, n_layer=1, n_head=4, max_seq_len=16, tie_embeddings=True)
    model = DecoderLM(cfg).double()
    x, y = torch.randint(0, 61, (2, 12)), torch.randint(0, 61, (2, 12))
    fused = model.loss(x, y)
    g1 = torch.autograd.grad(fused, list(model.parameters()))
    logits = model(x)
    plain = F.cross_entropy(logits.view(-1, 61), y.view(-1))
    g2 = torch.autograd.grad(plain, list(model.parameters()))
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_loss_without_grad_does_not_allocate_gradients():
    h, w, y = torch.randn(8, 4), torch.randn(10, 4), torch.randint(0, 10, (8,))
    with torch.no_grad():
        out = linear_cross_entropy(h, w, y)
    torch.testing.assert_close(out, F.cross_entropy(h @ w.T, y))


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_with_a_frozen_input_the_other_gradient_is_still_exact(frozen):
    """A frozen head (LoRA) skips the weight gradient; the hidden-state gradient stays exact (float64)."""
    torch.manual_seed(0)
    h = torch.randn(9, 6, dtype=torch.float64, requires_grad=frozen != "hidden")
    w = torch.randn(11, 6, dtype=torch.float64, requires_grad=frozen != "weight")
    y = torch.randint(0, 11, (9,))
    live = h if frozen == "weight" else w
    (ours,) = torch.autograd.grad(linear_cross_entropy(h, w, y), live)
    (ref,) = torch.autograd.grad(F.cross_entropy(h @ w.T, y), live)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)


def test_chunks_share_two_logit_buffers_whatever_their_number(monkeypatch):
    """Six chunks allocate one (rows, vocab) logits buffer and one log-softmax buffer, not two per chunk: a fresh
    buffer per chunk is a fresh mapping at real sizes, whose page faults slowed the head's GEMM."""
    from torch.profiler import ProfilerActivity, profile

    vocab, rows = 1000, 4
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", rows * vocab)
    h = torch.randn(6 * rows, 8, requires_grad=True)
    w, y = torch.randn(vocab, 8), torch.randint(0, vocab, (6 * rows,))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = linear_cross_entropy(h, w, y)
    chunk_bytes = rows * vocab * 4
    big = [e.name for e in prof.events() if e.self_cpu_memory_usage >= chunk_bytes]
    assert len(big) == 2, big
    torch.testing.assert_close(out, F.cross_entropy(h @ w.T, y), rtol=1e-5, atol=1e-6)
