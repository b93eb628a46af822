"""Supervised fine-tuning on conversations (``--objective sft``), and what every chat objective shares.

A chat objective fine-tunes a decoder run (``--init-from RUN``) on chat data (``--data FILE.jsonl``,
see :mod:`tinyformer.data.chat_data`; without ``--data`` the built-in instruction set of
:mod:`tinyformer.data.instructions`). A run whose tokenizer has no chat template gets ChatML
(:func:`~tinyformer.data.chat_template.with_chatml`): its two new token ids get new embedding rows
(and head rows when the head is untied), each the mean of the existing rows, so every old id keeps
its row and a new token starts as an "average" token rather than noise.

SFT: each conversation is rendered with the template and encoded with a mask that is 1 on assistant
replies (their end-of-turn token included, see :mod:`tinyformer.data.chat_template`). With x the
ids (B, T), m the mask and the prediction of token t + 1 from tokens <= t,

    loss = - sum_{b,t} m[b,t+1] log p(x[b,t+1] | x[b,<=t])  /  sum_{b,t} m[b,t+1]

i.e. the mean over assistant tokens only. A batch holds one conversation per row, right-padded
(targets -100 on padding): with causal attention a real token never sees the padding after it, so
no attention crosses conversations and no attention mask is needed. A conversation longer than
``block_size + 1`` tokens is cut to that length (counted); one left with no assistant token in the
window is skipped (counted). A fixed fraction (``val_fraction``) of conversations, chosen by a hash
of the first user message, is held out for validation. Batches are drawn with the trainer's seeded
generator only, so ``--resume`` continues the exact stream.

Schedule: unless ``--warmup-steps`` is given, a chat objective warms up for ``WARMUP_FRACTION`` of its
own ``--steps`` (the pretraining default of a fixed 40 steps would fill most of a 100-step DPO run).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from tinyformer.config import ModelConfig
from tinyformer.data.chat_data import Conversation, describe_skipped, is_heldout, read_chat_file
from tinyformer.errors import ConfigError, DataError
from tinyformer.training.objectives.base import IGNORE, Batch, Objective, eval_mode
from tinyformer.training.objectives.lm import lm_loss

if TYPE_CHECKING:
    from tinyformer.data.chat_template import ChatTemplate
    from tinyformer.data.dataset import TokenDataset
    from tinyformer.data.tokenizer import Tokenizer
    from tinyformer.training.train_config import TrainConfig

Row = tuple[list[int], list[int]]  # (input ids, targets with -100 where there is no loss)
SAMPLE_QUESTIONS = 3
SAMPLE_TOKENS = 64
REPORT_QUESTIONS = 5
#: a chat objective's default warm-up, as a fraction of its --steps
WARMUP_FRACTION = 0.1


def first_user_text(messages: Sequence[dict[str, str]]) -> str:
    return next((m["content"] for m in messages if m["role"] == "user"), "")


def grow_vocab(tensors: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """``tensors`` with ``tok_emb.weight`` and (untied) ``lm_head.weight`` extended to ``vocab_size`` rows;
    each new row is the mean of the existing rows, the existing rows are kept as they are."""
    out = dict(tensors)
    for key in ("tok_emb.weight", "lm_head.weight"):
        weight = out.get(key)
        if weight is not None and weight.shape[0] < vocab_size:
            mean = weight.float().mean(0, keepdim=True).to(weight.dtype)
            out[key] = torch.cat([weight, mean.expand(vocab_size - weight.shape[0], -1)], dim=0)
    return out


def pad_rows(rows: Sequence[Row], pad_id: int) -> Batch:
    """(input ids, targets) pairs of different lengths -> right-padded (B, T) tensors (targets -100 on padding)."""
    T = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    for i, (ids, tgt) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        targets[i, : len(tgt)] = torch.tensor(tgt)
    return {"input_ids": input_ids, "targets": targets, "tokens": int((targets != IGNORE).sum())}


def reply_row(ids: list[int], mask: list[int], block_size: int) -> tuple[Row | None, bool]:
    """(the (inputs, targets) row of encoded ids cut to ``block_size + 1`` tokens, targets -100 where ``mask`` is 0;
    whether they were cut); the row is None when no target is left in the context."""
    cut = len(ids) > block_size + 1
    ids, mask = ids[: block_size + 1], mask[: block_size + 1]
    targets = [t if m else IGNORE for t, m in zip(ids[1:], mask[1:])]
    if all(t == IGNORE for t in targets):
        return None, cut
    return (ids[:-1], targets), cut


def conversation_row(conv: Conversation, block_size: int, template: ChatTemplate) -> tuple[Row | None, bool]:
    """:func:`reply_row` of a conversation, its assistant tokens the targets (a bad row names its source)."""
    try:
        ids, mask = template.encode_conversation(conv.messages, conv.tools)
    except DataError as exc:
        raise DataError(f"{conv.source}: {exc}") from None
    return reply_row(ids, mask, block_size)


class ChatObjective(Objective):
    """What SFT and DPO share: a decoder fine-tuned from ``--init-from``, its tokenizer given a chat
    template, embeddings grown for the template's tokens, answers to held-out prompts as the sample."""

    uses_corpus: ClassVar[bool] = False
    uses_block_size: ClassVar[bool] = True
    no_task_reason: ClassVar[str | None] = "(it reads chat data)"

    def __init__(self, cfg: TrainConfig, tokenizer: Tokenizer, dataset: TokenDataset | None) -> None:
        super().__init__(cfg, tokenizer, dataset)
        from tinyformer.data.chat_template import ChatTemplate

        self.template = ChatTemplate(tokenizer)
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else (tokenizer.eos_id or 0)
        self.skipped: Counter = Counter()
        self.truncated = 0  # rows cut to the context
        #: each split's encoded rows (SFT: (input ids, targets); DPO: (chosen row, rejected row))
        self.rows: dict[str, list] = {"train": [], "val": []}

    @classmethod
    def make_tokenizer(cls, cfg: TrainConfig) -> Tokenizer:
        raise ConfigError(f"objective {cls.name!r} fine-tunes a trained model: give --init-from RUN (for example "
                          "the run folder of a plain `tinyformer train`)")

    @classmethod
    def adapt_tokenizer(cls, tokenizer: Tokenizer) -> Tokenizer:
        from tinyformer.data.chat_template import with_chatml

        return with_chatml(tokenizer)

    def model_config(self, model_cfg: ModelConfig) -> ModelConfig:
        if model_cfg.arch != "decoder":
            raise ConfigError(f"objective {self.name!r} fine-tunes a decoder, but model.arch is {model_cfg.arch!r}")
        return model_cfg.replace(vocab_size=max(model_cfg.vocab_size, self.tokenizer.vocab_size))

    def adapt_pretrained(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return grow_vocab(tensors, self.tokenizer.vocab_size)

    @classmethod
    def default_schedule(cls, cfg: TrainConfig) -> dict[str, int]:
        # a fine-tuning run is short: the pretraining default's fixed warm-up would fill most of it
        return {"warmup_steps": max(1, round(WARMUP_FRACTION * cfg.max_steps))}

    def _split(self, key: str) -> str:
        return "val" if is_heldout(key, self.cfg.val_fraction) else "train"

    def _no_data(self, what: str) -> DataError:
        """The error of a data set left with nothing to train on (``what``), naming what was skipped."""
        extra = f"; {describe_skipped(self.skipped)}" if self.skipped else ""
        return DataError(f"{self.source} has no {what}{extra}")

    def _describe(self, what: str, *extra: str) -> str:
        """The run's note on its data: ``what`` rows per split, how many were cut, ``extra``, what was skipped."""
        parts = [f"data: {len(self.rows['train']):,} train / {len(self.rows['val']):,} held-out {what} from "
                 f"{self.source}", f"{self.truncated} cut to the {self._block()}-token context", *extra]
        return "; ".join(parts + ([describe_skipped(self.skipped)] if self.skipped else []))

    def has_split(self, split: str) -> bool:
        return bool(self.rows.get(split))

    def _batch(self, split: str, index: list[int]) -> Batch:
        """The batch of rows ``index`` of ``split``."""
        raise NotImplementedError

    def get_batch(self, split: str, generator: torch.Generator, rank: int = 0, world_size: int = 1) -> Batch:
        index = torch.randint(0, len(self.rows[split]), (self.cfg.batch_size * world_size,), generator=generator)
        return self._batch(split, index[rank::world_size].tolist())  # every rank draws the same, keeps its share

    def eval_batches(self, split: str, max_batches: int | None, rank: int = 0, world_size: int = 1
                     ) -> Iterator[Batch]:
        B, n = self.cfg.batch_size, len(self.rows[split])
        for k, start in enumerate(range(rank * B, n, B * world_size)):
            if max_batches is not None and k >= max_batches:
                return
            yield self._batch(split, list(range(start, min(start + B, n))))

    def _load_reference(self, model: nn.Module, device: torch.device) -> nn.Module:
        """The ``--init-from`` weights in a frozen model shaped like ``model`` (embeddings grown as for training):
        the reference of DPO and GRPO when the run trains every weight."""
        from tinyformer.models import empty_model
        from tinyformer.run_folder import model_tensors, rebuild_buffers
        from tinyformer.training.checkpoint import load_weights

        assert self.cfg.init_from is not None, "a chat objective always starts from --init-from"
        reference = empty_model(model.cfg, device)  # as run_folder.load_model builds: the weights come next
        rebuild_buffers(reference, device)
        # as Trainer.load_pretrained reads them: a LoRA run's are its base with the adapter merged
        tensors = self.adapt_pretrained(dict(model_tensors(Path(self.cfg.init_from))))
        if model.cfg.tie_embeddings:
            reference.lm_head.weight = reference.tok_emb.weight
        load_weights(reference, tensors, f"the {self.name} reference {self.cfg.init_from}")
        return reference.requires_grad_(False)

    @torch.no_grad()
    def answer(self, model: nn.Module, prompts: Sequence[Sequence[dict[str, str]]], device: torch.device | str,
               max_new_tokens: int = SAMPLE_TOKENS) -> list[str]:
        """Greedy replies of ``model`` to each prompt (messages ending with a user turn), rendered with the
        chat template, each stopping at an end-of-turn token or EOS."""
        from tinyformer.generation.generator import Generator
        from tinyformer.generation.sampling import GREEDY_TEMPERATURE, SamplingParams

        model = getattr(model, "_orig_mod", model)  # a compiled wrapper's module
        replies = []
        with eval_mode(model):
            gen = Generator(model, self.tokenizer)
            for messages in prompts:
                ids = self.template.encode_prompt(messages)
                room = model.cfg.max_seq_len - len(ids)
                if room <= 0:
                    replies.append("(the prompt is longer than the context)")
                    continue
                params = SamplingParams(temperature=GREEDY_TEMPERATURE, max_new_tokens=min(max_new_tokens, room),
                                        stop_token_ids=self.template.stop_token_ids).validate()
                replies.append(gen.generate([ids], params)[0].text.strip())
        return replies


class SFTObjective(ChatObjective):
    """Supervised fine-tuning: next-token loss on assistant tokens only (see the module docstring)."""

    name = "sft"
    loss_label = "held-out assistant-token loss"
    token_kind = "assistant tokens"

    def __init__(self, cfg: TrainConfig, tokenizer: Tokenizer, dataset: TokenDataset | None) -> None:
        super().__init__(cfg, tokenizer, dataset)
        conversations, self.source, skipped = load_conversations(cfg.data)
        self.skipped.update(skipped)
        self.heldout: list[Conversation] = []
        for conv in conversations:
            row, cut = conversation_row(conv, self._block(), self.template)
            self.truncated += cut
            if row is None:
                self.skipped["no assistant token within the context"] += 1
                continue
            split = self._split(first_user_text(conv.messages))
            self.rows[split].append(row)
            if split == "val":
                self.heldout.append(conv)
        if not self.rows["train"]:
            raise self._no_data("conversation to train on")

    def describe_data(self) -> str | None:
        return self._describe("conversations")

    def tokens_per_step(self, sequences: int) -> str | None:
        # the assistant tokens that carry the loss, on average over the training conversations
        mean = sum(sum(t != IGNORE for t in tgt) for _, tgt in self.rows["train"]) / len(self.rows["train"])
        return (f"{sequences} conversations (~{mean:,.0f} assistant tokens each carry the loss: "
                f"~{sequences * mean:,.0f} tokens per step)")

    def _batch(self, split: str, index: list[int]) -> Batch:
        return pad_rows([self.rows[split][i] for i in index], self.pad_id)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return lm_loss(model, batch["input_ids"], batch["targets"])

    def heldout_prompts(self, n: int) -> list[tuple[list[dict[str, str]], str]]:
        """(prompt messages, expected reply) of ``n`` held-out conversations spread evenly over the held-out
        split (a file's, or the built-in set's, kinds of question usually come in runs), cut before their last
        assistant turn."""
        out = []
        step = max(1, len(self.heldout) // n) if n > 0 else 1
        for conv in self.heldout[::step][:n]:
            last = max(i for i, m in enumerate(conv.messages) if m["role"] == "assistant")
            out.append((conv.messages[:last], conv.messages[last]["content"]))
        return out

    def sample(self, model: nn.Module, device: torch.device) -> str | None:
        """Greedy answers to the first held-out questions, next to the expected answers."""
        if self.cfg.sample_tokens <= 0 or not self.heldout:
            return None
        pairs = self.heldout_prompts(SAMPLE_QUESTIONS)
        replies = self.answer(model, [p for p, _ in pairs], device, min(SAMPLE_TOKENS, self.cfg.sample_tokens))
        return "\n".join(f"Q: {prompt[-1]['content']}\nA: {reply}\n   (reference: {expected})"
                         for (prompt, expected), reply in zip(pairs, replies))

    def report(self, model: nn.Module, device: torch.device) -> list[str]:
        pairs = self.heldout_prompts(REPORT_QUESTIONS)
        if not pairs:
            return []
        budget = min(SAMPLE_TOKENS, self.cfg.sample_tokens) if self.cfg.sample_tokens else SAMPLE_TOKENS
        replies = self.answer(model, [p for p, _ in pairs], device, budget)
        lines = [f"## {len(pairs)} held-out questions, answered greedily", ""]
        for (prompt, expected), reply in zip(pairs, replies):
            lines += [f"- **Q:** {prompt[-1]['content']}", f"  **A:** {reply}", f"  *reference:* {expected}"]
        return lines


def load_conversations(data: str | None) -> tuple[list[Conversation], str, Counter]:
    """The conversations of ``data`` (a chat JSONL file), or of the built-in instruction set when None."""
    if data is None:
        from tinyformer.data.instructions import builtin_conversations

        return builtin_conversations(), "the built-in instruction set", Counter()
    chat = read_chat_file(data)
    return chat.conversations, data, chat.skipped
