"""``tinyformer eval`` on chat and preference files: how well a run's model scores replies.

For a prompt x (messages rendered with the run's chat template, generation prompt included) and a
reply y of tokens y_1 .. y_n (its end-of-turn token included), log pi(y | x) = sum_i log p(y_i | x, y_<i)
(:func:`~tinyformer.training.objectives.dpo.sequence_logps`). On a preference file (pairs y_w preferred,
y_l not) the *preference accuracy* of a model is the fraction of pairs with log pi(y_w|x) > log pi(y_l|x),
and its *log-prob margin* the mean of log pi(y_w|x) - log pi(y_l|x). On a chat file it is the
assistant-token loss: the mean of -log p(token) over the assistant tokens (end-of-turn included) of
every conversation.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tinyformer.errors import DataError
from tinyformer.training.objectives.dpo import encode_pair, score_pairs
from tinyformer.training.objectives.sft import IGNORE, conversation_row, pad_rows

if TYPE_CHECKING:
    from tinyformer.data.chat_template import ChatTemplate


def _load(run: Path, device: str) -> tuple[nn.Module, ChatTemplate, int, torch.device]:
    """The run's model, its chat template, the padding id and the device."""
    from tinyformer.data.chat_template import ChatTemplate
    from tinyformer.devices import resolve_device
    from tinyformer.run_folder import load_model, load_tokenizer

    dev = resolve_device(device)
    model, tokenizer = load_model(run, device=dev), load_tokenizer(run)
    return model, ChatTemplate(tokenizer), tokenizer.pad_id if tokenizer.pad_id is not None else 0, dev


def evaluate_preferences(run: Path, data: str, *, batch_size: int = 8, device: str = "auto") -> dict[str, Any]:
    """Preference accuracy and mean log-prob margin of the model in ``run`` on a preference JSONL file."""
    from tinyformer.data.chat_data import describe_skipped, read_preference_file

    model, template, pad, dev = _load(run, device)
    prefs = read_preference_file(data)
    rows, skipped = [], prefs.skipped.copy()
    for pair in prefs.pairs:
        encoded, _ = encode_pair(pair, model.cfg.max_seq_len, template)
        if encoded is None:
            skipped["prompt longer than the context"] += 1
        else:
            rows.append(encoded)
    if not rows:
        raise DataError(f"{data} has no usable preference pair; {describe_skipped(skipped) or 'it is empty'}")
    chosen, rejected = score_pairs(model, rows, pad, batch_size, dev)
    margin = (chosen - rejected).double()
    return {"model": str(run), "data": str(data), "pairs": len(rows), "skipped": sum(skipped.values()),
            "preference_accuracy": float((margin > 0).double().mean()), "mean_logp_margin": float(margin.mean())}


@torch.no_grad()
def evaluate_chat(run: Path, data: str, *, batch_size: int = 8, device: str = "auto") -> dict[str, Any]:
    """Assistant-token loss (and perplexity) of the model in ``run`` on a chat JSONL file."""
    from tinyformer.data.chat_data import describe_skipped, read_chat_file

    model, template, pad, dev = _load(run, device)
    chat = read_chat_file(data)
    rows, skipped = [], chat.skipped.copy()
    for conv in chat.conversations:
        row, _ = conversation_row(conv, model.cfg.max_seq_len, template)
        if row is None:
            skipped["no assistant token within the context"] += 1
        else:
            rows.append(row)
    if not rows:
        raise DataError(f"{data} has no usable conversation; {describe_skipped(skipped) or 'it is empty'}")
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


def evaluate_chat_data(run: Path, data: str, *, batch_size: int = 8, device: str = "auto"
                       ) -> tuple[str, dict[str, Any]] | None:
    """(file kind, figures) of the model in ``run`` on a chat or preference .jsonl file: "preference" with
    :func:`evaluate_preferences`' figures, "chat" with :func:`evaluate_chat`'s; None when ``data`` is neither
    (plain text: the caller's language-model evaluation applies)."""
    from tinyformer.data.chat_data import file_kind

    path = Path(data)
    if path.suffix.lower() != ".jsonl" or not path.is_file():
        return None
    kind = file_kind(path)
    if kind is None:
        return None
    if kind == "preference":
        return kind, evaluate_preferences(run, data, batch_size=batch_size, device=device)
    return kind, evaluate_chat(run, data, batch_size=batch_size, device=device)
