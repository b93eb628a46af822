"""Group relative policy optimisation (``--objective grpo``, Shao et al. 2024) with rewards a program checks.

Each step takes P prompts (``--batch-size``), samples G completions of each (``--group-size``) from the
current policy at temperature T with the KV-cached batch engine (generation/engine.py, through
``Generator.generate``), and keeps each sampled token's log-probability under the distribution it was drawn
from, log pi_old(y_t) = log softmax(logits / T)[y_t] (``sampled_logprobs``). Every completion gets a reward
r (training/rewards.py); within each prompt's group of G

    A_i = (r_i - mean(r)) / (std(r) + eps)          std unbiased (n - 1), eps = 1e-4, as TRL
    A_i =  r_i - mean(r)                            with --no-std-scale (Dr. GRPO's unscaled variant)

Then, for every completion token t of completion i, with rho = exp(log pi(y_t) - log pi_old(y_t)):

    l_{i,t} = -min(rho A_i, clip(rho, 1 - eps_c, 1 + eps_c) A_i) + beta KL3_{i,t}
    KL3_{i,t} = exp(log ref(y_t) - log pi(y_t)) - (log ref(y_t) - log pi(y_t)) - 1     (k3 estimator, >= 0)

averaged over the completion tokens (prompt and padding masked, m_{i,t} = 1 on a completion's tokens, its
end-of-turn token included):

    token     L = sum_{i,t} m l / sum_{i,t} m             (default: TRL's default loss_type "dapo")
    sequence  L = mean_i ( sum_t m l / sum_t m )         (--grpo-loss sequence: TRL's "grpo", the paper's)

log pi is the model being trained (at the same temperature T); eps_c = ``--clip-eps``; beta = ``--kl-beta``.
The reference ref is the ``--init-from`` model: with LoRA, the model itself with its adapters switched off
(``lora_disabled``: no second copy in memory); without LoRA, a frozen copy loaded once (only when beta > 0).
Both log pi and log ref run each distinct prompt through the model once and the G completions after it,
attending its keys and values (``shared_prompt_logps``): the same log-probs and gradients as the full rows,
at about half the tokens when the prompt is as long as the completions.
``--ppo-epochs K`` takes K optimizer steps on each sampled batch (rho departs from 1 after the first);
``--grad-accum A`` splits each step's P x G completions into A micro-batches of rows (the same update, with
the sums divided by the whole batch's counts; about 1/A of the activation memory).

The held-out prompts (``--eval-data``, else ``--val-fraction`` of the data, chosen by a hash of the first user
message as SFT does) are answered greedily at every evaluation: their mean reward goes to metrics.jsonl
(``val_reward_mean``), and report.md gives it before and after training with five held-out prompts and their
completions before and after.

Exact resume: prompts and sampling seeds are drawn from the trainer's checkpointed data generator; a batch
still to be reused by later PPO epochs, the figures of the log window and the reward-failure counts are the
objective's :meth:`state`, stored in the checkpoint.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tinyformer.components.lora import has_lora, lora_disabled
from tinyformer.data.chat_data import describe_skipped, read_jsonl_rows
from tinyformer.errors import ConfigError, DataError
from tinyformer.training.objectives.base import IGNORE, Batch, eval_mode, plain_module
from tinyformer.training.objectives.sft import ChatObjective, first_user_text
from tinyformer.training.rewards import RewardSet

if TYPE_CHECKING:
    from tinyformer.data.dataset import TokenDataset
    from tinyformer.data.tokenizer import Tokenizer
    from tinyformer.training.train_config import TrainConfig

#: the denominator's guard of the std-scaled advantages (TRL's)
ADVANTAGE_EPS = 1e-4
REPORT_PROMPTS = 5


# ------------------------------------------------------------------ the formulas


def group_advantages(rewards: torch.Tensor, std_scale: bool = True, eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """(P, G) rewards -> (P, G) advantages: r - mean over the group, divided by (std + eps) when ``std_scale``
    (std with Bessel's correction, as ``torch.std`` and TRL)."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not std_scale:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref) from the sampled tokens' log-probs (any shape):
    exp(ref - pi) - (ref - pi) - 1 >= 0, zero where the two agree."""
    diff = ref_logps - logps
    return torch.exp(diff) - diff - 1


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float, beta: float,
              aggregation: str = "token", totals: tuple[float, float] | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss (module docstring) and its figures.

    logps, old_logps, ref_logps: (R, T) log-probs of the sampled tokens under the policy (with gradient), the
    sampling policy and the reference (None when ``beta`` is 0); advantages (R,); mask (R, T), 1 on completion
    tokens. ``totals`` = (completion tokens, completions) of the whole batch when these R rows are one
    micro-batch of it: the sums are then divided by those, so the micro-batches' losses add up to the batch's.
    Returns (scalar loss, {"kl": mean k3 over the masked tokens, "clip_fraction": share of masked tokens whose
    ratio was clipped against the advantage's sign}).
    """
    mask = mask.to(logps.dtype)
    adv = advantages.unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = torch.zeros_like(logps)
    if beta != 0.0:
        assert ref_logps is not None, "a KL term needs the reference log-probs"
        kl = k3_kl(logps, ref_logps)
        per_token = per_token + beta * kl
    n_tokens, n_rows = totals if totals is not None else (mask.sum().clamp(min=1.0), mask.shape[0])
    if aggregation == "token":
        loss = (per_token * mask).sum() / n_tokens
    elif aggregation == "sequence":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / n_rows
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}")
    n = mask.sum().clamp(min=1.0)
    was_clipped = ((ratio < 1 - clip_eps) & (adv < 0)) | ((ratio > 1 + clip_eps) & (adv > 0))
    return loss, {"kl": ((kl * mask).sum() / n).detach(),
                  "clip_fraction": ((was_clipped.to(mask.dtype) * mask).sum() / n).detach()}


def token_logps(model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor, temperature: float
                ) -> torch.Tensor:
    """(R, T) log softmax(logits / T)[target] at the positions whose target is not -100 (0 elsewhere); the LM
    head runs on those positions only. input_ids, targets (R, T), right-padded."""
    model = plain_module(model)
    return _picked_logps(model, model.hidden_states(input_ids), targets, temperature)


def shared_prompt_logps(model: nn.Module, batch: Batch, temperature: float) -> torch.Tensor:
    """``token_logps`` of the rows p_g(r) + c_r, with each distinct prompt run once (``SharedPrefix``,
    components/kv_cache.py): U L + R T tokens through the model instead of R (L + T).

    batch (``_rows_batch``'s layout): ``prompt_ids`` (U, L), the distinct prompts without their last token,
    right-padded, ``prompt_lengths`` (U,) their lengths n_u = len(p_u) - 1; ``group`` (R,), each row's prompt;
    ``input_ids`` (R, T), the prompt's last token then the completion but its last token; ``targets`` (R, T),
    the completion, -100 after it. Returns (R, T), aligned with ``targets``."""
    from tinyformer.components.kv_cache import SharedPrefix

    model = plain_module(model)
    targets, lengths, group = batch["targets"], batch["prompt_lengths"], batch["group"]
    seen = int((lengths.index_select(0, group) + (targets != IGNORE).sum(1)).max())  # the longest full row
    shared = SharedPrefix(model.cfg, lengths, group, seen)
    model.hidden_states(batch["prompt_ids"], cache=shared)  # the prefix call: keeps each layer's prompt keys and values
    return _picked_logps(model, model.hidden_states(batch["input_ids"], cache=shared), targets, temperature)


def _picked_logps(model: nn.Module, h: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """Hidden states h (R, T, d) -> (R, T) log softmax(W_head h / T)[target] where target != -100, 0 elsewhere
    (the head runs on those positions only)."""
    mask = targets != IGNORE
    logits = model.logits(h[mask]).float() / temperature
    picked = logits.gather(-1, targets[mask].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    out = torch.zeros(targets.shape, dtype=picked.dtype, device=picked.device)
    return out.masked_scatter(mask, picked)


# ------------------------------------------------------------------ sampling (the one engine)


def sample_completions(model: nn.Module, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]], n: int,
                       max_new_tokens: int, temperature: float, seed: int | None,
                       stop_token_ids: Sequence[int]) -> list[tuple[list[int], list[float], str]]:
    """``n`` completions of each prompt in one batch of the KV-cached engine, prompt-major: (token ids, their
    log-probs under the distribution sampled from, text). Temperature 0 is greedy; a seed makes row b draw from
    its own generator seeded seed + b."""
    from tinyformer.generation.generator import Generator
    from tinyformer.generation.sampling import GREEDY_TEMPERATURE, SamplingParams

    model = plain_module(model)
    with eval_mode(model):
        gen = Generator(model, tokenizer)
        params = SamplingParams(temperature=temperature if temperature > 0 else GREEDY_TEMPERATURE, top_k=0,
                                top_p=1.0, min_p=0.0, max_new_tokens=max_new_tokens, seed=seed,
                                stop_token_ids=tuple(stop_token_ids)).validate()
        rows = [list(p) for p in prompts for _ in range(n)]
        results = gen.generate(rows, params, logprobs=temperature > 0, sampled_logprobs=True)
    return [(r.token_ids, r.logprobs, r.text) for r in results]


# ------------------------------------------------------------------ prompt rows


def prompt_messages(row: dict, where: str) -> list[dict[str, str]]:
    """The messages of a prompt row: ``{"prompt": str}`` or ``{"messages": [...]}`` ending with a user turn."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a prompt row must be a JSON object with 'prompt' or 'messages'")
    if isinstance(row.get("prompt"), str):
        return [{"role": "user", "content": row["prompt"]}]
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise DataError(f"{where}: a prompt row needs 'prompt' (a string) or 'messages' (a list of "
                        "{role, content})")
    if messages[-1]["role"] != "user":
        raise DataError(f"{where}: the prompt's messages must end with a user turn (the completion answers it)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def load_prompt_rows(data: str | None) -> tuple[list[tuple[dict, str]], str]:
    """((row, source) of every prompt row of ``data``, a JSONL file; the built-in set's when None), the name."""
    if data is None:
        from tinyformer.data.instructions import builtin_prompts

        return [(r, f"built-in:{i}") for i, r in enumerate(builtin_prompts())], "the built-in instruction set"
    path = Path(data)
    return [(row, f"{path}:{lineno}") for lineno, row in read_jsonl_rows(path)], str(path)


# ------------------------------------------------------------------ the objective


class GRPOObjective(ChatObjective):
    """GRPO with program rewards (see the module docstring)."""

    name = "grpo"
    loss_label = "held-out mean reward"
    loss_is_nll = False
    val_loss_key = "val_reward_mean"
    token_kind = "completion tokens"

    def __init__(self, cfg: TrainConfig, tokenizer: Tokenizer, dataset: TokenDataset | None) -> None:
        super().__init__(cfg, tokenizer, dataset)
        if cfg.grad_accum > cfg.batch_size * cfg.group_size:
            raise ConfigError(f"--grad-accum {cfg.grad_accum} splits a step's {cfg.batch_size * cfg.group_size} "
                              "completions into micro-batches: it cannot be larger than that")
        self.rewards = RewardSet.from_specs(cfg.rewards, cfg.reward_timeout)
        rows, self.source = load_prompt_rows(cfg.data)
        self.prompts: dict[str, list[tuple[list[int], list[dict[str, str]], dict]]] = {"train": [], "val": []}
        held = load_prompt_rows(cfg.eval_data)[0] if cfg.eval_data else None
        for split_rows, fixed in ((rows, None), (held or [], "val")):
            for row, where in split_rows:
                messages = prompt_messages(row, where)
                ids = self.template.encode_prompt(messages)
                if len(ids) + cfg.max_new_tokens > self._block():
                    self.skipped["prompt longer than the context"] += 1
                    continue
                split = fixed or ("train" if held is not None else self._split(first_user_text(messages)))
                self.prompts[split].append((ids, messages, row))
        if not self.prompts["train"]:
            raise self._no_data(f"prompt to train on (each needs room for --max-new-tokens {cfg.max_new_tokens} in "
                                f"the {self._block()}-token context)")
        self.model: nn.Module | None = None
        self.reference: nn.Module | None = None  # a frozen copy, only without LoRA and with beta > 0
        #: the sampled batch still to be trained on by later PPO epochs, and how often it was used
        self.rollout: dict[str, Any] | None = None
        self.rollout_uses = 0
        self.micro = 0  # the next micro-batch of the rollout (--grad-accum splits its rows)
        self.window: Counter = Counter()  # sums of the figures since the last training record
        self.before: dict[str, Any] | None = None  # held-out reward and completions before the first update

    # ------------------------------------------------------------------ set-up
    def describe_data(self) -> str | None:
        cfg = self.cfg
        parts = [f"data: {len(self.prompts['train']):,} train / {len(self.prompts['val']):,} held-out prompts from "
                 f"{self.source}" + (f" and {cfg.eval_data}" if cfg.eval_data else ""),
                 f"reward {self.rewards.describe()}",
                 f"G {cfg.group_size}, temperature {cfg.temperature:g}, up to {cfg.max_new_tokens} new tokens, "
                 f"beta {cfg.kl_beta:g}, clip {cfg.clip_eps:g}, {cfg.ppo_epochs} PPO epoch(s), "
                 f"{cfg.grpo_loss} mean" + ("" if cfg.std_scale else ", advantages not std-scaled")]
        if self.skipped:
            parts.append(describe_skipped(self.skipped))
        return "; ".join(parts)

    def tokens_per_step(self, sequences: int) -> str | None:
        return (f"{sequences} prompts x {self.cfg.group_size} sampled completions (up to {self.cfg.max_new_tokens} "
                "tokens each)")

    def attach(self, model: nn.Module) -> None:
        self.model = model

    def has_split(self, split: str) -> bool:
        return False  # no held-out loss: the held-out figure is the reward (eval_metrics)

    # ------------------------------------------------------------------ the reference
    def _reference_logps(self, batch: Batch) -> torch.Tensor | None:
        """The reference's ``shared_prompt_logps`` of ``batch`` (None when beta is 0)."""
        if self.cfg.kl_beta == 0.0:
            return None
        model = plain_module(self.model)
        with eval_mode(model), torch.no_grad():
            if has_lora(model):
                with lora_disabled(model):
                    return shared_prompt_logps(model, batch, self.cfg.temperature)
            if self.reference is None:
                self.reference = self._load_reference(model, next(model.parameters()).device).eval()
            return shared_prompt_logps(self.reference, batch, self.cfg.temperature)

    # ------------------------------------------------------------------ batches: sampled by the model
    def _rollout(self, index: list[int], seed: int) -> dict[str, Any]:
        """Sample, score and take the reference log-probs of a batch of prompts: the batch as JSON values."""
        cfg, G = self.cfg, self.cfg.group_size
        assert self.model is not None, "the trainer attaches the model before the first batch"
        prompts = [self.prompts["train"][i] for i in index]
        t0 = time.perf_counter()
        done = sample_completions(self.model, self.tokenizer, [p[0] for p in prompts], G, cfg.max_new_tokens,
                                  cfg.temperature, seed, self.template.stop_token_ids)
        t1 = time.perf_counter()
        rewards = []
        for k, (_, _, text) in enumerate(done):
            _, messages, row = prompts[k // G]
            rewards.append(self.rewards.score(messages[-1]["content"], text, row))
        t2 = time.perf_counter()
        r = torch.tensor(rewards, dtype=torch.float64).view(len(index), G)
        adv = group_advantages(r, cfg.std_scale).flatten()
        rows = [(prompts[k // G][0], ids, logps) for k, (ids, logps, _) in enumerate(done)]
        batch = _rows_batch(rows, self.pad_id)
        ref = self._reference_logps(batch)
        self.window.update(sample_s=t1 - t0, reward_s=t2 - t1, reference_s=time.perf_counter() - t2, rollouts=1,
                           reward_sum=float(r.sum()), reward_sq=float((r * r).sum()), completions=r.numel(),
                           equal_groups=int((r == r[:, :1]).all(dim=1).sum()), groups=len(index),
                           completion_tokens=sum(len(ids) for ids, _, _ in done))  # Counter.update adds
        return {"rows": [[p, ids, lp] for p, ids, lp in rows], "advantages": adv.tolist(),
                "ref": None if ref is None else [ref[i, batch["targets"][i] != IGNORE].tolist()
                                                 for i in range(len(rows))]}

    def get_batch(self, split: str, generator: torch.Generator, rank: int = 0, world_size: int = 1) -> Batch:
        if world_size > 1:
            raise ConfigError("objective 'grpo' trains in one process; drop --nproc")
        if self.before is None:
            self.before = self._heldout_scores(REPORT_PROMPTS)
        if self.micro == 0 and (self.rollout is None or self.rollout_uses >= self.cfg.ppo_epochs):
            n = len(self.prompts["train"])
            index = torch.randint(0, n, (self.cfg.batch_size,), generator=generator).tolist()
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
            self.rollout, self.rollout_uses = self._rollout(index, seed), 0
        if self.micro == 0:
            self.rollout_uses += 1
        part, self.micro = self.micro, (self.micro + 1) % self.cfg.grad_accum
        return _to_batch(self.rollout, self.pad_id, part, self.cfg.grad_accum)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        logps = shared_prompt_logps(model, batch, self.cfg.temperature)
        loss, figures = grpo_loss(logps, batch["old_logps"], batch.get("ref_logps"), batch["advantages"],
                                  batch["targets"] != IGNORE, self.cfg.clip_eps, self.cfg.kl_beta,
                                  self.cfg.grpo_loss, totals=(float(batch["total_tokens"]), float(batch["total_rows"])))
        # the trainer divides each micro-batch's loss by --grad-accum: this part is already its share of the whole
        loss = loss * self.cfg.grad_accum
        if model.training and torch.is_grad_enabled():
            self.window.update(updates=1, kl=float(figures["kl"]), clip_fraction=float(figures["clip_fraction"]))
        return loss

    # ------------------------------------------------------------------ figures
    def train_metrics(self) -> dict[str, float]:
        w, out = self.window, {}
        if w["completions"]:
            mean = w["reward_sum"] / w["completions"]
            var = max(0.0, w["reward_sq"] / w["completions"] - mean * mean)
            out.update(reward_mean=mean, reward_std=math.sqrt(var),
                       equal_reward_groups=w["equal_groups"] / w["groups"],
                       completion_length=w["completion_tokens"] / w["completions"],
                       sample_s=w["sample_s"] / w["rollouts"], reward_s=w["reward_s"] / w["rollouts"],
                       reference_s=w["reference_s"] / w["rollouts"])
        if w["updates"]:
            out.update(kl=w["kl"] / w["updates"], clip_fraction=w["clip_fraction"] / w["updates"])
        out["reward_failures"] = sum(self.rewards.failures.values())
        self.window = Counter()
        return out

    def _heldout_scores(self, shown: int = 0) -> dict[str, Any]:
        """Greedy completions of the held-out prompts (``eval_iters * batch_size`` of them, 0: all, spread evenly
        over the split: the built-in set's kinds of question come in runs): {"mean": mean reward, "n": prompts,
        "shown": the first ``shown`` (prompt, completion, reward) spread evenly over them}."""
        assert self.model is not None
        prompts = spread(self.prompts["val"] or self.prompts["train"], self.cfg.eval_iters * self.cfg.batch_size)
        done = sample_completions(self.model, self.tokenizer, [p[0] for p in prompts], 1, self.cfg.max_new_tokens,
                                  0.0, None, self.template.stop_token_ids)
        scores = [self.rewards.score(m[-1]["content"], text, row) for (_, m, row), (_, _, text) in zip(prompts, done)]
        step = max(1, len(prompts) // shown) if shown else 1
        picks = list(range(0, len(prompts), step))[:shown]
        return {"mean": sum(scores) / len(scores), "n": len(scores),
                "shown": [[prompts[i][1][-1]["content"], done[i][2], scores[i]] for i in picks]}

    def eval_metrics(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        scores = self._heldout_scores()
        return {"val_reward_mean": scores["mean"]}

    def report(self, model: nn.Module, device: torch.device) -> list[str]:
        after = self._heldout_scores(REPORT_PROMPTS)
        before = self.before
        which = "held-out" if self.prompts["val"] else "train (no held-out prompts)"
        lines = [f"## Rewards ({after['n']} {which} prompts, greedy completions; reward {self.rewards.describe()})",
                 "", "| | before | after |", "|---|---|---|",
                 f"| mean reward | {before['mean']:.4f} | {after['mean']:.4f} |" if before else
                 f"| mean reward | | {after['mean']:.4f} |", ""]
        lines += [f"## {len(after['shown'])} held-out prompts, before and after", ""]
        for k, (prompt, text, score) in enumerate(after["shown"]):
            lines.append(f"- **prompt:** {prompt}")
            if before and k < len(before["shown"]):
                lines.append(f"  **before:** {before['shown'][k][1]!r} (reward {before['shown'][k][2]:g})")
            lines.append(f"  **after:** {text!r} (reward {score:g})")
        summary = self.rewards.failure_summary()
        if summary:
            lines += ["", f"- reward failures: {summary}"]
            print(summary, file=sys.stderr)
        return lines

    # ------------------------------------------------------------------ exact resume
    def state(self) -> dict | None:
        return {"rollout": self.rollout, "rollout_uses": self.rollout_uses, "micro": self.micro,
                "window": dict(self.window),
                "before": self.before, "rewards": self.rewards.state()}

    def load_state(self, state: dict | None) -> None:
        if not state:
            return
        self.rollout, self.rollout_uses = state.get("rollout"), int(state.get("rollout_uses", 0))
        self.micro = int(state.get("micro", 0))
        self.window = Counter(state.get("window") or {})
        self.before = state.get("before")
        self.rewards.load_state(state.get("rewards"))


def spread(items: Sequence[Any], n: int) -> list[Any]:
    """``n`` of ``items`` at evenly spaced positions (all of them when n is 0 or not smaller)."""
    if not n or n >= len(items):
        return list(items)
    return [items[(k * len(items)) // n] for k in range(n)]


def _rows_batch(rows: Sequence[tuple[list[int], list[int], list[float]]], pad_id: int) -> Batch:
    """(prompt ids, completion ids, their sampling log-probs) rows -> the layout of ``shared_prompt_logps``:
    ``prompt_ids`` (U, L) the U distinct prompts without their last token, right-padded (L >= 1),
    ``prompt_lengths`` (U,), ``group`` (R,) each row's prompt; ``input_ids`` (R, T) the prompt's last token and
    the completion but its last, right-padded; ``targets`` (R, T) the completion (-100 after it), each token at
    the position that predicts it; ``old_logps`` (R, T) aligned with ``targets``, 0 elsewhere."""
    prompts: dict[tuple[int, ...], int] = {}
    group = [prompts.setdefault(tuple(p), len(prompts)) for p, _, _ in rows]
    L = max(1, *(len(p) - 1 for p in prompts))  # a prompt of one token has an empty prefix
    prompt_ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    for u, p in enumerate(prompts):
        prompt_ids[u, : len(p) - 1] = torch.tensor(p[:-1], dtype=torch.long)
    T = max(1, *(len(c) for _, c, _ in rows))
    input_ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    old = torch.zeros(len(rows), T)
    for i, (p, c, lp) in enumerate(rows):
        input_ids[i, : len(c)] = torch.tensor([p[-1], *c][: len(c)], dtype=torch.long)
        targets[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        old[i, : len(c)] = torch.tensor(lp, dtype=torch.float32)
    return {"prompt_ids": prompt_ids, "prompt_lengths": torch.tensor([len(p) - 1 for p in prompts]),
            "group": torch.tensor(group), "input_ids": input_ids, "targets": targets, "old_logps": old,
            "tokens": int((targets != IGNORE).sum())}


def _to_batch(rollout: dict[str, Any], pad_id: int, part: int = 0, parts: int = 1) -> Batch:
    """Micro-batch ``part`` of ``parts`` (contiguous rows) of a rollout (:meth:`GRPOObjective._rollout`'s JSON
    values), with the whole rollout's completion tokens and completions (``total_tokens``, ``total_rows``)."""
    R = len(rollout["rows"])
    lo, hi = part * R // parts, (part + 1) * R // parts
    batch = _rows_batch([tuple(r) for r in rollout["rows"][lo:hi]], pad_id)
    batch["advantages"] = torch.tensor(rollout["advantages"][lo:hi], dtype=torch.float32)
    batch["total_tokens"] = torch.tensor(sum(len(r[1]) for r in rollout["rows"]))
    batch["total_rows"] = torch.tensor(R)
    if rollout["ref"] is not None:
        ref = torch.zeros_like(batch["old_logps"])
        mask = batch["targets"] != IGNORE
        ref[mask] = torch.tensor([x for row in rollout["ref"][lo:hi] for x in row], dtype=torch.float32)
        batch["ref_logps"] = ref
    return batch
