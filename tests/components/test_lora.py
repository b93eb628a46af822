"""LoRA: the adapter formula, frozen base, merge, PEFT export checked against peft, and LoRA runs end to end."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from test_checkpoint import assert_same_optimizer_moments, sigkill_after_first_checkpoint

from tinyformer.cli.main import main
from tinyformer.components.lora import (
    TARGETS,
    LoRAConfig,
    LoRALinear,
    adapter_state_dict,
    apply_lora,
    has_lora,
    lora_disabled,
    merge_lora,
    trainable_share,
)
from tinyformer.errors import ConfigError
from tinyformer.models import build_model
from tinyformer.presets import get_preset
from tinyformer.run_folder import load_model, save_adapter_run, save_model
from tinyformer.training.optim import build_optimizer
from tinyformer.training.train_config import TrainConfig

# a Llama shape with grouped K/V heads, so q, k and v blocks of the fused qkv matrix differ in size
CFG = get_preset("tiny", d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=48, vocab_size=61, max_seq_len=32)


def _model() -> torch.nn.Module:
    return build_model(CFG).eval()


def _randomise_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, value in adapter_state_dict(model).items():
            value.copy_(torch.randn(value.shape, generator=g) * 0.2)


@pytest.mark.parametrize("kwargs", [dict(rank=0), dict(rank=2.5), dict(rank=4, alpha=-1.0),
                                    dict(rank=4, dropout=1.0), dict(rank=4, targets=("q", "wq")),
                                    dict(rank=4, targets=()), dict(rank=4, targets=("q", "q"))])
def test_bad_lora_settings_are_config_errors(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match="LoRA"):
        LoRAConfig(**kwargs)


def test_alpha_defaults_to_rank_and_targets_parse_from_text() -> None:
    cfg = LoRAConfig(8, targets="q, v")
    assert cfg.scale == 1.0 and cfg.targets == ("q", "v")
    assert LoRAConfig(8, alpha=16).scale == 2.0


def test_at_step_0_the_logits_equal_the_base_exactly(one_thread) -> None:
    model = _model()
    x = torch.randint(0, CFG.vocab_size, (2, 12))
    base = model(x)
    apply_lora(model, LoRAConfig(4, dropout=0.1))
    assert has_lora(model)
    assert torch.equal(model(x), base)


@pytest.mark.parametrize("target", TARGETS)
def test_each_target_adds_scale_B_A_x_to_its_own_rows(target: str, one_thread) -> None:
    """Against the formula in float64: W_eff = W with rows s replaced by W_s + (alpha/r) B_s A_s."""
    model = _model()
    base = copy.deepcopy(model)
    apply_lora(model, LoRAConfig(3, alpha=6.0, targets=(target,)))
    _randomise_adapters(model)
    q, kv, f = CFG.n_head * CFG.head_dim, CFG.n_kv_head * CFG.head_dim, CFG.d_ff
    where = {"q": ("attn.qkv", 0, q), "k": ("attn.qkv", q, q + kv), "v": ("attn.qkv", q + kv, q + 2 * kv),
             "o": ("attn.out", 0, CFG.d_model), "gate": ("ffn.gate_up", 0, f), "up": ("ffn.gate_up", f, 2 * f),
             "down": ("ffn.down", 0, CFG.d_model)}[target]
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    for i in range(CFG.n_layer):
        layer = model.get_submodule(f"blocks.{i}.{where[0]}")
        assert isinstance(layer, LoRALinear)
        w = base.get_submodule(f"blocks.{i}.{where[0]}").weight.double().clone()
        a, b = layer.lora_A[target].double(), layer.lora_B[target].double()
        w[where[1]:where[2]] += 2.0 * b @ a
        xi = x[..., :w.shape[1]]
        torch.testing.assert_close(layer(xi.float()).double(), xi @ w.T, rtol=0, atol=1e-5)
    others = [m for n, m in model.named_modules() if isinstance(m, LoRALinear) and where[0] not in n]
    assert not others


def test_lora_disabled_computes_the_base_and_restores_the_adapters(one_thread) -> None:
    model = _model()
    x = torch.randint(0, CFG.vocab_size, (2, 12))
    base = model(x)
    apply_lora(model, LoRAConfig(4))
    _randomise_adapters(model)
    adapted = model(x)
    assert not torch.allclose(adapted, base)
    with lora_disabled(model):
        assert torch.equal(model(x), base)
    assert torch.equal(model(x), adapted)


def _train_a_few_steps(model: torch.nn.Module, steps: int = 5) -> torch.optim.Optimizer:
    opt = build_optimizer(model, TrainConfig(lr=3e-2), "cpu")
    g = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        x = torch.randint(0, CFG.vocab_size, (4, 16), generator=g)
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    return opt


def test_only_the_adapters_get_gradients_and_sit_in_the_optimizer(one_thread) -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, LoRAConfig(4, targets=("q", "v", "down")))
    adapters = {id(p) for n, p in model.named_parameters() if ".lora_" in n}
    opt = build_optimizer(model, TrainConfig(), "cpu")
    assert {id(p) for g in opt.param_groups for p in g["params"]} == adapters
    x = torch.randint(0, CFG.vocab_size, (2, 9))
    model.loss(x[:, :-1], x[:, 1:]).backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (".lora_" in name), name
    # training moves the adapters only: every base tensor keeps its values
    _train_a_few_steps(model)
    for key, value in before.items():
        assert torch.equal(model.state_dict()[key], value), key


def test_merged_logits_equal_the_unmerged_after_training(one_thread) -> None:
    model = _model()
    apply_lora(model, LoRAConfig(4, alpha=8.0))
    _train_a_few_steps(model)
    assert any(v.abs().max() > 0 for k, v in adapter_state_dict(model).items() if "lora_B" in k)
    x = torch.randint(0, CFG.vocab_size, (2, 16))
    unmerged = model(x)
    merge_lora(model)
    assert not has_lora(model)
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
    torch.testing.assert_close(model(x), unmerged, rtol=0, atol=1e-5)


def test_rank_8_trains_under_2_percent_of_a_100m_model() -> None:
    with torch.device("meta"):
        model = build_model(get_preset("llama-110m"))
    total_before = sum(p.numel() for p in model.parameters())
    apply_lora(model, LoRAConfig(8))
    trainable, total = trainable_share(model)
    c = model.cfg
    q, kv = c.n_head * c.head_dim, c.n_kv_head * c.head_dim
    # r (in + out) per adapted projection: q, k, v, o, gate, up, down
    per_layer = 8 * ((c.d_model + q) + 2 * (c.d_model + kv) + (q + c.d_model) + 2 * (c.d_model + c.d_ff)
                     + (c.d_ff + c.d_model))
    assert trainable == c.n_layer * per_layer
    assert total == total_before + trainable
    assert total_before > 100e6 and trainable / total < 0.02


# ---------------------------------------------------------------------------- PEFT export, against peft itself


def test_peft_export_loaded_by_peft_onto_the_hf_export_gives_the_same_logits(tmp_path: Path, one_thread) -> None:
    pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from peft import PeftModel

    from tinyformer.interop.hf_folder import export_hf
    from tinyformer.interop.peft import export_peft

    model = _model()
    save_model(tmp_path / "base", model)
    apply_lora(model, LoRAConfig(4, alpha=8.0, targets=TARGETS))
    _randomise_adapters(model)
    save_adapter_run(tmp_path / "lora", model, tmp_path / "base")
    export_hf(tmp_path / "base", tmp_path / "hf")
    export_peft(tmp_path / "lora", tmp_path / "peft")

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    x = torch.randint(0, CFG.vocab_size, (2, 14))
    with torch.no_grad():
        want = model(x)
        got = peft_model(input_ids=x).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        with peft_model.disable_adapter():  # the adapter matters: without it the logits are the base's
            assert (peft_model(input_ids=x).logits - got).abs().max() > 1e-2
        torch.testing.assert_close(load_model(tmp_path / "lora")(x), want, rtol=0, atol=1e-5)


def test_a_corrupt_adapter_file_is_one_checkpoint_error_for_the_peft_export(tmp_path: Path) -> None:
    from tinyformer.errors import CheckpointError
    from tinyformer.interop.peft import export_peft

    model = _model()
    save_model(tmp_path / "base", model)
    apply_lora(model, LoRAConfig(4, alpha=8.0, targets=TARGETS))
    save_adapter_run(tmp_path / "lora", model, tmp_path / "base")
    (tmp_path / "lora" / "adapter.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=r"adapter\.safetensors is not a readable safetensors file"):
        export_peft(tmp_path / "lora", tmp_path / "peft")
    assert not (tmp_path / "peft").exists()


# ---------------------------------------------------------------------------- LoRA runs end to end

TINY = ["--model.d_model", "32", "--model.n_layer", "1", "--model.n_head", "2", "--model.n_kv_head", "1",
        "--model.d_ff", "64", "--model.max_seq_len", "32", "--threads", "1", "--batch-size", "4",
        "--block-size", "32", "--warmup-steps", "2", "--eval-iters", "2", "--sample-tokens", "8", "--no-progress"]


@pytest.fixture
def corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    lines = [f"The {a} cat sat on the {b} mat, and the dog ran {c}.\n" for a in ("big", "small", "red", "old")
             for b in ("blue", "green", "warm") for c in ("away", "home", "fast", "far", "out")]
    path = tmp_path / "corpus.txt"
    path.write_text("".join(lines * 6), encoding="utf-8")
    yield path
    torch.set_num_threads(threads)


def test_a_lora_run_stores_only_its_adapter_and_commands_load_base_plus_adapter(
        corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, lora = tmp_path / "base", tmp_path / "lora"
    assert main(["train", *TINY, "--data", str(corpus), "--tokenizer", "char", "--out", str(base), "--steps", "4"]) == 0
    assert main(["train", "--data", str(corpus), "--init-from", str(base), "--lora-rank", "2", "--lora-alpha", "4",
                 "--lora-targets", "q,v,down", "--out", str(lora), "--steps", "6", "--lr", "3e-2",
                 "--warmup-steps", "1", "--threads", "1", "--batch-size", "4", "--no-progress",
                 "--sample-tokens", "0"]) == 0
    out = capsys.readouterr().out
    assert "LoRA rank 2 (alpha 4) on q,v,down" in out and "trainable parameters of" in out
    assert (lora / "adapter.safetensors").is_file() and (lora / "adapter_config.json").is_file()
    assert not (lora / "model.safetensors").exists()
    assert (lora / "adapter.safetensors").stat().st_size < (base / "model.safetensors").stat().st_size / 5

    # the loaded model is the base plus (alpha/r) B A: rebuild it by hand from the two folders
    from safetensors.torch import load_file

    adapter = load_file(str(lora / "adapter.safetensors"))
    want = load_model(base)
    with torch.no_grad():
        for key, b in adapter.items():
            if ".lora_B." not in key:
                continue
            module, target = key.split(".lora_B.")
            a = adapter[f"{module}.lora_A.{target}"]
            rows = {"q": (0, 32), "v": (48, 64), "down": (0, 32)}[target]
            want.get_submodule(module).weight[rows[0]:rows[1]] += 2.0 * b @ a
    got = load_model(lora)
    x = torch.randint(0, 20, (1, 10))
    torch.testing.assert_close(got(x), want(x), rtol=0, atol=1e-6)
    assert not torch.allclose(got(x), load_model(base)(x))  # the adapter learnt something

    assert main(["generate", "--model", str(lora), "--prompt", "The", "--max-new-tokens", "5", "--seed", "1"]) == 0
    assert main(["eval", "--model", str(lora), "--data", str(corpus)]) == 0
    merged = tmp_path / "merged"
    assert main(["convert", "--model", str(lora), "--merge-lora", "--out", str(merged)]) == 0
    assert (merged / "model.safetensors").is_file() and not (merged / "adapter_config.json").exists()
    torch.testing.assert_close(load_model(merged)(x), got(x), rtol=0, atol=0)


@pytest.mark.parametrize("args, message", [
    (["--lora-rank", "4"], "--init-from"),
    (["--lora-alpha", "4"], "apply with train.lora_rank"),
    (["--lora-rank", "4", "--lora-targets", "q,wq", "--init-from", "x"], "LoRA targets"),
    (["--lora-rank", "0", "--init-from", "x"], "lora_rank must be a positive integer"),
], ids=["no-init-from", "alpha-alone", "bad-target", "zero-rank"])
def test_bad_lora_flags_are_one_line_and_exit_2(args: list[str], message: str, corpus: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *TINY, "--data", str(corpus), "--out", str(corpus.parent / "r"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and message in err, err


def test_lora_run_cannot_be_exported_whole_to_hf(corpus: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    model = _model()
    save_model(tmp_path / "base", model)
    apply_lora(model, LoRAConfig(2))
    save_adapter_run(tmp_path / "lora", model, tmp_path / "base")
    assert main(["convert", "--model", str(tmp_path / "lora"), "--to-hf", str(tmp_path / "hf")]) == 2
    assert "--merge-lora" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------------------- exact resume after SIGKILL

LORA_ARGS = ["--lora-rank", "4", "--lora-dropout", "0.1", "--steps", "60", "--checkpoint-interval", "5",
             "--eval-interval", "50", "--eval-iters", "1", "--sample-tokens", "0", "--threads", "1",
             "--batch-size", "4", "--block-size", "32", "--lr", "1e-2", "--no-progress", "--seed", "3"]


def test_lora_resume_after_sigkill_gives_bit_identical_adapters(corpus: Path, tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    base = tmp_path / "base"
    assert main(["train", *TINY, "--data", str(corpus), "--tokenizer", "char", "--out", str(base), "--steps", "2",
                 "--sample-tokens", "0"]) == 0

    def cmd(out: Path, *extra: str) -> list[str]:
        return [sys.executable, "-m", "tinyformer", "train", "--data", str(corpus), "--init-from", str(base),
                "--out", str(out), *LORA_ARGS, *extra]

    full, killed = tmp_path / "full", tmp_path / "killed"
    assert main(cmd(full)[3:]) == 0  # the uninterrupted run in this process: one interpreter start less
    interrupted_at = sigkill_after_first_checkpoint(cmd(killed), env, killed, 0.1, seed=99)
    assert 0 < interrupted_at < 60
    resumed = subprocess.run(cmd(killed, "--resume"), env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"(step {interrupted_at})" in resumed.stdout

    from safetensors.torch import load_file

    a, b = load_file(full / "adapter.safetensors"), load_file(killed / "adapter.safetensors")
    assert a.keys() == b.keys() and all(".lora_" in k for k in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert_same_optimizer_moments(full, killed)
