"""Synthetic sequence-to-sequence tasks and the ``seq2seq`` objective that trains an encoder-decoder on them.

    reverse   "40213"       -> "31204"       the digits in reverse order
    sort      "40213"       -> "01234"       the digits in increasing order
    add       "4021+385"    -> "4406"        the decimal sum of two numbers

Each example is generated on the fly from a seeded ``torch.Generator``, so there is no dataset to
download and runs are exactly reproducible. A fixed held-out set (its own seed) is kept out of
training: a training example that equals a held-out source of 4 or more digits is redrawn, so
held-out exact match measures generalisation, not recall (see ``TaskData``).

Token layout (a char tokenizer over the task alphabet): <|bos|> = 0, <|eos|> = 1, <|pad|> = 2, then
the characters. A batch is

    src_ids  (B, S)  source characters, right-padded with pad;  src_mask (B, S)  1 = real, 0 = pad
    tgt_in   (B, T)  [bos, y_1 .. y_n], right-padded
    tgt_out  (B, T)  [y_1 .. y_n, eos], -100 on padding (left out of the loss)

``tinyformer train --objective seq2seq --task add --preset transformer-tiny`` trains one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError
from tinyformer.training.objectives.base import Batch, Objective

if TYPE_CHECKING:
    from tinyformer.data.dataset import TokenDataset
    from tinyformer.data.tokenizer import Tokenizer
    from tinyformer.training.train_config import TrainConfig

ALPHABET = "0123456789+"
IGNORE = -100
Example = tuple[str, str]


@dataclass(frozen=True)
class Task:
    """A family of (source, target) string pairs. ``min_len``/``max_len`` bound the digits per operand."""

    name: str
    description: str
    min_len: int
    max_len: int

    def target(self, source: str) -> str:
        raise NotImplementedError

    def _digits(self, n: int, generator: torch.Generator) -> str:
        return "".join(map(str, torch.randint(0, 10, (n,), generator=generator).tolist()))

    def _length(self, generator: torch.Generator) -> int:
        return int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=generator))

    def source(self, generator: torch.Generator) -> str:
        return self._digits(self._length(generator), generator)

    def example(self, generator: torch.Generator) -> Example:
        src = self.source(generator)
        return src, self.target(src)

    @property
    def max_source_len(self) -> int:
        return self.max_len

    @property
    def max_target_len(self) -> int:
        return self.max_len


class Reverse(Task):
    def target(self, source: str) -> str:
        return source[::-1]


class Sort(Task):
    def target(self, source: str) -> str:
        return "".join(sorted(source))


class Add(Task):
    def source(self, generator: torch.Generator) -> str:
        a, b = self._length(generator), self._length(generator)
        # no leading zeros: "0042" is not how numbers are written
        return str(int(self._digits(a, generator))) + "+" + str(int(self._digits(b, generator)))

    def target(self, source: str) -> str:
        a, b = source.split("+")
        return str(int(a) + int(b))

    @property
    def max_source_len(self) -> int:
        return 2 * self.max_len + 1

    @property
    def max_target_len(self) -> int:
        return self.max_len + 1


TASKS: dict[str, Task] = {
    "reverse": Reverse("reverse", "reverse a string of 1-12 digits", 1, 12),
    "sort": Sort("sort", "sort a string of 1-12 digits", 1, 12),
    "add": Add("add", "add two numbers of 1-5 digits", 1, 5),
}


def get_task(name: str | None) -> Task:
    if name is None or name not in TASKS:
        known = ", ".join(f"{k} ({t.description})" for k, t in TASKS.items())
        raise ConfigError(f"{'--task is required' if name is None else f'unknown task {name!r}'}; tasks: {known}")
    return TASKS[name]


def task_tokenizer() -> Tokenizer:
    """The char tokenizer of every task: bos 0, eos 1, pad 2, then the characters of ALPHABET."""
    from tinyformer.data.tokenizer import Tokenizer

    return Tokenizer.train_char(ALPHABET)


def make_batch(examples: Sequence[Example], tokenizer: Tokenizer) -> Batch:
    """Pad a list of (source, target) strings into the tensors described in the module docstring."""
    bos, eos, pad = tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id
    src = [tokenizer.encode(s) for s, _ in examples]
    tgt = [tokenizer.encode(t) for _, t in examples]
    B, S, T = len(examples), max(map(len, src)), max(map(len, tgt)) + 1
    src_ids = torch.full((B, S), pad, dtype=torch.long)
    src_mask = torch.zeros(B, S, dtype=torch.long)
    tgt_in = torch.full((B, T), pad, dtype=torch.long)
    tgt_out = torch.full((B, T), IGNORE, dtype=torch.long)
    for i, (s, t) in enumerate(zip(src, tgt)):
        src_ids[i, : len(s)] = torch.tensor(s)
        src_mask[i, : len(s)] = 1
        tgt_in[i, : len(t) + 1] = torch.tensor([bos, *t])
        tgt_out[i, : len(t) + 1] = torch.tensor([*t, eos])
    return {"src_ids": src_ids, "src_mask": src_mask, "tgt_in": tgt_in, "tgt_out": tgt_out,
            "tokens": int((tgt_out != IGNORE).sum())}


class TaskData:
    """Training examples drawn on the fly, and a fixed held-out set kept out of them.

    A held-out source with at least ``MIN_EXCLUDED_DIGITS`` digits is never trained on (10^4 or more
    strings share its length, so excluding the held-out ones leaves the rest of the distribution
    intact). Shorter sources are so few (10 strings of length 1) that holding them out would remove
    most of their length from training, so they are trained on like any other; for them, held-out
    exact match measures recall.
    """

    MIN_EXCLUDED_DIGITS = 4

    def __init__(self, task: Task, n_heldout: int = 1000, seed: int = 0) -> None:
        self.task = task
        g = torch.Generator().manual_seed(10_000 + seed)
        self.heldout: list[Example] = [task.example(g) for _ in range(n_heldout)]
        self._excluded = {s for s, _ in self.heldout if _digits(s) >= self.MIN_EXCLUDED_DIGITS}

    def train_examples(self, n: int, generator: torch.Generator) -> list[Example]:
        out: list[Example] = []
        while len(out) < n:
            ex = self.task.example(generator)
            if ex[0] not in self._excluded:
                out.append(ex)
        return out


def _digits(source: str) -> int:
    return sum(c.isdigit() for c in source)


@torch.no_grad()
def decode_examples(model: nn.Module, tokenizer: Tokenizer, examples: Sequence[Example], batch_size: int = 250,
                    num_beams: int = 1, device: torch.device | str = "cpu") -> list[str]:
    """The model's output string for the source of each example: greedy, or beam search with ``num_beams``
    (the best hypothesis, with beam search's default length penalty and early stopping)."""
    from tinyformer.generation.seq2seq import beam_search, greedy_decode

    was_training = model.training
    model.eval()
    outputs: list[str] = []
    try:
        for i in range(0, len(examples), batch_size):
            batch = make_batch(examples[i : i + batch_size], tokenizer)
            src, mask = batch["src_ids"].to(device), batch["src_mask"].to(device)
            # room to overshoot the longest target, which then counts as wrong
            max_new = min(batch["tgt_out"].shape[1] + 2, model.cfg.max_seq_len)
            kwargs = dict(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, max_new_tokens=max_new)
            if num_beams > 1:
                ids = [h[0].output_ids for h in beam_search(model, src, mask, num_beams=num_beams, **kwargs)]
            else:
                ids = greedy_decode(model, src, mask, **kwargs)
            outputs += [tokenizer.decode(row) for row in ids]
    finally:
        model.train(was_training)
    return outputs


def exact_match(model: nn.Module, tokenizer: Tokenizer, examples: Sequence[Example], batch_size: int = 250,
                num_beams: int = 1, device: torch.device | str = "cpu") -> float:
    """Fraction of ``examples`` whose greedy (or beam) output equals the target exactly."""
    outputs = decode_examples(model, tokenizer, examples, batch_size, num_beams, device)
    return sum(out == tgt for out, (_, tgt) in zip(outputs, examples)) / max(1, len(examples))


class Seq2SeqObjective(Objective):
    """Teacher-forced cross-entropy of the target given the source, on a synthetic task (``--task``).

    loss = -1/N sum_{b,t} log p(y_{b,t} | y_{b,<t}, x_b), over the N real target tokens (EOS included).
    """

    name = "seq2seq"
    uses_corpus: ClassVar[bool] = False
    n_heldout = 1000

    def __init__(self, cfg: TrainConfig, tokenizer: Tokenizer, dataset: TokenDataset | None) -> None:
        super().__init__(cfg, tokenizer, dataset)
        self.task = get_task(cfg.task)
        self.data = TaskData(self.task, self.n_heldout, seed=0)
        # a fixed sample of training examples, for the trainer's "train" evaluation
        self._train_eval = self.data.train_examples(self.n_heldout, torch.Generator().manual_seed(20_000))

    @classmethod
    def make_tokenizer(cls, cfg: TrainConfig) -> Tokenizer:
        get_task(cfg.task)
        return task_tokenizer()

    def model_config(self, model_cfg: ModelConfig) -> ModelConfig:
        if model_cfg.arch != "encoder_decoder":
            raise ConfigError(f"objective 'seq2seq' trains an encoder-decoder, but model.arch is {model_cfg.arch!r}; "
                              "use --preset transformer-tiny (or set model.arch=encoder_decoder)")
        need = max(self.task.max_source_len, self.task.max_target_len + 1) + 2
        if model_cfg.max_seq_len < need:
            raise ConfigError(f"task {self.task.name!r} needs model.max_seq_len >= {need}, got {model_cfg.max_seq_len}")
        return model_cfg.replace(vocab_size=self.tokenizer.vocab_size, pad_token_id=self.tokenizer.pad_id)

    def has_split(self, split: str) -> bool:
        return split in ("train", "val")

    def get_batch(self, split: str, generator: torch.Generator, rank: int = 0, world_size: int = 1) -> Batch:
        if split == "train":
            return make_batch(self.data.train_examples(self.cfg.batch_size, generator), self.tokenizer)
        index = torch.randint(0, len(self.data.heldout), (self.cfg.batch_size,), generator=generator).tolist()
        return make_batch([self.data.heldout[i] for i in index], self.tokenizer)

    def eval_batches(self, split: str, max_batches: int | None, rank: int = 0, world_size: int = 1
                     ) -> Iterator[Batch]:
        examples = self.data.heldout if split == "val" else self._train_eval
        B = self.cfg.batch_size
        starts = list(range(rank * B, len(examples), B * world_size))
        for n, start in enumerate(starts):
            if max_batches is not None and n >= max_batches:
                return
            yield make_batch(examples[start : start + B], self.tokenizer)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return model.loss(batch["src_ids"], batch["tgt_in"], batch["tgt_out"], src_mask=batch["src_mask"])

    def sample(self, model: nn.Module, device: torch.device) -> str | None:
        """Held-out exact match (greedy) on 200 examples, and three decoded examples."""
        examples = self.data.heldout[:200]
        outputs = decode_examples(model, self.tokenizer, examples, device=device)
        score = sum(out == tgt for out, (_, tgt) in zip(outputs, examples)) / len(examples)
        lines = [f"{self.task.name}: held-out exact match {score:.1%} (greedy, {len(examples)} examples)"]
        for (src, tgt), got in zip(examples[:3], outputs[:3]):
            lines.append(f"  {src} -> {got}" + ("" if got == tgt else f"   (expected {tgt})"))
        return "\n".join(lines)
