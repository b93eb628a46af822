"""Offline task files: multiple-choice and exact-answer questions, scored without the internet.

A task file is JSONL, one question per line, of either kind (they may be mixed):

    {"question": "...", "choices": ["a", "b", ...], "answer": 0}          multiple choice
    {"prompt": "...", "answer": "...", "stop": ["\\n"]}                   exact answer ("stop" optional)
    {"prompt": "...", "answer": "...", "chat": true}                     exact answer to a user message

Multiple choice, as lm-eval's ``multiple_choice`` tasks score it. The context is
``"Question: {question}\\nAnswer:"`` and choice i is the continuation ``" " + choices[i]``; with
ll_i = log p(" " + choice_i | context) (:func:`~tinyformer.evaluation.scoring.score_continuations`):

    acc       = [argmax_i ll_i == answer]
    acc_norm  = [argmax_i ll_i / len(choice_i) == answer]            characters of the choice string
    acc_bytes = [argmax_i ll_i / len(utf8(choice_i)) == answer]

(the first maximum wins ties, as ``numpy.argmax``); each is averaged over the questions, with the
standard error of the mean sqrt(s^2 / n). Context and continuation are tokenised as lm-eval does
(:func:`encode_pair`), so the scores equal lm-eval's on the same questions.

Exact answer: greedy generation from the prompt (at most ``max_new_tokens`` tokens, ended by a stop
string, default a newline, or EOS); exact_match = [generated.strip() == answer.strip()]. With
``"chat": true`` the prompt is a user message, rendered with the model's chat template as
``generate --chat`` renders it (the plain ``User:`` format for a model without one), and the
template's end-of-turn tokens end the answer too.

``--task instructions`` is the held-out split of the built-in instruction set
(:func:`~tinyformer.data.instructions.heldout_questions`) as chat rows: what an SFT run on it is
measured on, and what its base model scores before.

:func:`builtin_task` builds a multiple-choice task from the CPython standard library sources (the
public modules of :func:`~tinyformer.data.stdlib_names.public_modules`): "Which module
provides `OrderedDict`?" over public classes defined in exactly one public module, with three other
modules as distractors. It is the same for the same Python version.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinyformer.errors import DataError
from tinyformer.report_card import REPORT, merge_eval_table, task_rows
from tinyformer.utils.io import read_utf8

__all__ = ["BUILTIN", "INSTRUCTIONS", "ExactAnswer", "MultipleChoice", "builtin_task", "encode_pair", "evaluate_items",
           "instruction_task", "mc_context", "read_task_file"]

BUILTIN = "builtin"
INSTRUCTIONS = "instructions"
DEFAULT_STOP = ("\n",)


@dataclass(frozen=True)
class MultipleChoice:
    question: str
    choices: tuple[str, ...]
    answer: int


@dataclass(frozen=True)
class ExactAnswer:
    prompt: str
    answer: str
    stop: tuple[str, ...] = field(default=DEFAULT_STOP)
    chat: bool = False


def mc_context(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def _row(obj: Any, where: str) -> MultipleChoice | ExactAnswer:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a task row must be a JSON object, got {type(obj).__name__}")
    if "question" in obj or "choices" in obj:
        q, choices, answer = obj.get("question"), obj.get("choices"), obj.get("answer")
        if not isinstance(q, str) or not q.strip():
            raise DataError(f"{where}: \"question\" must be a non-empty string")
        if (not isinstance(choices, list) or len(choices) < 2
                or not all(isinstance(c, str) and c for c in choices)):
            raise DataError(f"{where}: \"choices\" must be a list of at least 2 non-empty strings")
        if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
            raise DataError(f"{where}: \"answer\" must be the index of the right choice (0 .. {len(choices) - 1}), "
                            f"got {answer!r}")
        return MultipleChoice(q, tuple(choices), answer)
    if "prompt" in obj:
        prompt, answer, stop = obj.get("prompt"), obj.get("answer"), obj.get("stop", list(DEFAULT_STOP))
        if not isinstance(prompt, str) or not prompt:
            raise DataError(f"{where}: \"prompt\" must be a non-empty string")
        if not isinstance(answer, str):
            raise DataError(f"{where}: \"answer\" of an exact-answer row must be a string, got {answer!r}")
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise DataError(f"{where}: \"stop\" must be a list of non-empty strings")
        chat = obj.get("chat", False)
        if not isinstance(chat, bool):
            raise DataError(f"{where}: \"chat\" must be true or false, got {chat!r}")
        return ExactAnswer(prompt, answer, tuple(stop), chat)
    raise DataError(f"{where}: a task row needs \"question\", \"choices\", \"answer\" (multiple choice) or "
                    "\"prompt\", \"answer\" (exact answer)")


def read_task_file(path: str | Path) -> list[MultipleChoice | ExactAnswer]:
    """The questions of a JSONL task file; a malformed row is a :class:`DataError` naming file and line."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"task file {p} does not exist")
    items: list[MultipleChoice | ExactAnswer] = []
    for n, line in enumerate(read_utf8(p, DataError, "task file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise DataError(f"{p}:{n}: not valid JSON ({exc})") from None
        items.append(_row(obj, f"{p}:{n}"))
    if not items:
        raise DataError(f"task file {p} has no questions")
    return items


# ------------------------------------------------------------------------------------------------
# the built-in task
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def _class_owners(stdlib_dir: str | None) -> dict[str, list[str]]:
    """Public top-level class name -> the public modules that define it, in path order."""
    from tinyformer.data.corpus import stdlib_root
    from tinyformer.data.stdlib_names import public_modules

    owners: dict[str, list[str]] = {}
    for module, tree in public_modules(stdlib_root(stdlib_dir)):
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                owners.setdefault(node.name, []).append(module)
    return owners


def builtin_task(n: int = 100, seed: int = 0, stdlib_dir: str | Path | None = None) -> list[MultipleChoice]:
    """``n`` questions "Which module provides `Name`?" with four module names as choices (fewer if the
    standard library has fewer unambiguous classes). Deterministic for a given ``seed`` and stdlib."""
    owners = _class_owners(None if stdlib_dir is None else str(stdlib_dir))
    unique = sorted((name, mods[0]) for name, mods in owners.items() if len(mods) == 1)
    modules = sorted({m for mods in owners.values() for m in mods})
    if len(modules) < 4 or not unique:
        raise DataError("the standard library sources are too few to build the built-in task")
    rng = random.Random(seed)
    picked = rng.sample(unique, min(n, len(unique)))
    items = []
    for name, module in picked:
        choices = rng.sample([m for m in modules if m != module], 3)
        answer = rng.randrange(4)
        choices.insert(answer, module)
        items.append(MultipleChoice(f"Which module provides `{name}`?", tuple(choices), answer))
    return items


# ------------------------------------------------------------------------------------------------
# scoring
# ------------------------------------------------------------------------------------------------


def encode_pair(encode: Callable[[str], list[int]], context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of (context, continuation) as lm-eval's causal models take them: trailing spaces of
    the context move to the continuation, the whole text is encoded and split after the context's
    tokens (so a token spanning the boundary belongs to the continuation)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = encode(context + continuation)
    ctx = encode(context)
    return ctx, whole[len(ctx):]


def _mean_stderr(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def evaluate_items(model: Any, tokenizer: Any, items: Sequence[MultipleChoice | ExactAnswer], *,
                   batch_size: int = 8, max_new_tokens: int = 32, progress: bool = False) -> dict[str, Any]:
    """Score ``items`` with a decoder LM: acc / acc_norm / acc_bytes over the multiple-choice rows and
    exact_match over the exact-answer rows (each with its standard error and row count)."""
    from tinyformer.evaluation.scoring import score_continuations

    special = getattr(tokenizer, "kind", "hf") == "hf"  # foreign tokenizers may add e.g. BOS, as in `generate`

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=special))

    result: dict[str, Any] = {}
    mc = [it for it in items if isinstance(it, MultipleChoice)]
    if mc:
        requests, owner = [], []
        for q, it in enumerate(mc):
            ctx = mc_context(it.question)
            for choice in it.choices:
                requests.append(encode_pair(encode, ctx, " " + choice))
                owner.append(q)
        empty = next((i for i, (c, k) in enumerate(requests) if not c or not k), None)
        if empty is not None:
            raise DataError(f"question {owner[empty] + 1} encodes to no context or no choice tokens")
        scores = iter(score_continuations(model, requests, batch_size=batch_size, progress=progress))
        # each metric's length of a choice (the log-likelihood is divided by it): none, characters, UTF-8 bytes
        lengths = {"acc": None, "acc_norm": len, "acc_bytes": lambda c: len(c.encode("utf-8"))}
        hits: dict[str, list[float]] = {name: [] for name in lengths}
        for it in mc:
            lls = [next(scores).logprob for _ in it.choices]
            for name, length in lengths.items():
                normed = lls if length is None else [ll / length(c) for ll, c in zip(lls, it.choices)]
                best = max(range(len(normed)), key=lambda i: (normed[i], -i))  # the first maximum wins ties
                hits[name].append(float(best == it.answer))
        result["multiple_choice"] = {"n": len(mc)}
        for name, values in hits.items():
            mean, err = _mean_stderr(values)
            result["multiple_choice"].update({name: mean, f"{name}_stderr": err})
    exact = [it for it in items if isinstance(it, ExactAnswer)]
    if exact:
        hits = _exact_match(model, tokenizer, exact, batch_size, max_new_tokens)
        mean, err = _mean_stderr(hits)
        result["exact_answer"] = {"n": len(exact), "exact_match": mean, "exact_match_stderr": err}
    return result


def _exact_match(model: Any, tokenizer: Any, items: Sequence[ExactAnswer], batch_size: int,
                 max_new_tokens: int) -> list[float]:
    """Greedy answers, batched by stop strings; the prompt keeps its last max_seq_len - max_new_tokens
    tokens (as lm-eval's ``generate_until`` cuts it)."""
    from tinyformer.data.chat_template import ChatTemplate
    from tinyformer.generation.generator import Generator
    from tinyformer.generation.sampling import GREEDY_TEMPERATURE, SamplingParams

    gen = Generator(model, tokenizer)
    room = gen.max_seq_len - max_new_tokens
    if room < 1:
        raise DataError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's context "
                        f"of {gen.max_seq_len} tokens")
    template = ChatTemplate(tokenizer) if any(it.chat for it in items) else None
    hits = [0.0] * len(items)
    by_stop: dict[tuple[tuple[str, ...], bool], list[int]] = {}
    for i, it in enumerate(items):
        by_stop.setdefault((it.stop, it.chat), []).append(i)
    for (stop, chat), members in by_stop.items():
        params = SamplingParams(temperature=GREEDY_TEMPERATURE, max_new_tokens=max_new_tokens, stop_strings=stop,
                                stop_token_ids=template.stop_token_ids if template and chat else ()).validate()
        for j in range(0, len(members), batch_size):
            part = members[j : j + batch_size]
            prompts = [(template.encode_prompt([{"role": "user", "content": items[i].prompt}]) if template and chat
                        else gen.encode(items[i].prompt))[-room:] for i in part]
            for i, res in zip(part, gen.generate(prompts, params, logprobs=False)):
                hits[i] = float(res.text.strip() == items[i].answer.strip())
    return hits


def instruction_task(fraction: float = 0.1, stdlib_dir: str | Path | None = None) -> list[ExactAnswer]:
    """The held-out questions of the built-in instruction set as chat exact-answer rows (``--task instructions``),
    in the order of sha1(question): the set lists its kinds of question and its modules in runs, so that
    ``--limit N`` takes a sample of all of them rather than the first module's."""
    import hashlib

    from tinyformer.data.instructions import heldout_questions

    rows = sorted(heldout_questions(fraction, stdlib_dir), key=lambda qa: hashlib.sha1(qa[0].encode()).hexdigest())
    return [ExactAnswer(q, a, DEFAULT_STOP, True) for q, a in rows]


def add_builtin_accuracy(run: str | Path, model: Any, tokenizer: Any, questions: int = 100, batch_size: int = 8,
                         stdlib_dir: str | Path | None = None) -> Path | None:
    """Score the built-in task and put its accuracy into ``run``'s report card (if it has one): what a
    training recipe calls at its end so that its report card shows an accuracy beside the loss."""
    if not (Path(run) / REPORT).is_file():
        return None
    scores = evaluate_items(model, tokenizer, builtin_task(questions, stdlib_dir=stdlib_dir), batch_size=batch_size)
    return merge_eval_table(run, task_rows(f"task {BUILTIN}", scores))
