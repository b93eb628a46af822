"""Synthetic sequence-to-sequence tasks, generated on the fly (``train --objective seq2seq --task NAME``).

    reverse   "40213"       -> "31204"       the digits in reverse order
    sort      "40213"       -> "01234"       the digits in increasing order
    add       "4021+385"    -> "4406"        the decimal sum of two numbers

Each example is generated from a seeded ``torch.Generator``, so there is no dataset to download and
runs are exactly reproducible. A fixed held-out set (its own seed) is kept out of training: a training
example that equals a held-out source of 4 or more digits is redrawn, so held-out exact match measures
generalisation, not recall (see ``TaskData``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tinyformer.errors import ConfigError

if TYPE_CHECKING:
    from tinyformer.data.tokenizer import Tokenizer

ALPHABET = "0123456789+"
Example = tuple[str, str]  # (source, target)


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
        self._excluded = {s for s, _ in self.heldout if sum(c.isdigit() for c in s) >= self.MIN_EXCLUDED_DIGITS}

    def train_examples(self, n: int, generator: torch.Generator) -> list[Example]:
        out: list[Example] = []
        while len(out) < n:
            ex = self.task.example(generator)
            if ex[0] not in self._excluded:
                out.append(ex)
        return out
