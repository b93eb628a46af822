"""Mixture of experts: routing and dispatch against a per-token loop, the balancing loss against the
published formula, counting, and a tiny MoE that learns."""

from __future__ import annotations

import pytest
import torch

from tinyformer.components.moe import MoE, balance_loss, route, z_loss
from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError


def moe_cfg(**overrides) -> ModelConfig:
    fields = dict(vocab_size=64, d_model=16, n_layer=2, n_head=2, d_ff=24, max_seq_len=32, ffn="moe", n_experts=4,
                  experts_per_token=2)
    fields.update(overrides)
    return ModelConfig(**fields)


def per_token_reference(layer: MoE, x: torch.Tensor, order: str, normalize: bool) -> torch.Tensor:
    """The formula one token at a time, in float64: sum over the chosen experts of g_i * SwiGLU_i(x)."""
    out = []
    for t in x.reshape(-1, x.shape[-1]).double():
        r = layer.router.weight.double() @ t
        if order == "topk_softmax":
            top, idx = r.topk(layer.k)
            g = torch.exp(top - top.max()) / torch.exp(top - top.max()).sum()
        else:
            p = torch.exp(r - r.max()) / torch.exp(r - r.max()).sum()
            g, idx = p.topk(layer.k)
            g = g / g.sum() if normalize else g
        y = torch.zeros_like(t)
        for gi, e in zip(g, idx.tolist()):
            w_gate, w_up = layer.gate_up[e].double().split(layer.d_ff)
            a = w_gate @ t
            y += gi * (layer.down[e].double() @ (a * torch.sigmoid(a) * (w_up @ t)))
        if layer.shared is not None:
            sg, su = layer.shared.gate_up.weight.double().split(layer.shared.d_ff)
            a = sg @ t
            y += layer.shared.down.weight.double() @ (a * torch.sigmoid(a) * (su @ t))
        out.append(y)
    return torch.stack(out).reshape(x.shape)


@pytest.mark.parametrize("order,normalize,shared", [("softmax_topk", True, 0), ("softmax_topk", False, 8),
                                                    ("topk_softmax", False, 0)])
@pytest.mark.parametrize("tokens", [1, 9])
def test_dispatch_equals_per_token_loop(order, normalize, shared, tokens):
    torch.manual_seed(0)
    layer = MoE(moe_cfg(router_order=order, router_norm_topk=normalize, shared_expert_d_ff=shared))
    layer.init_experts(0.3, 0.3)
    torch.nn.init.normal_(layer.router.weight, std=1.0)
    x = torch.randn(1, tokens, 16)
    want = per_token_reference(layer, x, order, normalize)
    torch.testing.assert_close(layer(x).double(), want, atol=1e-5, rtol=1e-5)
    # the gathered-weights dispatch of the compiled decode step, without its shared expert
    flat = x.reshape(-1, 16)
    weights, index = route(layer.router(flat), layer.k, order, normalize)
    shared_part = layer.shared(flat) if layer.shared is not None else 0.0
    torch.testing.assert_close((layer._gathered(flat, weights, index) + shared_part).double(), want.reshape(-1, 16),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tokens", [1, 2, 9, 40])
def test_dispatch_gradients_equal_per_token_loop(dtype, tokens):
    """Forward and gradients (input, router, experts, shared expert) of the dispatch against the float64 per-token
    formula: float32 takes the grouped matmul for many tokens, float64 the per-expert loop, a few tokens
    (tokens * k <= E) the direct path that runs only their chosen experts."""
    import copy

    torch.manual_seed(1)
    layer = MoE(moe_cfg(n_experts=8, shared_expert_d_ff=8)).to(dtype)
    layer.init_experts(0.3, 0.3)
    torch.nn.init.normal_(layer.router.weight, std=1.0)
    ref_layer = copy.deepcopy(layer).double()
    x = torch.randn(1, tokens, 16, dtype=dtype, requires_grad=True)
    x_ref = x.detach().double().requires_grad_()
    cotangent = torch.randn(1, tokens, 16, dtype=torch.float64)
    out = layer(x)
    want = per_token_reference(ref_layer, x_ref, layer.order, layer.normalize)
    (out.double() * cotangent).sum().backward()
    (want * cotangent).sum().backward()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out.double(), want, **tol)
    torch.testing.assert_close(x.grad.double(), x_ref.grad, **tol)
    for (name, p), p_ref in zip(layer.named_parameters(), ref_layer.parameters()):
        torch.testing.assert_close(p.grad.double(), p_ref.grad, **tol, msg=name)


def test_grouped_matmul_is_used_only_where_it_applies():
    layer = MoE(moe_cfg(d_ff=24))
    assert layer._grouped_mm_applies(torch.zeros(2, 16))
    assert not layer._grouped_mm_applies(torch.zeros(2, 16, dtype=torch.float64))
    assert not MoE(moe_cfg(d_ff=6))._grouped_mm_applies(torch.zeros(2, 16))  # rows of 24 bytes


def test_topk_softmax_equals_normalised_softmax_topk():
    logits = torch.randn(50, 8)
    g1, i1 = route(logits, 3, "topk_softmax", False)
    g2, i2 = route(logits, 3, "softmax_topk", True)
    assert torch.equal(i1, i2)
    torch.testing.assert_close(g1, g2)


def test_balancing_loss_equals_the_switch_formula_on_hand_made_router_outputs():
    # 4 rows, 3 experts, top-1. Row choices: 0, 0, 1, 2 -> f = (2/4, 1/4, 1/4)
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6]]))
    P = torch.tensor([0.7 + 0.6 + 0.1 + 0.2, 0.2 + 0.3 + 0.8 + 0.2, 0.1 + 0.1 + 0.1 + 0.6]) / 4
    f = torch.tensor([2, 1, 1]) / 4
    torch.testing.assert_close(balance_loss(logits, 1), 3 * (f * P).sum())
    # top-2: f_e = fraction of rows with e among their two choices (row 3 ties e0 and e1; topk breaks the tie)
    chosen = torch.softmax(logits, -1).topk(2).indices
    f2 = torch.stack([(chosen == e).any(-1).float().mean() for e in range(3)])
    torch.testing.assert_close(balance_loss(logits, 2), 3 * (f2 * P).sum())
    # perfectly balanced routing (uniform probabilities, each expert chosen equally often): L = k
    uniform = torch.eye(4).repeat(2, 1) * 1e-6
    torch.testing.assert_close(balance_loss(uniform, 1), torch.tensor(1.0), atol=1e-5, rtol=0)
    torch.testing.assert_close(z_loss(logits), (torch.logsumexp(logits, -1) ** 2).mean())


def test_balancing_loss_equals_transformers_mixtral_aux_loss():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    layers = tuple(torch.randn(30, 6) for _ in range(3))
    torch.testing.assert_close(balance_loss(torch.cat(layers), 2), load_balancing_loss_func(layers, 6, 2))
    assert transformers  # imported for its loss function


def test_moe_fields_are_validated():
    with pytest.raises(ConfigError, match="experts_per_token must be in"):
        moe_cfg(experts_per_token=5)
    with pytest.raises(ConfigError, match="n_experts >= 1"):
        moe_cfg(n_experts=0)
    with pytest.raises(ConfigError, match="router_order='top1' is not one of"):
        moe_cfg(router_order="top1")
    with pytest.raises(ConfigError, match="ffn is not 'moe'"):
        ModelConfig(n_experts=4)


@pytest.mark.parametrize("shared", [0, 8])
def test_count_equals_meta_model_and_active_params_follow_k(shared):
    from tinyformer.models import build_model
    from tinyformer.sizing import count_params, sizing_report

    cfg = moe_cfg(shared_expert_d_ff=shared, tie_embeddings=False)
    with torch.device("meta"):
        model = build_model(cfg)
    assert count_params(cfg).total == sum(p.numel() for p in model.parameters())
    report = sizing_report(cfg, seq_len=32)
    expert = 3 * 16 * 24
    assert report["total_params"] - report["active_params"] == cfg.n_layer * (4 - 2) * expert
    dense = sizing_report(cfg.replace(ffn="swiglu", n_experts=0, shared_expert_d_ff=0, d_ff=2 * 24 + shared),
                          seq_len=32)
    router = cfg.n_layer * 16 * 4
    # a MoE token costs what a dense model with the active width costs, plus the router
    assert report["active_params"] == dense["total_params"] + router
    assert report["training_flops_per_token"] == dense["training_flops_per_token"] + 6 * router


def test_tiny_moe_trains_on_the_builtin_corpus_and_logs_the_balancing_loss(tmp_path, monkeypatch):
    from tinyformer.cli.main import main
    from tinyformer.run_folder import load_config
    from tinyformer.training.metrics import read_metrics

    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    try:
        assert main(["train", "--preset", "moe", "--model.d_model", "32", "--model.n_layer", "1",
                     "--model.n_head", "2", "--model.n_kv_head", "2", "--model.d_ff", "32", "--model.n_experts", "4",
                     "--model.max_seq_len", "32", "--batch-size", "8", "--block-size", "32", "--threads", "1",
                     "--tokenizer", "char", "--steps", "60", "--lr", "1e-2", "--warmup-steps", "5",
                     "--eval-interval", "30", "--eval-iters", "2", "--sample-tokens", "0", "--log-interval", "10",
                     "--no-progress", "--out", str(tmp_path / "run")]) == 0
    finally:
        torch.set_num_threads(threads)
    cfg = load_config(tmp_path / "run")
    assert (cfg.ffn, cfg.n_experts, cfg.experts_per_token) == ("moe", 4, 2)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    # logged balancing loss: E sum f_e P_e lies in [k, E] (k when balanced, E when all rows pick the same k)
    assert all(2 - 1e-4 <= r["moe_balance"] <= 4 + 1e-4 and r["moe_z"] > 0 for r in train)


@pytest.mark.slow
def test_compiled_decode_step_of_a_moe_equals_eager():
    from test_engine import PROMPTS, id_generator, random_lm

    from tinyformer.generation.sampling import SamplingParams

    model = random_lm(dtype=torch.float32, ffn="moe", n_experts=4, experts_per_token=2, d_ff=32)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    want = [r.token_ids for r in id_generator(model).generate(PROMPTS, params)]
    assert [r.token_ids for r in id_generator(model, compile=True).generate(PROMPTS, params)] == want


MOE_CASES = {
    # every layer slides (window 6 < prompt 24)
    "mixtral-window": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=6)),
    "qwen3-moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                    norm_topk_prob=False)),
    "qwen3-moe-norm-window": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                                norm_topk_prob=True, use_sliding_window=True, sliding_window=6)),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_import_matches_transformers(case, tmp_path):
    from test_interop_common import assert_import_matches_transformers

    from tinyformer.run_folder import load_config

    kind, overrides = MOE_CASES[case]
    hf, ours = assert_import_matches_transformers(kind, tmp_path, length=24, **overrides)
    cfg = load_config(tmp_path / "run")
    assert (cfg.ffn, cfg.n_experts, cfg.experts_per_token) == ("moe", 4, 2)
    assert cfg.router_norm_topk == (kind == "mixtral" or overrides["norm_topk_prob"])
    # training-mode balancing loss equals transformers' aux_loss (its router logits, its formula)
    ids = torch.randint(3, 320, (2, 12))
    hf.config.output_router_logits = True
    ours.train()
    ours.loss(ids[:, :-1], ids[:, 1:])
    with torch.no_grad():
        out = hf(input_ids=ids[:, :-1], output_router_logits=True)
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.testing.assert_close(ours.last_moe_losses["moe_balance"],
                               load_balancing_loss_func(out.router_logits, 4, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fields", [dict(router_order="topk_softmax"),
                                    dict(qk_norm=True, router_norm_topk=False, attn_bias=True)])
def test_native_moe_exports_to_transformers(fields, tmp_path):
    transformers = pytest.importorskip("transformers")
    from test_interop_common import hf_logits, padded_batch

    from tinyformer.interop.hf_folder import export_hf
    from tinyformer.models.decoder import DecoderLM
    from tinyformer.run_folder import save_model

    torch.manual_seed(0)
    model = DecoderLM(moe_cfg(vocab_size=320, d_model=32, n_head=4, n_kv_head=2, **fields)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router" in name:
                p.normal_(0.0, 1.0)
            elif name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    save_model(tmp_path / "run", model)
    export_hf(tmp_path / "run", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    assert type(hf).__name__ == ("Qwen3MoeForCausalLM" if fields.get("qk_norm") else "MixtralForCausalLM")
    ids, mask = padded_batch()
    with torch.no_grad():
        ours = model(ids, attention_mask=mask)
    torch.testing.assert_close(ours[mask.bool()], hf_logits(hf, ids, mask)[mask.bool()], atol=1e-4, rtol=1e-4)


class _Wrapper(torch.nn.Module):
    """Stands for a wrapper that calls the module it holds under ``attr`` (DDP: ``module``; a compiled
    module: ``_orig_mod``)."""

    def __init__(self, inner: torch.nn.Module, attr: str) -> None:
        super().__init__()
        setattr(self, attr, inner)
        self.attr = attr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.attr)(x)


def test_a_moe_loss_through_a_compiled_ddp_wrapper_keeps_the_router_losses():
    """torchrun with --compile trains compiled(DDP(model)): the loss must still add the balancing and z
    losses that DecoderLM.loss adds (the model found through both wrappers, not only the outer one)."""
    from tinyformer.models.decoder import DecoderLM
    from tinyformer.training.objectives.lm import lm_loss

    torch.manual_seed(0)
    model = DecoderLM(moe_cfg(router_aux_loss_coef=0.5, router_z_loss_coef=0.1)).train()
    ids = torch.randint(0, 64, (2, 12))
    targets = torch.randint(0, 64, (2, 12))
    wrapped = _Wrapper(_Wrapper(model, "module"), "_orig_mod")
    assert lm_loss(wrapped, ids, targets).item() == pytest.approx(model.loss(ids, targets).item(), rel=1e-6)
