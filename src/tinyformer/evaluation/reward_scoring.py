"""`tinyformer eval --reward SPEC`: the mean reward of a run's completions to prompts (training/rewards.py).

    --data prompts.jsonl      rows {"prompt": str} or {"messages": [...]} plus the fields the rewards read
    (no --data)               the held-out prompts of the built-in instruction set (the split GRPO holds out)

Each prompt is rendered with the run's chat template and completed through the batch engine
(``training/objectives/grpo.sample_completions``): greedily by default, or ``--num-samples K`` times at
temperature 1 (seed 0); ``--limit N`` takes N prompts spread evenly over them. The result holds
``mean_reward`` (over every completion), ``rewards`` (one per prompt, or K per prompt), with K > 1
``best_of_k_mean_reward`` = mean over prompts of max_k r, and with rows that have a ``kind`` field (the
built-in set) the mean reward of each kind (``by_kind``).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from tinyformer.errors import ConfigError

__all__ = ["evaluate_rewards"]


def evaluate_rewards(model_dir: str | Path, data: str | None, specs: list[str], *, num_samples: int = 1,
                     max_new_tokens: int = 32, batch_size: int = 8, device: str = "auto",
                     reward_timeout: float = 10.0, limit: int | None = None) -> dict[str, Any]:
    from tinyformer.data.chat_data import is_heldout
    from tinyformer.data.chat_template import ChatTemplate
    from tinyformer.devices import resolve_device
    from tinyformer.run_folder import load_model, load_tokenizer
    from tinyformer.training.objectives.grpo import load_prompt_rows, prompt_messages, sample_completions, spread
    from tinyformer.training.objectives.sft import first_user_text
    from tinyformer.training.rewards import RewardSet

    if num_samples < 1:
        raise ConfigError(f"--num-samples must be >= 1, got {num_samples}")
    rewards = RewardSet.from_specs(specs, reward_timeout)
    rows, source = load_prompt_rows(data)
    prompts = []
    for row, where in rows:
        messages = prompt_messages(row, where)
        if data is None and not is_heldout(first_user_text(messages), 0.1):
            continue
        prompts.append((messages, row))
    if data is None:
        source = "the held-out prompts of the built-in instruction set"
    if limit is not None:
        prompts = spread(prompts, limit)
    dev = resolve_device(device)
    model, tokenizer = load_model(model_dir, device=dev), load_tokenizer(model_dir)
    template = ChatTemplate(tokenizer)
    scored: list[list[float]] = []
    kinds: dict[str, list[float]] = defaultdict(list)
    rendered = [(template.encode_prompt(messages), messages, row) for messages, row in prompts]
    encoded = [r for r in rendered if len(r[0]) + max_new_tokens <= model.cfg.max_seq_len]  # room to answer
    skipped = len(rendered) - len(encoded)
    temperature, seed = (0.0, None) if num_samples == 1 else (1.0, 0)
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        done = sample_completions(model, tokenizer, [c[0] for c in chunk], num_samples, max_new_tokens, temperature,
                                  None if seed is None else seed + start * num_samples, template.stop_token_ids)
        for k, (_, messages, row) in enumerate(chunk):
            values = [rewards.score(messages[-1]["content"], text, row)
                      for _, _, text in done[k * num_samples : (k + 1) * num_samples]]
            scored.append(values)
            if "kind" in row:
                kinds[str(row["kind"])] += values
    if not scored:
        raise ConfigError(f"{source}: no prompt leaves room for --max-new-tokens {max_new_tokens} in the "
                          f"{model.cfg.max_seq_len}-token context")
    flat = [v for values in scored for v in values]
    result: dict[str, Any] = {"model": str(model_dir), "data": source, "reward": rewards.describe(),
                              "num_samples": num_samples, "prompts": len(scored), "skipped": skipped,
                              "mean_reward": sum(flat) / len(flat),
                              "rewards": [v[0] for v in scored] if num_samples == 1 else scored}
    if num_samples > 1:
        result["best_of_k_mean_reward"] = sum(max(v) for v in scored) / len(scored)
    if kinds:
        result["by_kind"] = {k: sum(v) / len(v) for k, v in sorted(kinds.items())}
    result["reward_failures"] = rewards.failure_summary()
    return result
