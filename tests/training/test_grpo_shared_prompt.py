"""GRPO's shared-prompt forward (``shared_prompt_logps``, components/kv_cache.py ``SharedPrefix``): each distinct
prompt runs once and its G completions attend its keys and values. The per-token log-probs, the GRPO loss and
the LoRA gradients equal those of the plain forward over the full rows (prompt + completion), in float64, with
GQA, prompts of different lengths (one of a single token, one drawn twice), completions of different lengths,
and the model variants whose masks or positions differ (sliding windows, learned positions, QK-norm)."""

from __future__ import annotations

import pytest
import torch

from tinyformer.components.lora import LoRAConfig, apply_lora, is_adapter_key
from tinyformer.models import build_model
from tinyformer.presets import get_preset
from tinyformer.training.objectives.grpo import IGNORE, _rows_batch, grpo_loss, shared_prompt_logps, token_logps

pytestmark = pytest.mark.usefixtures("one_thread")

VARIANTS = {
    "rope-gqa": {},
    "sliding-learned": {"pos": "learned", "sliding_window": 4, "layer_types": ["sliding", "full"]},
    "qk-norm-mqa": {"qk_norm": True, "n_kv_head": 1},
}


def lora_model(**overrides: object) -> torch.nn.Module:
    """A random 2-layer float64 decoder with GQA (4 query heads, 2 key/value heads) and LoRA adapters whose B is
    random too (at B = 0 the adapters' A would get no gradient)."""
    cfg = get_preset("tiny", **{"d_model": 32, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_ff": 64,
                                "max_seq_len": 64, "vocab_size": 50, **overrides})
    torch.manual_seed(0)
    model = build_model(cfg).double()
    apply_lora(model, LoRAConfig(rank=4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1)
    return model.eval()


def made_up_rows(g: torch.Generator) -> list[tuple[list[int], list[int], list[float]]]:
    """Rows (prompt, completion, sampling log-probs): groups of 3, 1, 2 and 3 completions of prompts of 7, 1,
    4 and again 7 tokens (the first prompt drawn twice), completions of 1 to 6 tokens."""
    prompts = [torch.randint(1, 50, (n,), generator=g).tolist() for n in (7, 1, 4)]
    rows = []
    for p, n_rows in zip([prompts[0], prompts[1], prompts[2], prompts[0]], (3, 1, 2, 3)):
        for _ in range(n_rows):
            c = torch.randint(1, 50, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
            rows.append((p, c, (-torch.rand(len(c), generator=g, dtype=torch.float64) * 4).tolist()))
    return rows


def full_rows_logps(model: torch.nn.Module, rows: list, temperature: float) -> torch.Tensor:
    """The plain forward over each row written out in full, p + c[:-1], right-padded: the completion tokens'
    log-probs, one row per completion, right-padded with 0 to the longest completion (the shared layout)."""
    T = max(len(p) + len(c) - 1 for p, c, _ in rows)
    input_ids = torch.zeros(len(rows), T, dtype=torch.long)
    targets = torch.full((len(rows), T), IGNORE)
    for i, (p, c, _) in enumerate(rows):
        ids = (p + c)[:-1]
        input_ids[i, : len(ids)] = torch.tensor(ids)
        targets[i, len(p) - 1 : len(p) - 1 + len(c)] = torch.tensor(c)
    full = token_logps(model, input_ids, targets, temperature)
    out = torch.zeros(len(rows), max(len(c) for _, c, _ in rows), dtype=full.dtype)
    return out.masked_scatter(out.new_ones(out.shape).cumsum(1) <= torch.tensor([[len(c)] for _, c, _ in rows]),
                              full[targets != IGNORE])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_shared_prompt_logps_loss_and_lora_gradients_equal_the_full_rows(variant: str) -> None:
    model = lora_model(**VARIANTS[variant])
    g = torch.Generator().manual_seed(1)
    rows = made_up_rows(g)
    batch = _rows_batch(rows, pad_id=0)
    assert batch["prompt_ids"].shape == (3, 6) and batch["group"].tolist() == [0] * 3 + [1] + [2] * 2 + [0] * 3
    mask = batch["targets"] != IGNORE
    old = batch["old_logps"].double()
    ref = old + (torch.rand(old.shape, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.randn(len(rows), generator=g, dtype=torch.float64)

    results = []
    for logps_of in (lambda: full_rows_logps(model, rows, 0.7), lambda: shared_prompt_logps(model, batch, 0.7)):
        model.zero_grad(set_to_none=True)
        logps = logps_of()
        loss, _ = grpo_loss(logps, old, ref, adv, mask, clip_eps=0.2, beta=0.04)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logps.detach(), loss.detach(), grads))
    (full, full_loss, full_grads), (shared, shared_loss, shared_grads) = results

    assert shared.shape == mask.shape and (shared[~mask] == 0).all()
    torch.testing.assert_close(shared, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(shared_loss, full_loss, rtol=0, atol=1e-12)
    assert set(shared_grads) == set(full_grads) and shared_grads and all(map(is_adapter_key, shared_grads))
    for name, grad in full_grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-9, atol=1e-12, msg=name)
