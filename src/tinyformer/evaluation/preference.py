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
from typing import Any

import torch
import torch.nn.functional as F

from tinyformer.errors import DataError
from tinyformer.training.objectives.dpo import encode_pair, score_pairs
from tinyformer.training.objectives.sft import IGNORE, conversation_row, pad_rows

# preference files, and chat files of every format: the file's items, how one is encoded into a row, why one
# is skipped, what a row is called
_KINDS = {"preference": ("pairs", encode_pair, "prompt longer than the context", "preference pair"),
          "chat": ("conversations", conversation_row, "no assistant token within the context", "conversation")}


@torch.no_grad()
def evaluate_chat_data(run: Path, data: str, *, batch_size: int = 8, device: str = "auto"
                       ) -> tuple[str, dict[str, Any]] | None:
    """(file kind, figures) of the model in ``run`` on a chat or preference .jsonl file: "preference" with the
    preference accuracy and mean log-prob margin, "chat" with the assistant-token loss (and perplexity); None when
    ``data`` is neither (plain text: the caller's language-model evaluation applies). An item that encodes to no
    row is skipped and counted; a DataError when no row is left."""
    from tinyformer.data.chat_data import describe_skipped, file_kind, read_chat_file, read_preference_file
    from tinyformer.data.chat_template import ChatTemplate
    from tinyformer.devices import resolve_device
    from tinyformer.run_folder import load_model, load_tokenizer

    path = Path(data)
    if path.suffix.lower() != ".jsonl" or not path.is_file():
        return None
    kind = file_kind(path)
    if kind is None:
        return None
    items, encode, reason, what = _KINDS["preference" if kind == "preference" else "chat"]
    dev = resolve_device(device)
    model, tokenizer = load_model(run, device=dev), load_tokenizer(run)
    template, rows = ChatTemplate(tokenizer), []
    file = (read_preference_file if kind == "preference" else read_chat_file)(data)
    skipped = file.skipped
    for item in getattr(file, items):
        row, _ = encode(item, model.cfg.max_seq_len, template)
        if row is None:
            skipped[reason] += 1
        else:
            rows.append(row)
    if not rows:
        raise DataError(f"{data} has no usable {what}; {describe_skipped(skipped) or 'it is empty'}")
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    if kind == "preference":
        chosen, rejected = score_pairs(model, rows, pad, batch_size, dev)
        margin = (chosen - rejected).double()
        return kind, {"model": str(run), "data": str(data), "pairs": len(rows), "skipped": sum(skipped.values()),
                      "preference_accuracy": float((margin > 0).double().mean()),
                      "mean_logp_margin": float(margin.mean())}
    nll, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = pad_rows(rows[start : start + batch_size], pad)
        targets = batch["targets"].to(dev)
        logits = model(batch["input_ids"].to(dev)).float()
        nll += float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"))
        count += int((targets != IGNORE).sum())
    loss = nll / count
    return kind, {"model": str(run), "data": str(data), "conversations": len(rows), "skipped": sum(skipped.values()),
                  "assistant_tokens": count, "assistant_loss": loss, "perplexity": math.exp(min(loss, 700.0))}
