"""The fast paths of a fine-tuning step compute the unoptimised step: same loss, same gradients.

Each fast path (masked rows skipping the head, the fused silu * up gradient, LoRA's update added inside
the base GEMM) is compared with a float64 reference written out from the formula, with the plain ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tinyformer.components import loss as loss_mod
from tinyformer.components.ffn import SwiGLU, silu_mul
from tinyformer.components.lora import LoRAConfig, apply_lora
from tinyformer.components.loss import linear_cross_entropy
from tinyformer.config import ModelConfig
from tinyformer.models.decoder import DecoderLM


def _sft_targets(b: int, t: int, vocab: int, prompt: int) -> torch.Tensor:
    """Targets of an SFT batch: the first ``prompt`` positions of each row (the prompt) are ignored."""
    y = torch.randint(0, vocab, (b, t))
    y[:, :prompt] = -100
    return y


@pytest.mark.parametrize("chunk", [2**23, 5 * 40])
def test_masked_rows_skipping_the_head_give_the_full_logits_loss_and_gradients(chunk, monkeypatch):
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", chunk)
    torch.manual_seed(1)
    h = torch.randn(3, 20, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 8, dtype=torch.float64, requires_grad=True)
    y = _sft_targets(3, 20, 40, prompt=7)
    y[1, 15] = -100  # a masked position inside the answer too
    ours = linear_cross_entropy(h, w, y)
    g = torch.autograd.grad(ours * 1.7, (h, w))
    logits = (h @ w.T).reshape(-1, 40)  # every position through the head, as an unfused step does
    ref = F.cross_entropy(logits, y.reshape(-1), ignore_index=-100)
    r = torch.autograd.grad(ref * 1.7, (h, w))
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(g, r):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert g[0][:, :7].abs().max() == 0 and g[0][1, 15].abs().max() == 0


def test_all_targets_ignored_gives_zero_loss_and_zero_gradients():
    h = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    out = linear_cross_entropy(h, w, torch.full((4,), -100))
    gh, gw = torch.autograd.grad(out, (h, w))
    assert out.item() == 0 and gh.abs().max() == 0 and gw.abs().max() == 0


def test_equal_chunks_cover_every_row_once(monkeypatch):
    """The rows are cut into equal chunks (no small remainder chunk): every row is still counted once."""
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMENTS", 3 * 10)  # 3 rows per chunk at most, 11 rows -> 4 chunks
    h = torch.randn(11, 4, dtype=torch.float64)
    w = torch.randn(10, 4, dtype=torch.float64)
    y = torch.randint(0, 10, (11,))
    torch.testing.assert_close(linear_cross_entropy(h, w, y), F.cross_entropy(h @ w.T, y), rtol=1e-12, atol=0)


def test_fused_silu_mul_gradient_equals_the_unfused_ops_float64():
    torch.manual_seed(2)
    gu = (torch.randn(2, 5, 12, dtype=torch.float64) * 3).requires_grad_()
    grad = torch.randn(2, 5, 6, dtype=torch.float64)
    ours = silu_mul(gu, 6)
    (g,) = torch.autograd.grad(ours, gu, grad)
    gate, up = gu[..., :6], gu[..., 6:]
    ref = gate * torch.sigmoid(gate) * up  # silu written out
    (r,) = torch.autograd.grad(ref, gu, grad)
    torch.testing.assert_close(ours, ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: silu_mul(t, 6), (gu[:1, :2].detach().clone().requires_grad_(),))


def test_swiglu_layer_gradients_equal_the_unfused_formula_float64():
    torch.manual_seed(3)
    ffn = SwiGLU(8, 12).double()
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    params = [x, *ffn.parameters()]
    g = torch.autograd.grad(ffn(x).square().sum(), params)
    w_gate, w_up = ffn.gate_up.weight[:12], ffn.gate_up.weight[12:]
    ref = (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ ffn.down.weight.T
    r = torch.autograd.grad(ref.square().sum(), params)
    for a, b in zip(g, r):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


def _model(bias: bool = False) -> DecoderLM:
    cfg = ModelConfig(vocab_size=53, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=48, max_seq_len=32,
                      norm="rmsnorm", pos="rope", ffn="swiglu", tie_embeddings=True, attn_bias=bias)
    return DecoderLM(cfg).double()


@pytest.mark.parametrize("targets,bias", [(("q", "k", "v", "o", "gate", "up", "down"), False),
                                          (("q", "v", "up"), True)])  # gaps between adapted row blocks
def test_lora_step_loss_and_gradients_equal_the_formula_float64(targets, bias):
    """W x + b + (alpha / r) B_s A_s x per row block, written out with plain matmuls on a copy of the base."""
    torch.manual_seed(4)
    model = _model(bias)
    ref_model = _model(bias)
    ref_model.load_state_dict(model.state_dict())
    apply_lora(model, LoRAConfig(4, alpha=6.0, targets=targets))
    with torch.no_grad():  # B starts at zero; give it values so that the update is not zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    x = torch.randint(0, 53, (2, 16))
    y = _sft_targets(2, 16, 53, prompt=5)
    loss = model.loss(x, y)
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = dict(zip(adapters, torch.autograd.grad(loss, list(adapters.values()))))

    # reference: the same adapter tensors (leaf copies), applied by hand through forward hooks on the base
    leaves = {n: p.detach().clone().requires_grad_() for n, p in adapters.items()}
    scale = 6.0 / 4
    hooks = []
    for lname, layer in model.named_modules():
        if not hasattr(layer, "segments"):
            continue
        base = ref_model.get_submodule(lname)

        def hook(mod, inp, out, lname=lname, segments=layer.segments):
            extra = torch.zeros_like(out)
            for tname, start, stop in segments:
                a, b = leaves[f"{lname}.lora_A.{tname}"], leaves[f"{lname}.lora_B.{tname}"]
                extra = extra + F.pad(scale * inp[0] @ a.T @ b.T, (start, out.shape[-1] - stop))
            return out + extra

        hooks.append(base.register_forward_hook(hook))
    ref_model.requires_grad_(False)
    logits = ref_model(x)
    ref = F.cross_entropy(logits.reshape(-1, 53), y.reshape(-1), ignore_index=-100)
    ref_grads = dict(zip(leaves, torch.autograd.grad(ref, list(leaves.values()))))
    for h in hooks:
        h.remove()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    for n in adapters:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-10, atol=1e-12)


def test_frozen_base_weights_get_no_gradient_under_lora():
    model = _model()
    apply_lora(model, LoRAConfig(4))
    x = torch.randint(0, 53, (1, 8))
    model.loss(x, _sft_targets(1, 8, 53, prompt=2)).backward()
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def test_softcapped_head_with_masked_rows_gives_the_full_logits_loss_and_gradients():
    cfg = ModelConfig(vocab_size=41, d_model=16, n_layer=1, n_head=2, max_seq_len=16, tie_embeddings=True,
                      final_logit_softcap=5.0)
    model = DecoderLM(cfg).double()
    x = torch.randint(0, 41, (2, 10))
    y = _sft_targets(2, 10, 41, prompt=4)
    ours = model.loss(x, y)
    g = torch.autograd.grad(ours, list(model.parameters()))
    ref = F.cross_entropy(model(x).reshape(-1, 41), y.reshape(-1), ignore_index=-100)
    r = torch.autograd.grad(ref, list(model.parameters()))
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(g, r):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
