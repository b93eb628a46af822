"""``train.compile``: the training loss compiled whole (training/trainer.py ``compiled_loss``) is one graph with
no break, trains exactly as the eager loss does, and without a C++ compiler a CPU run trains eagerly.

The compiler backend here is ``aot_eager`` (dynamo's tracing and AOT autograd's forward/backward split, the
ops run by eager torch): it proves the graph and the gradients without inductor's C++ build, which takes
tens of seconds; inductor itself is what benchmarks/bench_nanogpt_step.py runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tinyformer.components.loss import linear_cross_entropy
from tinyformer.config import ModelConfig
from tinyformer.training.objectives import Objective
from tinyformer.training.train_config import TrainConfig

MODEL = ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=16)
B, T = 4, 16


class RandomTokens(Objective):
    """Language modelling on random token sequences drawn from the trainer's data stream."""

    name = "random-tokens"
    uses_corpus = False

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg, None, None)  # type: ignore[arg-type]

    def get_batch(self, split, generator, rank=0, world_size=1):
        x = torch.randint(0, MODEL.vocab_size, (B, T + 1), generator=generator)
        targets = x[:, 1:].clone()
        targets[0, :5] = -100  # a masked prompt: ignored targets inside the compiled graph too
        return {"input_ids": x[:, :-1], "targets": targets}

    def loss(self, model, batch):
        return model.loss(batch["input_ids"], batch["targets"])


def make_trainer(run_dir: Path, **changes):
    from tinyformer.training.trainer import Trainer

    cfg = TrainConfig(**{**dict(batch_size=B, block_size=T, lr=1e-2, warmup_steps=1, device="cpu", dtype="float32",
                                threads=1, seed=7, log_interval=1, eval_interval=1000, sample_tokens=0,
                                tensorboard=False, progress=False, max_steps=3), **changes})
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer(MODEL, cfg, RandomTokens(cfg), run_dir)


@pytest.fixture
def aot_eager_whole_graph(monkeypatch):
    """torch.compile as aot_eager with fullgraph=True: a graph break inside the compiled loss is an error."""
    real_compile = torch.compile
    compiled = []

    def compile_whole(fn, **kwargs):
        compiled.append(fn)
        return real_compile(fn, backend="aot_eager", fullgraph=True)

    monkeypatch.setattr(torch, "compile", compile_whole)
    return compiled


def test_the_compiled_training_loss_is_one_graph_and_trains_as_the_eager_loss(tmp_path, aot_eager_whole_graph):
    eager = make_trainer(tmp_path / "eager")
    compiled = make_trainer(tmp_path / "compiled", compile=True)
    assert eager.loss_fn == eager.objective.loss and len(aot_eager_whole_graph) == 1
    batch = eager.objective.get_batch("train", torch.Generator().manual_seed(1))
    eager.loss_fn(eager.train_model, batch).backward()
    compiled.loss_fn(compiled.train_model, batch).backward()
    for (name, p_e), p_c in zip(eager.model.named_parameters(), compiled.model.parameters()):
        torch.testing.assert_close(p_c.grad, p_e.grad, rtol=1e-4, atol=1e-6, msg=name)
        p_e.grad = p_c.grad = None
    for _ in range(3):
        loss_e, norm_e, _ = eager.train_step()
        loss_c, norm_c, _ = compiled.train_step()
        # the same batches and initial weights; the graph computes the plain head + cross-entropy and the math
        # backend's attention, which round differently from the fused eager kernels
        assert loss_c == pytest.approx(loss_e, rel=1e-5, abs=1e-6)
        assert norm_c == pytest.approx(norm_e, rel=1e-4)
    for (name, p_e), p_c in zip(eager.model.named_parameters(), compiled.model.parameters()):
        # Adam divides by the gradient's running scale: a rounding-size gradient moves a weight by up to lr
        torch.testing.assert_close(p_c, p_e, rtol=0, atol=3e-3, msg=name)


def test_without_a_cpp_compiler_a_cpu_run_trains_eagerly_and_says_so(tmp_path, monkeypatch):
    import tinyformer.generation.engine as engine

    monkeypatch.setattr(engine, "cpp_compiler", lambda: None)
    trainer = make_trainer(tmp_path / "run", compile=True)
    assert trainer.loss_fn == trainer.objective.loss
    assert "no C++ compiler" in trainer.compile_skipped
    trainer.fit()  # no warm-up compile: the eager steps run
    assert trainer.step == 3


@pytest.mark.parametrize("ignored", ["some", "all"])
def test_linear_cross_entropy_under_compile_is_the_plain_formula_with_its_gradients(ignored):
    torch.manual_seed(0)
    h = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    targets[0, :2] = -100
    if ignored == "all":
        targets[:] = -100
    loss = torch.compile(linear_cross_entropy, backend="aot_eager", fullgraph=True)(h, w, targets)
    grads = torch.autograd.grad(loss, (h, w))
    keep = targets.flatten() != -100
    logits = (h.detach().reshape(-1, 8) @ w.detach().T)[keep]  # float64 reference over the kept rows
    ref = -(logits.log_softmax(-1).gather(1, targets.flatten()[keep][:, None])).sum() / max(int(keep.sum()), 1)
    torch.testing.assert_close(loss, ref)
    ref_grads = torch.autograd.grad(F.cross_entropy(h.reshape(-1, 8) @ w.T, targets.flatten(), reduction="sum")
                                    / max(int(keep.sum()), 1), (h, w))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
