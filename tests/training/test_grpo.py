"""GRPO (training/objectives/grpo.py) and its rewards (training/rewards.py): the loss against a float64 formula
and TRL, the advantages, the k3 estimator, a synthetic task learnt, the frozen reference, LoRA gradients,
exact resume after a kill, failing rewards, bad input, and `tinyformer eval --reward`."""

from __future__ import annotations

import json
import math
import statistics
import string
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tinyformer.cli.main import main
from tinyformer.data.chat_template import with_chatml
from tinyformer.data.tokenizer import Tokenizer
from tinyformer.errors import ConfigError
from tinyformer.presets import get_preset
from tinyformer.run_folder import save_model
from tinyformer.training import checkpoint as ckpt
from tinyformer.training.metrics import read_metrics
from tinyformer.training.objectives.grpo import group_advantages, grpo_loss, k3_kl
from tinyformer.training.rewards import RewardSet, parse_reward, python_import_reward
from tinyformer.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

TIMING = ("tokens_per_s", "flops_per_s", "mfu", "time", "sample_s", "reward_s", "reference_s")
REWARDS = '''
import math, time

def first_a(prompt, completion, row):
    return float(completion.startswith("a"))

def boom(prompt, completion, row):
    raise RuntimeError("reward exploded")

def hang(prompt, completion, row):
    time.sleep(30)
    return 1.0

def nan(prompt, completion, row):
    return math.nan

def first_code(prompt, completion, row):
    return float(ord(completion[0])) if completion else 0.0

def two_args(prompt, completion):
    return 1.0
'''


class Crash(BaseException):
    """Stands for a kill -9 at the point where it is raised."""


@pytest.fixture(autouse=True)
def _token_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path / "cache"))


def make_base(folder: Path, *, chatml: bool = False, max_seq_len: int = 32) -> Path:
    """A tiny untrained 2-layer decoder run with a char tokenizer (with ChatML already, for LoRA runs)."""
    from tinyformer.models import build_model

    tok = Tokenizer.train_char(string.printable)
    tok = with_chatml(tok) if chatml else tok
    cfg = get_preset("tiny", d_model=32, n_layer=2, n_head=2, n_kv_head=2, d_ff=64, max_seq_len=max_seq_len,
                     vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    save_model(folder, build_model(cfg))
    tok.save(folder)
    return folder


@pytest.fixture
def files(tmp_path: Path) -> SimpleNamespace:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": c * 2, "answer": "a"}) + "\n" for c in "bcdefghij" * 3),
                       encoding="utf-8")
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS, encoding="utf-8")
    return SimpleNamespace(prompts=prompts, rewards=rewards)


def grpo(base: Path, out: Path, files: SimpleNamespace, *args: str, reward: str = "first_a") -> int:
    return main(["train", "--init-from", str(base), "--objective", "grpo", "--data", str(files.prompts),
                 "--reward", f"{files.rewards}:{reward}", "--out", str(out), "--no-progress", "--threads", "1",
                 "--batch-size", "4", "--group-size", "8", "--max-new-tokens", "2", "--warmup-steps", "1",
                 "--eval-iters", "1", "--seed", "5", *args])


def metrics(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(run / "metrics.jsonl")]


# ---------------------------------------------------------------------------- the formulas


def made_up(seed: int = 0) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    R, T = 6, 5
    logps = -torch.rand(R, T, generator=g, dtype=torch.float64) * 3
    old = logps + (torch.rand(R, T, generator=g, dtype=torch.float64) - 0.5) * 0.8  # ratios well outside 1 +- 0.2
    ref = logps + (torch.rand(R, T, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.randn(R, generator=g, dtype=torch.float64)
    mask = torch.ones(R, T, dtype=torch.float64)
    for i, n in enumerate([5, 3, 1, 4, 2, 5]):  # completions of different lengths, padding after
        mask[i, n:] = 0
    return SimpleNamespace(logps=logps, old=old, ref=ref, adv=adv, mask=mask)


def hand_loss(x: SimpleNamespace, eps: float, beta: float, aggregation: str) -> float:
    """The GRPO loss written out with Python floats, one token at a time."""
    per_seq, total, count = [], 0.0, 0
    for i in range(x.logps.shape[0]):
        s, n = 0.0, 0
        for t in range(x.logps.shape[1]):
            if not x.mask[i, t]:
                continue
            lp, old, ref, a = float(x.logps[i, t]), float(x.old[i, t]), float(x.ref[i, t]), float(x.adv[i])
            rho = math.exp(lp - old)
            term = -min(rho * a, min(max(rho, 1 - eps), 1 + eps) * a)
            term += beta * (math.exp(ref - lp) - (ref - lp) - 1)
            s, n = s + term, n + 1
        per_seq.append(s / n)
        total, count = total + s, count + n
    return total / count if aggregation == "token" else sum(per_seq) / len(per_seq)


def trl_loss(x: SimpleNamespace, eps: float, beta: float, loss_type: str) -> tuple[float, dict]:
    """TRL's GRPOTrainer._compute_loss on the same per-token log-probs (the policy forward replaced by them)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    R, T = x.logps.shape
    identity = staticmethod(lambda t: t)

    class Acc:
        num_processes = 1
        sync_gradients = True
        gather = gather_for_metrics = identity
        reduce = staticmethod(lambda t, reduction="sum": t)

    metrics_: dict = defaultdict(lambda: defaultdict(list))
    trl_self = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (x.logps, torch.zeros(R, T, dtype=x.logps.dtype), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1), loss_type=loss_type,
        epsilon_low=eps, epsilon_high=eps, use_vllm=False, vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1, accelerator=Acc(),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics=metrics_)
    inputs = {"prompt_ids": torch.zeros(R, 1, dtype=torch.long), "prompt_mask": torch.ones(R, 1),
              "completion_ids": torch.zeros(R, T, dtype=torch.long), "completion_mask": x.mask,
              "advantages": x.adv, "old_per_token_logps": x.old, "ref_per_token_logps": x.ref,
              "num_items_in_batch": x.mask.sum()}
    loss = GRPOTrainer._compute_loss(trl_self, None, inputs)
    return float(loss), metrics_["train"]


@pytest.mark.parametrize(("aggregation", "loss_type"), [("token", "dapo"), ("sequence", "grpo")])
def test_loss_equals_the_hand_formula_and_trl(aggregation: str, loss_type: str) -> None:
    x, eps, beta = made_up(), 0.2, 0.04
    loss, figures = grpo_loss(x.logps, x.old, x.ref, x.adv, x.mask, eps, beta, aggregation)
    assert math.isclose(float(loss), hand_loss(x, eps, beta, aggregation), rel_tol=1e-12)
    theirs, their_metrics = trl_loss(x, eps, beta, loss_type)
    assert math.isclose(float(loss), theirs, rel_tol=1e-12)
    assert math.isclose(float(figures["kl"]), their_metrics["kl"][0], rel_tol=1e-12)
    assert 0 < float(figures["clip_fraction"]) < 1
    assert math.isclose(float(figures["clip_fraction"]), their_metrics["clip_ratio/region_mean"][0], rel_tol=1e-12)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_micro_batches_of_rows_add_up_to_the_whole_batchs_loss(aggregation: str) -> None:
    x = made_up(2)
    whole, _ = grpo_loss(x.logps, x.old, x.ref, x.adv, x.mask, 0.2, 0.04, aggregation)
    totals = (float(x.mask.sum()), x.mask.shape[0])
    parts = [grpo_loss(x.logps[s], x.old[s], x.ref[s], x.adv[s], x.mask[s], 0.2, 0.04, aggregation, totals)[0]
             for s in (slice(0, 2), slice(2, 5), slice(5, 6))]
    assert math.isclose(float(sum(parts)), float(whole), rel_tol=1e-12)


def test_group_advantages_are_each_groups_standard_scores() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, -1.0, 2.0, 0.0]], dtype=torch.float64)
    adv = group_advantages(rewards)
    unscaled = group_advantages(rewards, std_scale=False)
    for i, group in enumerate(rewards.tolist()):
        mean, std = statistics.mean(group), statistics.stdev(group)
        for j, r in enumerate(group):
            assert math.isclose(float(adv[i, j]), (r - mean) / (std + 1e-4), rel_tol=1e-12, abs_tol=1e-15)
            assert math.isclose(float(unscaled[i, j]), r - mean, rel_tol=1e-12, abs_tol=1e-15)
    assert torch.equal(adv[1], torch.zeros(4, dtype=torch.float64))  # all equal: nothing to learn


def test_k3_kl_is_nonnegative_and_zero_when_the_policies_agree() -> None:
    g = torch.Generator().manual_seed(1)
    logps, ref = -torch.rand(1000, generator=g) * 10, -torch.rand(1000, generator=g) * 10
    assert (k3_kl(logps, ref) >= 0).all()
    assert torch.equal(k3_kl(logps, logps), torch.zeros(1000))


def test_sampled_logprobs_are_those_of_the_tempered_distribution(tmp_path: Path) -> None:
    from tinyformer.generation.generator import Generator
    from tinyformer.generation.sampling import SamplingParams
    from tinyformer.run_folder import load_model, load_tokenizer
    from tinyformer.training.objectives.grpo import token_logps

    base = make_base(tmp_path / "base")
    model, tok = load_model(base), load_tokenizer(base)
    prompt = tok.encode("hello")
    params = SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, max_new_tokens=6, seed=3)
    result = Generator(model, tok).generate([prompt], params, sampled_logprobs=True)[0]
    ids = prompt + result.token_ids
    targets = torch.full((1, len(ids) - 1), -100)
    targets[0, len(prompt) - 1:] = torch.tensor(result.token_ids)
    full = token_logps(model, torch.tensor([ids[:-1]]), targets, 0.7)[0, len(prompt) - 1:]
    assert torch.allclose(torch.tensor(result.logprobs), full, atol=1e-5)


# ---------------------------------------------------------------------------- training


def test_mean_reward_rises_from_chance_to_090_on_a_synthetic_task(tmp_path: Path, files: SimpleNamespace) -> None:
    base = make_base(tmp_path / "base")
    run = tmp_path / "run"
    assert grpo(base, run, files, "--steps", "24", "--lr", "0.03", "--max-new-tokens", "1", "--log-interval", "3",
                "--eval-interval", "24") == 0
    train = [r for r in metrics(run) if r["kind"] == "train"]
    assert train[0]["reward_mean"] < 0.2  # ~1/100: a random model emits 'a' first by chance
    assert train[-1]["reward_mean"] >= 0.9
    assert 0 <= train[-1]["equal_reward_groups"] <= 1 and train[-1]["completion_length"] > 0
    report = (run / "report.md").read_text(encoding="utf-8")
    assert "| mean reward |" in report and "**before:**" in report and "**after:**" in report


def lora_objective(tmp_path: Path, files: SimpleNamespace):
    import argparse

    from tinyformer.cli.train import add_parser, build_spec
    from tinyformer.training.runner import prepare_run

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    base = make_base(tmp_path / "base", chatml=True)
    args = parser.parse_args(["train", "--init-from", str(base), "--objective", "grpo", "--data", str(files.prompts),
                              "--reward", f"{files.rewards}:first_code", "--out", str(tmp_path / "lora"),
                              "--lora-rank", "4", "--batch-size", "2", "--group-size", "4", "--max-new-tokens", "3",
                              "--lr", "0.05", "--threads", "1", "--no-progress"])
    return prepare_run(build_spec(args), log=lambda _: None).trainer


def test_reference_does_not_move_and_only_the_adapters_get_gradients(tmp_path: Path,
                                                                     files: SimpleNamespace) -> None:
    from tinyformer.components.lora import is_adapter_key

    trainer = lora_objective(tmp_path, files)
    objective, model = trainer.objective, trainer.model
    batch = objective.get_batch("train", torch.Generator().manual_seed(0))
    before = objective._reference_logps(batch)
    objective.loss(model, batch).backward()
    assert float(batch["advantages"].abs().sum()) > 0
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_grad and all(is_adapter_key(n) for n in with_grad)  # B (A's gradient is 0 while B = 0)
    assert all(p.grad is None for n, p in model.named_parameters() if not is_adapter_key(n))
    model.zero_grad(set_to_none=True)
    policy_before = objective.loss(model, batch).item()
    for _ in range(4):
        trainer.train_step()
    assert objective.loss(model, batch).item() != policy_before  # the policy moved
    after = objective._reference_logps(batch)
    assert torch.equal(before, after)


def test_kill_and_resume_give_bit_identical_adapters(tmp_path: Path, files: SimpleNamespace,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    base = make_base(tmp_path / "base", chatml=True)
    args = ("--steps", "7", "--lora-rank", "4", "--lr", "0.02", "--ppo-epochs", "2", "--log-interval", "2",
            "--eval-interval", "3", "--checkpoint-interval", "3")
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert grpo(base, full, files, *args) == 0
    real = Trainer.train_step

    def crash_at_step_5(self: Trainer):  # after the step-3 checkpoint, in the middle of a PPO pair and a log window
        if self.step == 4:
            raise Crash
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", crash_at_step_5)
    with pytest.raises(Crash):
        grpo(base, killed, files, *args)
    monkeypatch.undo()
    assert [s for s, _ in ckpt.step_dirs(killed)] == [3]
    assert main(["train", "--resume", str(killed), "--no-progress"]) == 0
    assert (killed / "adapter.safetensors").read_bytes() == (full / "adapter.safetensors").read_bytes()
    assert metrics(killed) == metrics(full)


def test_failing_rewards_score_zero_are_counted_and_the_run_finishes(tmp_path: Path, files: SimpleNamespace,
                                                                     capsys: pytest.CaptureFixture) -> None:
    base = make_base(tmp_path / "base")
    run = tmp_path / "run"
    code = main(["train", "--init-from", str(base), "--objective", "grpo", "--data", str(files.prompts),
                 "--reward", f"{files.rewards}:first_a", "--reward", f"{files.rewards}:boom",
                 "--reward", f"{files.rewards}:hang", "--reward", f"{files.rewards}:nan", "--reward-timeout", "0.05",
                 "--out", str(run), "--no-progress", "--threads", "1", "--batch-size", "1", "--group-size", "2",
                 "--max-new-tokens", "1", "--steps", "2", "--eval-iters", "1"])
    assert code == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for name, why in (("boom", "RuntimeError: reward exploded"), ("hang", "RewardTimeout"), ("nan", "nan")):
        assert f"{files.rewards}:{name} failed" in err and why in err
    last = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"][-1]
    # three failing rewards on every call: 2 steps x 2 completions, and the 1 held-out prompt scored before training
    assert last["reward_failures"] == 3 * (2 * 2 + 1)
    assert "reward failures:" in (run / "report.md").read_text(encoding="utf-8")


def test_reward_set_counts_failures_and_keeps_the_first_error(files: SimpleNamespace) -> None:
    rewards = RewardSet.from_specs([f"{files.rewards}:first_a=2", f"{files.rewards}:boom"], timeout=1.0)
    assert rewards.score("p", "abc", {}) == 2.0
    assert rewards.score("p", "xbc", {}) == 0.0
    assert rewards.failures == {f"{files.rewards}:boom": 2}
    assert rewards.failure_summary() == (f"reward {files.rewards}:boom failed 2 of 2 calls (scored 0); first error: "
                                         "RuntimeError: reward exploded")


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("spec", "message"), [
    ("missing.py:f", "reward file missing.py does not exist"),
    ("{rewards}:nowhere", "has no function 'nowhere'"),
    ("{rewards}:two_args", "the function must take (prompt, completion, row)"),
    ("builtin:nope", "no such built-in reward"),
])
def test_bad_reward_specs_are_one_line(spec: str, message: str, files: SimpleNamespace) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        parse_reward(spec.format(rewards=files.rewards))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_bad_input_on_the_command_line_is_one_line(tmp_path: Path, files: SimpleNamespace,
                                                   capsys: pytest.CaptureFixture) -> None:
    base = make_base(tmp_path / "base", max_seq_len=24)
    assert grpo(base, tmp_path / "a", files, "--group-size", "1") != 0
    err = capsys.readouterr().err
    assert "a group of 1 has nothing to compare" in err and err.count("\n") == 1
    assert grpo(base, tmp_path / "b", files, reward="two_args") != 0
    err = capsys.readouterr().err
    assert "(prompt, completion, row)" in err and err.count("\n") == 1
    # a prompt too long for the context (with room for --max-new-tokens) is skipped and counted
    long = tmp_path / "long.jsonl"
    long.write_text(files.prompts.read_text(encoding="utf-8") + json.dumps({"prompt": "x" * 40}) + "\n",
                    encoding="utf-8")
    files.prompts = long
    assert grpo(base, tmp_path / "c", files, "--steps", "1") == 0
    assert "1 skipped (1 prompt longer than the context)" in capsys.readouterr().out


# ---------------------------------------------------------------------------- the built-in rewards


def test_builtin_rewards_agree_with_their_definitions() -> None:
    import jsonschema

    exact, contains, schema_r = (parse_reward(f"builtin:{n}").fn for n in ("exact", "contains", "json-schema"))
    assert exact("q", "  `json` \n", {"answer": "`json`"}) == 1.0 and exact("q", "json", {"answer": "`json`"}) == 0
    assert contains("q", "use os.path here", {"answer": ["os", "path"]}) == 1.0
    assert contains("q", "use os here", {"answer": ["os", "path"]}) == 0.0
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for text in ('{"n": 3}', '{"n": "3"}', "{}", "not json"):
        try:
            jsonschema.validate(json.loads(text), schema)
            want = 1.0
        except (ValueError, jsonschema.ValidationError):
            want = 0.0
        assert schema_r("q", text, {"schema": schema}) == want


def test_python_import_reward_runs_only_import_statements_and_checks_the_bound_name() -> None:
    row = {"module": "urllib.parse", "name": "urljoin"}
    assert python_import_reward("q", "`from urllib.parse import urljoin`", row) == 1.0
    assert python_import_reward("q", "```python\nfrom urllib.parse import urljoin\n```", row) == 1.0
    assert python_import_reward("q", "```python\nimport os\nfrom urllib.parse import urljoin\n```", row) == 0.0
    assert python_import_reward("q", "import urllib.parse", row) == 0.0  # runs, but binds urllib only
    assert python_import_reward("q", "from urllib.parse import urljoin as join", row) == 0.0
    assert python_import_reward("q", "from urllib.parse import urlsplit as urljoin", row) == 0.0  # another object
    assert python_import_reward("q", "__import__('os').system('touch x')", row) == 0.0  # not an import: never run
    assert python_import_reward("q", "from urllib.parse import urljoin", {"answer": "x"}) == 0.0  # not asked


# ---------------------------------------------------------------------------- tinyformer eval --reward


def test_eval_reward_prints_the_mean_and_best_of_k(tmp_path: Path, files: SimpleNamespace,
                                                   capsys: pytest.CaptureFixture) -> None:
    base = make_base(tmp_path / "base")
    run = tmp_path / "run"
    assert grpo(base, run, files, "--steps", "24", "--lr", "0.03", "--max-new-tokens", "1",
                "--eval-interval", "24") == 0
    capsys.readouterr()
    assert main(["eval", "--model", str(run), "--data", str(files.prompts), "--reward", "builtin:exact",
                 "--max-new-tokens", "1", "--json", "--no-progress"]) == 0
    greedy = json.loads(capsys.readouterr().out)
    assert len(greedy["rewards"]) == 27 and greedy["mean_reward"] == sum(greedy["rewards"]) / 27
    assert greedy["mean_reward"] >= 0.9  # answer "a": what the run was rewarded for
    assert main(["eval", "--model", str(base), "--data", str(files.prompts), "--reward", "builtin:exact",
                 "--max-new-tokens", "1", "--num-samples", "4", "--json", "--no-progress"]) == 0
    sampled = json.loads(capsys.readouterr().out)
    assert len(sampled["rewards"]) == 27 and all(len(r) == 4 for r in sampled["rewards"])
    best = sum(max(r) for r in sampled["rewards"]) / 27
    assert sampled["best_of_k_mean_reward"] == best >= sampled["mean_reward"]
