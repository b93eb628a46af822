"""Scoring replies with a model: sequence log-probabilities, the DPO loss, and ``tinyformer eval`` on chat data.

For a prompt x (messages rendered with the run's chat template, generation prompt included) and a
reply y of tokens y_1 .. y_n (its end-of-turn token included),

    log pi(y | x) = sum_{i=1..n} log p(y_i | x, y_<i)                     (:func:`sequence_logps`)

DPO (Rafailov et al. 2023) on a pair (y_w preferred, y_l not), with the frozen reference ref:

    r_w = beta (log pi(y_w|x) - log ref(y_w|x)),   r_l = beta (log pi(y_l|x) - log ref(y_l|x))
    loss = -log sigmoid(r_w - r_l)                                        (:func:`dpo_loss`)

``r_w - r_l`` is the reward margin, and the reward accuracy is the fraction of pairs with r_w > r_l.
The *preference accuracy* of a model is the fraction of pairs with log pi(y_w|x) > log pi(y_l|x), and
its *log-prob margin* the mean of log pi(y_w|x) - log pi(y_l|x): what ``tinyformer eval --data
prefs.jsonl`` prints. On a chat file it prints the assistant-token loss: the mean of
-log p(token) over the assistant tokens (end-of-turn included) of every conversation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tinyformer.errors import DataError

if TYPE_CHECKING:
    from tinyformer.data.chat_data import PreferencePair
    from tinyformer.data.chat_template import ChatTemplate
    from tinyformer.data.tokenizer import Tokenizer

IGNORE = -100
Row = tuple[list[int], list[int]]  # (input ids, targets with -100 outside the reply)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses, chosen rewards r_w, rejected rewards r_l), all (B,), from (B,) sequence log-probs."""
    chosen_rewards = beta * (policy_chosen - ref_chosen)
    rejected_rewards = beta * (policy_rejected - ref_rejected)
    return -F.logsigmoid(chosen_rewards - rejected_rewards), chosen_rewards, rejected_rewards


def sequence_logps(model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B,) sum over the targets that are not -100 of log p(target | prefix); input_ids, targets (B, T)."""
    logits = model(input_ids).float()
    mask = targets != IGNORE
    token_logps = torch.log_softmax(logits, dim=-1).gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return (token_logps * mask).sum(-1)


def reply_row(ids: list[int], mask: list[int], block_size: int) -> tuple[Row | None, bool]:
    """(the (inputs, targets) row of an encoded reply cut to ``block_size + 1`` tokens, whether it was cut);
    the row is None when the prompt alone fills the context (no reply token left)."""
    cut = len(ids) > block_size + 1
    ids, mask = ids[: block_size + 1], mask[: block_size + 1]
    targets = [t if m else IGNORE for t, m in zip(ids[1:], mask[1:])]
    if all(t == IGNORE for t in targets):
        return None, cut
    return (ids[:-1], targets), cut


def encode_pair(pair: PreferencePair, block_size: int, template: ChatTemplate
                ) -> tuple[tuple[Row, Row] | None, bool]:
    """((chosen row, rejected row) or None when the prompt is longer than the context, whether a reply was cut)."""
    rows = []
    cut = False
    for reply in (pair.chosen, pair.rejected):
        try:
            ids, mask = template.encode_reply(pair.prompt, reply)
        except DataError as exc:
            raise DataError(f"{pair.source}: {exc}") from None
        row, was_cut = reply_row(ids, mask, block_size)
        if row is None:
            return None, was_cut
        rows.append(row)
        cut = cut or was_cut
    return (rows[0], rows[1]), cut


def pair_batch(pairs: Sequence[tuple[Row, Row]], pad_id: int) -> dict[str, torch.Tensor]:
    """B pairs -> one padded batch of 2B rows: the B chosen replies, then the B rejected ones."""
    from tinyformer.training.sft import pad_rows

    return pad_rows([c for c, _ in pairs] + [r for _, r in pairs], pad_id)


@torch.no_grad()
def score_pairs(model: nn.Module, pairs: Sequence[tuple[Row, Row]], pad_id: int, batch_size: int,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(chosen|x), log pi(rejected|x)), each (N,) float32 on the CPU, in eval mode."""
    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    try:
        for start in range(0, len(pairs), batch_size):
            batch = pair_batch(pairs[start : start + batch_size], pad_id)
            logps = sequence_logps(model, batch["input_ids"].to(device), batch["targets"].to(device)).cpu()
            c, r = logps.chunk(2)
            chosen.append(c)
            rejected.append(r)
    finally:
        model.train(was_training)
    return torch.cat(chosen), torch.cat(rejected)


def _load(run: Path, device: str) -> tuple[nn.Module, Tokenizer, torch.device]:
    from tinyformer.devices import resolve_device
    from tinyformer.run_folder import load_model, load_tokenizer

    dev = resolve_device(device)
    return load_model(run, device=dev), load_tokenizer(run), dev


def evaluate_preferences(run: Path, data: str, *, batch_size: int = 8, device: str = "auto") -> dict[str, Any]:
    """Preference accuracy and mean log-prob margin of the model in ``run`` on a preference JSONL file."""
    from tinyformer.data.chat_data import describe_skipped, read_preference_file
    from tinyformer.data.chat_template import ChatTemplate

    model, tokenizer, dev = _load(run, device)
    prefs = read_preference_file(data)
    template = ChatTemplate(tokenizer)
    rows, skipped = [], prefs.skipped.copy()
    for pair in prefs.pairs:
        encoded, _ = encode_pair(pair, model.cfg.max_seq_len, template)
        if encoded is None:
            skipped["prompt longer than the context"] += 1
        else:
            rows.append(encoded)
    if not rows:
        raise DataError(f"{data} has no usable preference pair; {describe_skipped(skipped) or 'it is empty'}")
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    chosen, rejected = score_pairs(model, rows, pad, batch_size, dev)
    margin = (chosen - rejected).double()
    return {"model": str(run), "data": str(data), "pairs": len(rows), "skipped": sum(skipped.values()),
            "preference_accuracy": float((margin > 0).double().mean()), "mean_logp_margin": float(margin.mean())}


@torch.no_grad()
def evaluate_chat(run: Path, data: str, *, batch_size: int = 8, device: str = "auto") -> dict[str, Any]:
    """Assistant-token loss (and perplexity) of the model in ``run`` on a chat JSONL file."""
    from tinyformer.data.chat_data import describe_skipped, read_chat_file
    from tinyformer.data.chat_template import ChatTemplate
    from tinyformer.training.sft import pad_rows

    model, tokenizer, dev = _load(run, device)
    chat = read_chat_file(data)
    template = ChatTemplate(tokenizer)
    rows, skipped = [], chat.skipped.copy()
    for conv in chat.conversations:
        try:
            ids, mask = template.encode_conversation(conv.messages)
        except DataError as exc:
            raise DataError(f"{conv.source}: {exc}") from None
        row, _ = reply_row(ids, mask, model.cfg.max_seq_len)
        if row is None:
            skipped["no assistant token within the context"] += 1
        else:
            rows.append(row)
    if not rows:
        raise DataError(f"{data} has no usable conversation; {describe_skipped(skipped) or 'it is empty'}")
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    nll, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = pad_rows(rows[start : start + batch_size], pad)
        targets = batch["targets"].to(dev)
        logits = model(batch["input_ids"].to(dev)).float()
        nll += float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"))
        count += int((targets != IGNORE).sum())
    loss = nll / count
    return {"model": str(run), "data": str(data), "conversations": len(rows), "skipped": sum(skipped.values()),
            "assistant_tokens": count, "assistant_loss": loss, "perplexity": math.exp(min(loss, 700.0))}


def evaluate_chat_data(run: Path, data: str, *, batch_size: int = 8, device: str = "auto",
                       as_json: bool = False) -> dict[str, Any] | None:
    """What ``tinyformer eval`` prints for a chat or preference .jsonl file (printed here), or None
    when ``data`` is not one (plain text: the caller's language-model evaluation applies)."""
    import json

    from tinyformer.data.chat_data import file_kind

    path = Path(data)
    if path.suffix.lower() != ".jsonl" or not path.is_file():
        return None
    kind = file_kind(path)
    if kind is None:
        return None
    if kind == "preference":
        result = evaluate_preferences(run, data, batch_size=batch_size, device=device)
        line = (f"{run} on {data}: preference accuracy {result['preference_accuracy']:.4f}, mean log-prob margin "
                f"{result['mean_logp_margin']:.4f} ({result['pairs']} pairs, {result['skipped']} skipped)")
    else:
        result = evaluate_chat(run, data, batch_size=batch_size, device=device)
        line = (f"{run} on {data}: assistant-token loss {result['assistant_loss']:.4f}, perplexity "
                f"{result['perplexity']:.2f} ({result['assistant_tokens']:,} tokens in {result['conversations']} "
                f"conversations, {result['skipped']} skipped)")
    print(json.dumps(result) if as_json else line)
    return result
