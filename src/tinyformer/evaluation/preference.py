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
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tinyformer.errors import DataError
from tinyformer.training.objectives.dpo import encode_pair, score_pairs
from tinyformer.training.objectives.sft import IGNORE, conversation_row, pad_rows


def _load(run: Path, device: str, data: str, read: Callable[[str], Any], field: str, encode: Callable[..., Any],
          reason: str, what: str) -> tuple[nn.Module, list[Any], Counter, int, torch.device]:
    """The run's model, the rows ``encode(item, max_seq_len, chat template)`` makes of the items in
    ``read(data).field`` (an item it makes None of is skipped, counted under ``reason``), the skip counts, the
    padding id and the device; a DataError naming ``what`` when no row is left."""
    from tinyformer.data.chat_data import describe_skipped
    from tinyformer.data.chat_template import ChatTemplate
    from tinyformer.devices import resolve_device
    from tinyformer.run_folder import load_model, load_tokenizer

    dev = resolve_device(device)
    model, tokenizer = load_model(run, device=dev), load_tokenizer(run)
    template, file, rows = ChatTemplate(tokenizer), read(data), []
    skipped = file.skipped
    for item in getattr(file, field):
        row, _ = encode(item, model.cfg.max_seq_len, template)
        if row is None:
            skipped[reason] += 1
        else:
            rows.append(row)
    if not rows:
        raise DataError(f"{data} has no usable {what}; {describe_skipped(skipped) or 'it is empty'}")
    return model, rows, skipped, tokenizer.pad_id if tokenizer.pad_id is not None else 0, dev


def evaluate_preferences(run: Path, data: str, *, batch_size: int = 8, device: str = "auto") -> dict[str, Any]:
    """Preference accuracy and mean log-prob margin of the model in ``run`` on a preference JSONL file."""
    from tinyformer.data.chat_data import read_preference_file

    model, rows, skipped, pad, dev = _load(run, device, data, read_preference_file, "pairs", encode_pair,
                                           "prompt longer than the context", "preference pair")
    chosen, rejected = score_pairs(model, rows, pad, batch_size, dev)
    margin = (chosen - rejected).double()
    return {"model": str(run), "data": str(data), "pairs": len(rows), "skipped": sum(skipped.values()),
            "preference_accuracy": float((margin > 0).double().mean()), "mean_logp_margin": float(margin.mean())}


@torch.no_grad()
def evaluate_chat(run: Path, data: str, *, batch_size: int = 8, device: str = "auto") -> dict[str, Any]:
    """Assistant-token loss (and perplexity) of the model in ``run`` on a chat JSONL file."""
    from tinyformer.data.chat_data import read_chat_file

    model, rows, skipped, pad, dev = _load(run, device, data, read_chat_file, "conversations", conversation_row,
                                           "no assistant token within the context", "conversation")
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
