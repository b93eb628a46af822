"""Direct preference optimisation (``--objective dpo``, Rafailov et al. 2023) on (prompt, chosen, rejected) pairs.

    loss = -log sigmoid( beta * ((log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))) )

averaged over the pairs of a batch, with pi the model being trained, ref the frozen reference (the
``--init-from`` model), y_w the chosen and y_l the rejected reply, log p(y|x) summed over the reply's
tokens (:func:`sequence_logps`), beta = ``--dpo-beta`` (default 0.1).

The reference never changes, so its log-probabilities are computed once per pair, in eval mode,
before the first update, and kept (2 floats per pair): no second model stays in memory. With LoRA
adapters (``has_lora``) the reference is the model itself with its adapters switched off
(``lora_disabled``), which is the frozen base; otherwise the ``--init-from`` weights are loaded once
for that pass and dropped. Either way a resumed run computes the same reference values.

A batch holds B pairs as 2B right-padded rows (the chosen replies, then the rejected ones; see
``pair_batch``) and the pairs' indices. Pairs are split into train and held-out by a hash of the
first user message (as SFT does). Each evaluation adds to metrics.jsonl, for a fixed set of train
pairs and the held-out ones: the DPO loss, the reward margin mean(r_w - r_l), the reward accuracy
(r_w > r_l) and the preference accuracy (log pi(y_w|x) > log pi(y_l|x)). report.md gives the held-out
preference accuracy of the reference (before) and of the trained model (after).

Rows that cannot be used are skipped and counted: chosen == rejected, a prompt that fills the context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tinyformer.components.lora import has_lora, lora_disabled
from tinyformer.data.chat_data import PreferencePair, read_preference_file
from tinyformer.errors import DataError
from tinyformer.training.objectives.base import IGNORE, Batch, eval_mode, plain_module
from tinyformer.training.objectives.sft import ChatObjective, Row, first_user_text, pad_rows, reply_row

if TYPE_CHECKING:
    from tinyformer.data.chat_template import ChatTemplate
    from tinyformer.data.dataset import TokenDataset
    from tinyformer.data.tokenizer import Tokenizer
    from tinyformer.training.train_config import TrainConfig

SPLITS = ("train", "val")


class DPOObjective(ChatObjective):
    """DPO on preference pairs against a frozen reference (see the module docstring)."""

    name = "dpo"
    loss_label = "held-out DPO loss"
    loss_is_nll = False  # a pairwise loss: exp(loss) is no perplexity
    val_loss_key = "val_dpo_loss"  # the mean over pairs, as the trainer's val_loss (eval_weight: pairs)
    token_kind = "reply tokens"

    def __init__(self, cfg: TrainConfig, tokenizer: Tokenizer, dataset: TokenDataset | None) -> None:
        super().__init__(cfg, tokenizer, dataset)
        pairs, self.source, skipped = load_pairs(cfg.data)
        self.skipped.update(skipped)
        for pair in pairs:  # rows: (chosen row, rejected row) of each pair
            encoded, cut = encode_pair(pair, self._block(), self.template)
            if encoded is None:
                self.skipped["prompt longer than the context"] += 1
                continue
            self.truncated += cut
            self.rows[self._split(first_user_text(pair.prompt))].append(encoded)
        if not self.rows["train"]:
            raise self._no_data("preference pair to train on")
        #: reference log-probs per split, (N, 2) = (chosen, rejected); computed at the first loss
        self.reference: dict[str, torch.Tensor] | None = None

    def describe_data(self) -> str | None:
        return self._describe("preference pairs", f"beta {self.cfg.dpo_beta:g}")

    # ------------------------------------------------------------------ the reference
    def ensure_reference(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The reference log-probs of every pair, computed on first use (see the module docstring)."""
        if self.reference is not None:
            return self.reference
        model = plain_module(model)
        device = next(model.parameters()).device
        if has_lora(model):
            with lora_disabled(model):
                self.reference = self._score_all(model, device)
        else:
            self.reference = self._score_all(self._load_reference(model, device), device)
        return self.reference

    def _score_all(self, model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
        out = {}
        for split in SPLITS:
            if self.rows[split]:
                chosen, rejected = score_pairs(model, self.rows[split], self.pad_id, self.cfg.batch_size, device)
                out[split] = torch.stack([chosen, rejected], dim=1)
            else:
                out[split] = torch.zeros(0, 2)
        return out

    # ------------------------------------------------------------------ batches and loss
    def eval_weight(self, batch: Batch) -> int:
        return batch["pair_index"].numel()  # the loss is a mean over pairs: so is the held-out loss

    def tokens_per_step(self, sequences: int) -> str | None:
        # the chosen and rejected reply tokens (those that carry the loss), on average over the training pairs
        pairs = self.rows["train"]
        mean = sum(sum(t != IGNORE for t in c[1]) + sum(t != IGNORE for t in r[1]) for c, r in pairs) / len(pairs)
        return (f"{sequences} preference pairs (~{mean:,.0f} chosen + rejected reply tokens each carry the loss: "
                f"~{sequences * mean:,.0f} tokens per step)")

    def _batch(self, split: str, index: list[int]) -> Batch:
        batch = pair_batch([self.rows[split][i] for i in index], self.pad_id)
        batch["pair_index"] = torch.tensor(index, dtype=torch.long)
        batch["split"] = torch.tensor(SPLITS.index(split))
        return batch

    def pair_terms(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor, torch.Tensor]:
        """(losses, chosen rewards, rejected rewards, log pi(chosen), log pi(rejected)), each (B,)."""
        reference = self.ensure_reference(model)[SPLITS[int(batch["split"])]]
        ref = reference[batch["pair_index"].cpu()].to(batch["input_ids"].device)
        chosen, rejected = sequence_logps(model, batch["input_ids"], batch["targets"]).chunk(2)
        losses, r_w, r_l = dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1], self.cfg.dpo_beta)
        return losses, r_w, r_l, chosen, rejected

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return self.pair_terms(model, batch)[0].mean()

    # ------------------------------------------------------------------ figures
    @torch.no_grad()
    def split_metrics(self, model: nn.Module, split: str, device: torch.device) -> dict[str, float]:
        """DPO loss, reward margin, reward accuracy and preference accuracy over ``split``'s evaluation pairs."""
        terms = []
        with eval_mode(model):
            for batch in self.eval_batches(split, self.cfg.eval_iters or None):
                batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                terms.append(torch.stack(self.pair_terms(model, batch)).double().cpu())
        losses, r_w, r_l, chosen, rejected = torch.cat(terms, dim=1)
        return {f"{split}_dpo_loss": float(losses.mean()), f"{split}_reward_margin": float((r_w - r_l).mean()),
                f"{split}_reward_accuracy": float((r_w > r_l).double().mean()),
                f"{split}_preference_accuracy": float((chosen > rejected).double().mean())}

    def eval_metrics(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        out: dict[str, float] = {}
        for split in SPLITS:
            if self.rows[split]:
                out.update(self.split_metrics(model, split, device))
        return out

    def reference_accuracy(self, split: str, n: int | None = None) -> float | None:
        """Preference accuracy of the reference (the model before DPO) on the first ``n`` pairs of ``split``."""
        if self.reference is None or not len(self.reference[split]):
            return None
        ref = self.reference[split][:n]
        return float((ref[:, 0] > ref[:, 1]).double().mean())

    def report(self, model: nn.Module, device: torch.device) -> list[str]:
        self.ensure_reference(model)
        split = "val" if self.rows["val"] else "train"
        after = self.split_metrics(model, split, device)
        name = "held-out" if split == "val" else "train (no held-out pairs)"
        n = len(self.rows[split]) if not self.cfg.eval_iters else min(len(self.rows[split]),
                                                                      self.cfg.eval_iters * self.cfg.batch_size)
        before = self.reference_accuracy(split, n)
        return [f"## Preferences ({n} {name} pairs, beta {self.cfg.dpo_beta:g})", "",
                "| | before (reference) | after |", "|---|---|---|",
                f"| preference accuracy, log p(chosen) > log p(rejected) | {before:.3f} "
                f"| {after[f'{split}_preference_accuracy']:.3f} |",
                f"| reward margin | 0 | {after[f'{split}_reward_margin']:.4f} |",
                f"| reward accuracy | 0 | {after[f'{split}_reward_accuracy']:.3f} |"]


def load_pairs(data: str | None) -> tuple[list[PreferencePair], str, dict[str, int]]:
    """The pairs of ``data`` (a preference JSONL file), or the built-in preference set when None."""
    if data is None:
        from tinyformer.data.instructions import builtin_preferences

        return builtin_preferences(), "the built-in preference set", {}
    prefs = read_preference_file(data)
    return prefs.pairs, data, prefs.skipped


# ------------------------------------------------------------------ sequence log-probs and the DPO loss


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


def encode_pair(pair: PreferencePair, block_size: int, template: ChatTemplate
                ) -> tuple[tuple[Row, Row] | None, bool]:
    """((chosen row, rejected row) or None when the prompt is longer than the context, whether a reply was cut)."""
    rows = []
    cut = False
    for reply in (pair.chosen, pair.rejected):
        try:
            ids, mask = template.encode_conversation([*pair.prompt, {"role": "assistant", "content": reply}])
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
    return pad_rows([c for c, _ in pairs] + [r for _, r in pairs], pad_id)


@torch.no_grad()
def score_pairs(model: nn.Module, pairs: Sequence[tuple[Row, Row]], pad_id: int, batch_size: int,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(chosen|x), log pi(rejected|x)), each (N,) float32 on the CPU, in eval mode."""
    chosen, rejected = [], []
    with eval_mode(model):
        for start in range(0, len(pairs), batch_size):
            batch = pair_batch(pairs[start : start + batch_size], pad_id)
            logps = sequence_logps(model, batch["input_ids"].to(device), batch["targets"].to(device)).cpu()
            c, r = logps.chunk(2)
            chosen.append(c)
            rejected.append(r)
    return torch.cat(chosen), torch.cat(rejected)
