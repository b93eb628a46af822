"""Logits processors and the per-token sampler.

Every processor is a small callable ``proc(logits, generated) -> logits`` where ``logits`` is a
``[B, V]`` float tensor of next-token scores and ``generated`` holds the token ids the penalties look
at: a :class:`PenaltyHistory` (what decoding passes, built by :func:`penalty_history`), a ``[B, t]``
integer tensor that every penalty sees alike, or ``None``. Processors are batched, never loop over the
vocabulary in Python, never modify their input in place, and return a tensor of the input's dtype.
Filtering processors set removed tokens to ``-inf`` so that ``softmax`` gives them probability 0.

:func:`build_processors` turns a :class:`SamplingParams` into the canonical processor chain (leaving out
every processor that would be a no-op), a :class:`Sampler` holds that chain for rows that sample alike,
and :func:`sample` draws one token per row. ``sample`` is the one function every entry point draws
through (``Generator`` for ``generate``, ``chat``, ``eval``'s generation, lm-eval's ``generate_until`` and
the trainer's samples; the server's scheduler; the engine's compiled greedy step; greedy search of the
encoder-decoder), and greedy decoding (argmax) is its temperature-0 case:

    x = processors(logits)                        penalties, temperature, top-k, top-p, min-p
    y = argmax_v x_v                              greedy: temperature 0 or top-k 1
    y = min { v : sum_{u <= v} e^{x_u} > U * sum_u e^{x_u} },  U ~ Uniform[0, 1)    otherwise

Rows with different settings share one call: rows whose samplers have equal :attr:`Sampler.key` (derived
from the processors themselves) are processed together, and every row draws its own U.

Which tokens the penalties see (:func:`penalty_history`, used by every decoder: ``Generator`` and the
server's scheduler):

======================  =========================  ===============================================
penalty                 sees                       as in
======================  =========================  ===============================================
``repetition_penalty``  prompt + generated tokens  HF ``generate`` (its ``RepetitionPenaltyLogits-
                                                   Processor`` gets all of ``input_ids``), vLLM
``frequency_penalty``,  generated tokens only      OpenAI's formula (c[j] counts how often token j
``presence_penalty``                               was sampled before the current position), vLLM
======================  =========================  ===============================================

Default sampling parameters by entry point (the constants below; every entry point reads them here):

=========================================  ===========================  ========================================
entry point                                default                      why
=========================================  ===========================  ========================================
library: ``SamplingParams()``              ``DEFAULT_*``: temperature   the model's own distribution, nothing
                                           1, top-k 0, top-p 1, min-p   changed: what a library call means
                                           0, no penalties
``tinyformer generate`` and ``chat``,      ``HUMAN_TEMPERATURE`` 0.8,   text for a person: a little below
the trainer's samples (``samples.txt``)    ``HUMAN_TOP_K`` 50, the      temperature 1 with the long tail cut
                                           rest ``DEFAULT_*``           off, as nanoGPT and llama.cpp sample
``tinyformer serve`` (OpenAI API)          ``OPENAI_TEMPERATURE`` 1,    the API specification fixes them; its
                                           ``OPENAI_TOP_P`` 1, the      non-standard (vLLM) fields default to
                                           rest ``DEFAULT_*``           the plain distribution
``tinyformer inspect``                     ``DEFAULT_*``                it shows the model's distribution
``tinyformer eval`` (lm-eval and built-in  ``GREEDY_TEMPERATURE`` 0     scores are repeatable and comparable
tasks), SFT's held-out answers             unless a task asks to        (lm-eval's ``do_sample`` is False
                                           sample                       unless a task sets it)
=========================================  ===========================  ========================================
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from tinyformer.errors import GenerationError
from tinyformer.generation.constraint import Grammar

__all__ = ["DEFAULT_MIN_P", "DEFAULT_TEMPERATURE", "DEFAULT_TOP_K", "DEFAULT_TOP_P", "GREEDY_TEMPERATURE",
           "HUMAN_TEMPERATURE", "HUMAN_TOP_K", "OPENAI_TEMPERATURE", "OPENAI_TOP_P", "FrequencyPenalty",
           "LogitsProcessor", "MinP", "Penalty", "PenaltyHistory", "PresencePenalty", "RepetitionPenalty", "Sampler",
           "SamplingParams", "Temperature", "TopK", "TokenMask", "TopP", "build_processors", "make_generator",
           "penalty_history", "processed_logits", "sample"]

_NEG_INF = float("-inf")

# The defaults of every entry point (see the table in the module docstring).
DEFAULT_TEMPERATURE = 1.0  # the library: the model's distribution as it is
DEFAULT_TOP_K = 0
DEFAULT_TOP_P = 1.0
DEFAULT_MIN_P = 0.0
HUMAN_TEMPERATURE = 0.8  # the command line and the trainer's samples: text for a person to read
HUMAN_TOP_K = 50
OPENAI_TEMPERATURE = 1.0  # the server: the OpenAI API's own defaults
OPENAI_TOP_P = 1.0
GREEDY_TEMPERATURE = 0.0  # evaluation: deterministic, comparable scores


class LogitsProcessor(Protocol):
    """Anything with ``__call__(logits: Tensor[B, V], generated) -> Tensor[B, V]``, ``generated`` a
    :class:`PenaltyHistory`, a ``Tensor[B, t]`` or ``None``, and a hashable ``key``: processors with equal
    keys give equal outputs, so rows whose chains have equal keys are processed in one call (a processor
    without a ``key`` is its own key: it is shared only by rows that hold that very object)."""

    key: Hashable

    def __call__(self, logits: Tensor, generated: Tensor | PenaltyHistory | None) -> Tensor: ...


class _Processor:
    """Base of the processors below: ``key`` is the class and every attribute, so that an attribute added
    to a processor is part of the key that groups rows without anyone listing it."""

    @property
    def key(self) -> Hashable:
        return (type(self).__qualname__, tuple(sorted(vars(self).items())))

    def __repr__(self) -> str:  # e.g. TopK(50): the class and its one setting
        return f"{type(self).__name__}({', '.join(str(v) for v in vars(self).values())})"


# ----------------------------------------------------------------------------------------------
# value checks shared by the processors and SamplingParams.validate
# ----------------------------------------------------------------------------------------------


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _real(name: str, x: object) -> float:
    # bool is an int subclass; `temperature=True` is a mistake, not 1.0.
    if not isinstance(x, numbers.Real) or isinstance(x, bool) or not math.isfinite(float(x)):
        raise GenerationError(f"{name} must be a finite number, got {x!r}")
    return float(x)  # type: ignore[arg-type]


#: The ranges outside which the processors' arithmetic overflows float32 logits (``logits / 1e-40`` is inf,
#: ``0 * 1e308`` is NaN) and sampling fails on an all-NaN distribution: far beyond any useful setting.
MIN_TEMPERATURE = 1e-6
#: Each setting's range: (low, high, the value that disables it, whether low itself is excluded).
_RANGES = {"top_p": (0.0, 1.0, 1, True), "min_p": (0.0, 1.0, 0, False),
           "repetition_penalty": (1e-2, 1e2, 1, False),  # a factor on the logits
           # subtracted from the logits
           "frequency_penalty": (-100.0, 100.0, 0, False), "presence_penalty": (-100.0, 100.0, 0, False)}


def _check_temperature(t: object, *, allow_zero: bool) -> float:
    t = _real("temperature", t)
    if t < 0 or (t == 0 and not allow_zero):
        need = ">= 0 (0 means greedy)" if allow_zero else "> 0 (temperature 0 is greedy, done by sample)"
        raise GenerationError(f"temperature must be {need}, got {t!r}")
    if 0 < t < MIN_TEMPERATURE:
        raise GenerationError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {t!r} "
                              "(smaller ones overflow the logits)")
    return t


def _check_top_k(k: object) -> int:
    if not _is_int(k) or int(k) < 0:  # type: ignore[call-overload]
        raise GenerationError(f"top_k must be an integer >= 0 (0 disables), got {k!r}")
    return int(k)  # type: ignore[call-overload]


def _check(name: str, x: object) -> float:
    """``x`` as a float, or a GenerationError unless it is in the range of setting ``name`` (``_RANGES``)."""
    low, high, off, open_low = _RANGES[name]
    x = _real(name, x)
    if not (low < x if open_low else low <= x) or x > high:
        raise GenerationError(f"{name} must be in {'(' if open_low else '['}{low:g}, {high:g}] ({off:g} disables), "
                              f"got {x!r}")
    return x


def _prob_dtype(dtype: torch.dtype) -> torch.dtype:
    # Probabilities of a 50k-token vocabulary are too small and too many for fp16/bf16 cumulative sums;
    # work in at least float32, but keep float64 when the caller gave float64.
    return torch.promote_types(dtype, torch.float32)


def _token_counts(logits: Tensor, generated: Tensor, counted: bool = True) -> Tensor:
    """``count[b, v]``: how often token ``v`` occurs in ``generated[b]`` (``[B, t]``, or ``[t]`` for every row)
    (float, at least float32); with ``counted=False`` only whether it occurs (bool: one scatter of True, no
    float buffer, 1.5-3x faster at V = 49k, which is all the repetition and presence penalties need).

    Every id outside ``[0, V)`` (padding such as -100) is mapped to ``V``: scattering into a ``V + 1`` wide
    buffer and dropping the last column then ignores those ids without a data-dependent filter (which would
    force a host sync on GPU).
    """
    b, v = logits.shape
    ids = torch.atleast_2d(generated.to(torch.long))
    ids = ids.masked_fill((ids < 0) | (ids >= v), v).expand(b, -1)
    if not counted:
        return torch.zeros(b, v + 1, dtype=torch.bool, device=logits.device).scatter_(1, ids, True)[:, :v]
    dtype = _prob_dtype(logits.dtype)  # float32 counts are exact up to 2**24 occurrences
    counts = torch.zeros(b, v + 1, dtype=dtype, device=logits.device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=dtype, device=logits.device))
    return counts[:, :v]


# ----------------------------------------------------------------------------------------------
# the tokens the penalties see
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PenaltyHistory:
    """The ids the penalties of B rows look at: ``prompt`` ``[B, P]`` (``None`` when no penalty that
    sees the prompt is on) and ``generated`` ``[B, t]``; ids outside ``[0, V)`` (padding, e.g. -1) are
    ignored. ``repetition_ids()`` is prompt + generated (the CTRL repetition penalty, as in HF);
    ``generated`` alone is what the OpenAI frequency and presence penalties count."""

    prompt: Tensor | None
    generated: Tensor

    def repetition_ids(self) -> Tensor:
        if self.prompt is None:
            return self.generated
        return torch.cat([self.prompt.to(self.generated.device), self.generated], dim=1)

    def __getitem__(self, rows: slice | Tensor) -> PenaltyHistory:
        """The history of ``rows`` (a slice or an index tensor of the batch)."""
        return PenaltyHistory(None if self.prompt is None else self.prompt[rows], self.generated[rows])


def _rows(ids: Tensor | Sequence[int] | Sequence[Sequence[int]], device: torch.device | str | None) -> Tensor:
    """``[B, n]`` int64 ids from a ``[B, n]`` or ``[n]`` tensor, one row as a list, or B ragged rows as lists
    (right padded with -1, which every penalty ignores)."""
    if isinstance(ids, Tensor):
        return (ids if ids.dim() == 2 else ids[None]).to(device=device, dtype=torch.long)
    rows = [list(r) for r in ids] if ids and not _is_int(ids[0]) else [list(ids)]  # type: ignore[arg-type]
    n = max(map(len, rows))
    return torch.tensor([r + [-1] * (n - len(r)) for r in rows], dtype=torch.long, device=device).view(len(rows), n)


def penalty_history(params: SamplingParams | Sequence[SamplingParams], prompt: Tensor | Sequence,
                    generated: Tensor | Sequence, device: torch.device | str | None = None) -> PenaltyHistory | None:
    """What the penalties of ``params`` see, given the ``prompt`` and ``generated`` ids of each row
    (``[B, P]`` and ``[B, t]`` tensors, padding as -1; one row as lists; or, with one ``params`` per row,
    B rows as lists of lists of any lengths); ``None`` when no penalty is on, so that nothing is built. The
    one place that decides it (see the module docstring): ``repetition_penalty`` sees prompt + generated,
    ``frequency_penalty`` / ``presence_penalty`` the generated tokens only, whichever other penalties are
    on. With one ``params`` per row, a row's ids are kept only where its own penalties look (the others
    are left empty: their processors never read them)."""
    if isinstance(params, SamplingParams):
        sees_prompt, sees_generated = _sees(params)
        if not sees_generated:
            return None
        return PenaltyHistory(_rows(prompt, device) if sees_prompt else None, _rows(generated, device))
    sees = [_sees(p) for p in params]
    if not any(g for _, g in sees):
        return None
    prompts = [list(ids) if p else [] for (p, _), ids in zip(sees, prompt)]
    return PenaltyHistory(_rows(prompts, device) if any(p for p, _ in sees) else None,
                          _rows([list(ids) if g else [] for (_, g), ids in zip(sees, generated)], device))


def _sees(params: SamplingParams) -> tuple[bool, bool]:
    """Whether the penalties of ``params`` look at the prompt, and whether they look at anything at all."""
    sees_prompt = params.repetition_penalty != 1.0
    return sees_prompt, sees_prompt or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


# ----------------------------------------------------------------------------------------------
# processors
# ----------------------------------------------------------------------------------------------


class Temperature(_Processor):
    r"""Temperature scaling (Ackley, Hinton & Sejnowski 1985; as in HF ``TemperatureLogitsWarper``).

    .. math:: \ell'_v = \ell_v / T, \qquad p'_v = \operatorname{softmax}(\ell / T)_v

    ``T = 1`` leaves the logits unchanged, ``T < 1`` sharpens, ``T > 1`` flattens. ``T`` must be
    finite and ``> 0``: ``T = 0`` (greedy) is the argmax limit, which :func:`sample` takes
    directly instead of dividing by zero.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = _check_temperature(temperature, allow_zero=False)

    def __call__(self, logits: Tensor, generated: Tensor | None = None) -> Tensor:
        if self.temperature == 1.0:
            return logits
        return logits / self.temperature


class TopK(_Processor):
    r"""Top-k filtering (Fan, Lewis & Dauphin 2018).

    .. math:: \ell'_v = \ell_v \text{ if } v \in \operatorname{TopK}(\ell, k) \text{ else } -\infty

    ``k = 0`` disables the filter and ``k >= V`` keeps every token. Ties at the boundary keep
    exactly the ``k`` indices ``torch.topk`` returns, so exactly ``k`` tokens survive. (HF's
    ``TopKLogitsWarper`` instead keeps every token whose logit is ``>=`` the k-th largest, which can keep
    more than ``k`` tied tokens; without ties the two are identical.)
    """

    def __init__(self, k: int) -> None:
        self.k = _check_top_k(k)

    def __call__(self, logits: Tensor, generated: Tensor | None = None) -> Tensor:
        if self.k == 0 or self.k >= logits.size(-1):
            return logits
        values, indices = torch.topk(logits, self.k, dim=-1, sorted=False)
        # Writing the kept values into a -inf canvas needs no comparison pass over the vocabulary.
        return torch.full_like(logits, _NEG_INF).scatter_(-1, indices, values)


def _nucleus_drop(sorted_logits: Tensor, p: float) -> Tensor:
    """Drop mask for descending-sorted logits: True where the mass of the tokens before is already >= p."""
    probs = torch.softmax(sorted_logits, dim=-1, dtype=_prob_dtype(sorted_logits.dtype))
    cum = probs.cumsum(dim=-1)
    drop = torch.zeros_like(cum, dtype=torch.bool)
    # Token j is kept iff the tokens ranked before it hold < p, i.e. the prefix has not yet reached p.
    # Position 0 is always kept (the mass before it is 0 < p), which is HF's min_tokens_to_keep=1.
    drop[..., 1:] = cum[..., :-1] >= p
    return drop


class TopP(_Processor):
    r"""Nucleus (top-p) filtering (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration").

    With the tokens sorted by probability, :math:`p_{(1)} \ge p_{(2)} \ge \dots`, the nucleus is the
    smallest prefix whose cumulative probability reaches ``p``:

    .. math:: m = \min\{\, j : \textstyle\sum_{i \le j} p_{(i)} \ge p \,\}, \qquad
              \ell'_{(j)} = \ell_{(j)} \text{ if } j \le m \text{ else } -\infty

    It always keeps at least one token. ``p`` is in ``(0, 1]`` and ``p = 1`` disables the filter.
    This equals HF's ``TopPLogitsWarper`` (``min_tokens_to_keep=1``), which drops a token when the
    ascending cumulative mass up to and including it is ``<= 1 - p``. Two choices differ only in
    rounding: HF compares against ``1 - p`` in float32, we compare the descending prefix against ``p``.
    Equal probabilities are ordered by index (stable sort), so which of several tied tokens straddling
    the boundary is kept is deterministic.
    """

    def __init__(self, p: float) -> None:
        self.p = _check("top_p", p)

    def __call__(self, logits: Tensor, generated: Tensor | None = None) -> Tensor:
        if self.p >= 1.0:
            return logits
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        drop_sorted = _nucleus_drop(sorted_logits, self.p)
        drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
        return logits.masked_fill(drop, _NEG_INF)


class _TopKTopP(_Processor):
    """``TopP(p)(TopK(k)(logits))`` computed on the ``k`` candidates only.

    After top-k only ``k`` tokens have non-zero probability, so the nucleus can be found by sorting
    those ``k`` values (``torch.topk(sorted=True)``) instead of the whole vocabulary: O(V + k log k)
    per step instead of O(V log V). The result equals the two processors applied in turn.
    """

    def __init__(self, k: int, p: float) -> None:
        self.k = _check_top_k(k)
        self.p = _check("top_p", p)

    def __call__(self, logits: Tensor, generated: Tensor | None = None) -> Tensor:
        k = self.k if 0 < self.k < logits.size(-1) else logits.size(-1)
        values, indices = torch.topk(logits, k, dim=-1, sorted=True)
        values = values.masked_fill(_nucleus_drop(values, self.p), _NEG_INF)
        return torch.full_like(logits, _NEG_INF).scatter_(-1, indices, values)

    def __repr__(self) -> str:
        return f"TopK({self.k})+TopP({self.p})"


class MinP(_Processor):
    r"""Min-p filtering (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling"; HF ``MinPLogitsWarper``).

    .. math:: \ell'_v = \ell_v \text{ if } p_v \ge p_{\min} \cdot \max_u p_u \text{ else } -\infty

    Because every :math:`p_v = e^{\ell_v} / Z` shares the normaliser, the test is done in log space as
    :math:`\ell_v \ge \max_u \ell_u + \ln p_{\min}`, which needs no softmax. The most probable token always
    survives. ``p_min = 0`` disables the filter, ``p_min = 1`` keeps only the maximum (and exact ties).
    Versus HF's probability-space comparison this differs only by rounding exactly on the boundary.
    """

    def __init__(self, p: float) -> None:
        self.p = _check("min_p", p)

    def __call__(self, logits: Tensor, generated: Tensor | None = None) -> Tensor:
        if self.p <= 0.0:
            return logits
        threshold = logits.amax(dim=-1, keepdim=True) + math.log(self.p)
        return logits.masked_fill(logits < threshold, _NEG_INF)


class Penalty(_Processor):
    """Base of the penalties: :meth:`apply` to the counts of the ids the penalty sees (prompt + generated
    with ``with_prompt``, the generated ones without; all of a plain tensor), or to whether each occurs where
    the penalty is not ``counted``; the logits as they are when it sees none or its ``penalty`` is ``off``."""

    with_prompt = False
    counted = False
    off = 0.0
    penalty: float

    def __call__(self, logits: Tensor, generated: Tensor | PenaltyHistory | None) -> Tensor:
        if isinstance(generated, PenaltyHistory):
            generated = generated.repetition_ids() if self.with_prompt else generated.generated
        if self.penalty == self.off or generated is None or generated.numel() == 0:
            return logits
        return self.apply(logits, _token_counts(logits, generated, self.counted))

    def apply(self, logits: Tensor, counts: Tensor) -> Tensor:
        """The penalised ``logits`` [B, V], given ``counts[b, v]``: how often row b has seen token v (bool:
        whether it has, where not ``counted``)."""
        raise NotImplementedError


class RepetitionPenalty(Penalty):
    r"""CTRL repetition penalty (Keskar et al. 2019), with HF's sign handling.

    For every token ``v`` that occurs in ``generated`` (any number of times):

    .. math:: \ell'_v = \begin{cases} \ell_v / r & \ell_v > 0 \\ \ell_v \cdot r & \ell_v \le 0 \end{cases}

    and :math:`\ell'_v = \ell_v` otherwise, so ``r > 1`` always lowers a seen token's probability
    (dividing a negative logit would raise it, hence the multiplication). ``r = 1`` disables it.
    Ids outside ``[0, V)`` in ``generated`` (padding) are ignored.
    """

    with_prompt = True
    off = 1.0

    def __init__(self, penalty: float) -> None:
        self.penalty = _check("repetition_penalty", penalty)

    def apply(self, logits: Tensor, seen: Tensor) -> Tensor:
        penalised = torch.where(logits > 0, logits / self.penalty, logits * self.penalty)
        return torch.where(seen, penalised, logits)


class FrequencyPenalty(Penalty):
    r"""OpenAI frequency penalty: subtract ``f`` for every previous occurrence of the token.

    .. math:: \ell'_v = \ell_v - c_v \cdot f, \qquad c_v = \#\{\, i : \text{generated}_i = v \,\}

    ``f = 0`` disables it; negative ``f`` encourages repetition. Ids outside ``[0, V)`` are ignored.
    """

    counted = True

    def __init__(self, penalty: float) -> None:
        self.penalty = _check("frequency_penalty", penalty)

    def apply(self, logits: Tensor, counts: Tensor) -> Tensor:
        return (logits - counts * self.penalty).to(logits.dtype)


class PresencePenalty(Penalty):
    r"""OpenAI presence penalty: subtract ``p`` once from every token that has occurred at all.

    .. math:: \ell'_v = \ell_v - \mathbb{1}[c_v > 0] \cdot p

    ``p = 0`` disables it; negative ``p`` encourages repetition. Ids outside ``[0, V)`` are ignored.
    """

    def __init__(self, penalty: float) -> None:
        self.penalty = _check("presence_penalty", penalty)

    def apply(self, logits: Tensor, seen: Tensor) -> Tensor:
        return logits - seen.to(logits.dtype) * self.penalty


class TokenMask:
    r"""The constraint of constrained decoding: per row, only the tokens a grammar allows stay.

    .. math:: \ell'_{b,v} = \ell_{b,v} \text{ if } a_{b,v} \text{ else } -\infty

    ``allowed`` ``[B, V]`` bool is per row (each row has its own matcher, generation/constraint.py), so
    :func:`sample` applies it to all rows before grouping them by their settings: rows with the same
    sampling settings but different constraints still share their chain. A row with no allowed token
    keeps its logits (the engine never asks for one: a matcher that allows nothing has stopped).
    """

    def __init__(self, allowed: Tensor) -> None:
        self.allowed = allowed

    def __call__(self, logits: Tensor, generated: Tensor | PenaltyHistory | None = None) -> Tensor:
        allowed = self.allowed.to(logits.device)
        allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
        return logits.masked_fill(~allowed, _NEG_INF)

    def __repr__(self) -> str:
        return f"TokenMask({tuple(self.allowed.shape)})"


# ----------------------------------------------------------------------------------------------
# parameters, chain and sampler
# ----------------------------------------------------------------------------------------------


@dataclass
class SamplingParams:
    """Everything that decides how one next token is chosen, plus when to stop.

    Valid ranges (checked by :meth:`validate`, which raises :class:`GenerationError` naming the field):

    * ``temperature``: ``0`` (greedy: argmax) or in ``[1e-6, inf)``; ``1`` leaves the logits as is.
    * ``top_k``: integer ``>= 0``; ``0`` disables.
    * ``top_p``: in ``(0, 1]``; ``1`` disables. (``0`` is rejected: an empty nucleus is meaningless; use
      ``temperature=0`` or ``top_k=1`` for greedy.)
    * ``min_p``: in ``[0, 1]``; ``0`` disables.
    * ``repetition_penalty``: in ``[0.01, 100]``; ``1`` disables.
    * ``frequency_penalty``, ``presence_penalty``: in ``[-100, 100]``; ``0`` disables.
    * ``max_new_tokens``: integer ``>= 0``. ``0`` is allowed and means "generate nothing", which is
      what scoring or echoing a prompt needs; there is nothing ambiguous about it.
    * ``seed``: ``None`` (nondeterministic) or an integer in ``[0, 2**64)`` (``torch.Generator`` range).
    * ``stop_token_ids``: integers ``>= 0``; ``stop_strings``: non-empty strings (an empty stop string
      would match before the first character).
    * ``constraint``: ``None`` or a :class:`~tinyformer.generation.constraint.Grammar` the output must
      belong to (JSON schema, regex, choices, Lark grammar). It is per row, not a setting of the chain:
      each row decodes with its own matcher, and :func:`sample` applies the row's mask
      (:class:`TokenMask`) before the chain, so it is no part of :attr:`Sampler.key`.
    """

    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = DEFAULT_TOP_K
    top_p: float = DEFAULT_TOP_P
    min_p: float = DEFAULT_MIN_P
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_new_tokens: int = 128
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()
    constraint: Grammar | None = None

    def validate(self) -> SamplingParams:
        """Raise :class:`GenerationError` naming the first invalid field; return ``self`` if all are valid."""
        _check_temperature(self.temperature, allow_zero=True)
        _check_top_k(self.top_k)
        for name in _RANGES:  # top_p, min_p, then the penalties
            _check(name, getattr(self, name))
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise GenerationError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise GenerationError(f"stop_token_ids must be integers >= 0, got {self.stop_token_ids!r}")
        if isinstance(self.stop_strings, str) or not all(isinstance(s, str) and s for s in self.stop_strings):
            raise GenerationError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")
        if self.constraint is not None and not isinstance(self.constraint, Grammar):
            raise GenerationError(f"constraint must be a Grammar (generation/constraint.py), got {self.constraint!r}")
        return self

    @property
    def greedy(self) -> bool:
        """True when the choice is the argmax: ``temperature == 0`` or ``top_k == 1``."""
        return self.temperature == 0 or self.top_k == 1


def build_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """The processor chain for ``params`` in canonical order, leaving out every no-op.

    Order: repetition penalty, frequency penalty, presence penalty, temperature, top-k, top-p, min-p.
    This is the order of HF ``generate`` (``_get_logits_processor``): penalties act on the model's
    logits before any warping, so ``r``, ``f`` and ``p`` mean the same thing whatever the temperature;
    the truncations then act on the tempered distribution, so e.g. ``top_p=0.9`` is 90 % of the mass
    that is actually sampled from. (Frequency and presence penalties are not in HF; they sit with the
    other penalties, as in vLLM, and commute with each other.)

    When both top-k and top-p are active they are fused into one processor that sorts only the ``k``
    candidates. When ``params`` is greedy only the penalties are returned: temperature and the
    truncations never move the argmax (each keeps the most probable token).
    """
    params.validate()
    penalties = ((RepetitionPenalty, params.repetition_penalty), (FrequencyPenalty, params.frequency_penalty),
                 (PresencePenalty, params.presence_penalty))
    procs: list[LogitsProcessor] = [cls(value) for cls, value in penalties if value != cls.off]
    if params.greedy:
        return procs
    if params.temperature != 1.0:
        procs.append(Temperature(params.temperature))
    if params.top_k > 0 and params.top_p < 1.0:
        procs.append(_TopKTopP(params.top_k, params.top_p))
    elif params.top_k > 0:
        procs.append(TopK(params.top_k))
    elif params.top_p < 1.0:
        procs.append(TopP(params.top_p))
    if params.min_p > 0.0:
        procs.append(MinP(params.min_p))
    return procs


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A ``torch.Generator`` on ``device`` seeded with ``params.seed``, or ``None`` when the seed is ``None``.

    ``torch.rand`` needs a generator on the same device as the tensor it fills.
    """
    if params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(int(params.seed))
    return gen


class Sampler:
    """How rows with equal settings choose their next token: the processor chain of a
    :class:`SamplingParams` (:func:`build_processors`) and whether the choice is the argmax.

    ``key`` groups rows in :func:`sample`: ``greedy`` and the ``key`` of every processor (``_Processor.key``).
    ``penalised``: a penalty looks at the row's history. The sampling fields of ``params`` are all it reads;
    ``max_new_tokens``, ``seed`` and the stops are no part of it.
    """

    __slots__ = ("greedy", "key", "penalised", "processors")

    def __init__(self, processors: Sequence[LogitsProcessor] = (), *, greedy: bool = False) -> None:
        self.processors = tuple(processors)
        self.greedy = greedy
        self.penalised = any(isinstance(p, Penalty) for p in self.processors)
        self.key: Hashable = (greedy, tuple(getattr(p, "key", p) for p in self.processors))

    @classmethod
    def of(cls, params: SamplingParams) -> Sampler:
        """The sampler of ``params`` (validated)."""
        return cls(build_processors(params), greedy=params.greedy)

    def __repr__(self) -> str:
        return f"Sampler({list(self.processors)}, greedy={self.greedy})"


GREEDY = Sampler(greedy=True)  # the plain argmax: temperature 0, no penalty


def sample(logits: Tensor, how: SamplingParams | Sampler | Sequence[SamplingParams | Sampler],
           history: Tensor | PenaltyHistory | None = None,
           generator: torch.Generator | Sequence[torch.Generator | None] | None = None, *,
           want_logprobs: bool = True, allowed: Tensor | None = None,
           sampled_logprobs: bool | Sequence[bool] = False) -> tuple[Tensor, Tensor | None]:
    r"""Choose one next token per row: the one sampler of every entry point.

    Args:
        logits: ``[B, V]`` raw next-token logits from the model (any float dtype, any device).
        how: how every row chooses (a :class:`SamplingParams`, validated here, or a prebuilt
            :class:`Sampler`), or one of them per row. Rows whose samplers have equal ``key`` are
            processed in one call.
        history: what the penalties see: a :class:`PenaltyHistory` of the B rows (from
            :func:`penalty_history`, which decides which ids each penalty sees), or ``[B, t]`` (or ``[t]``,
            shared by all rows) ids that every penalty sees alike.
        generator: where the uniform numbers come from: ``None`` (the global RNG), one ``torch.Generator``
            for all rows (on the logits' device, see :func:`make_generator`), or one per row (``None`` for
            the global RNG), so that a seeded row draws the same numbers whichever rows share its call.
        want_logprobs: False skips the log-normaliser (one more pass over the vocabulary) and returns None.
        allowed: ``[B, V]`` bool, the tokens each row's constraint allows (:class:`TokenMask`, applied to
            every row before the chains), or None.
        sampled_logprobs: True (or one bool per row) returns the log-probability under the distribution the
            token was drawn from (the processed logits) instead of the raw one; see below.

    Returns:
        ``(token_ids[B] int64, logprobs[B] float32 or None)``.

    With :math:`\tilde\ell` the processed logits of a row, the token is :math:`\arg\max_v \tilde\ell_v`
    when its sampler is greedy (``temperature == 0`` or ``top_k == 1``); otherwise it is drawn from
    :math:`q = \operatorname{softmax}(\tilde\ell)` by inverse transform sampling: with
    :math:`e_v = \exp(\tilde\ell_v - \max \tilde\ell)` and :math:`c_v = \sum_{u \le v} e_u`, the token is
    the first v with :math:`c_v > U c_V` for one :math:`U \sim \mathrm{Uniform}[0, 1)` per row, so
    :math:`P(v) = e_v / c_V = q_v` (a filtered token has :math:`e_v = 0` and cannot be hit). The
    softmax's division is never done, and one uniform per row is drawn where ``torch.multinomial``
    draws one exponential per vocabulary entry (for 16 rows x 32k tokens on a CPU that cost about as
    much as the forward pass of a 15M model). The running sum is float32 (float64 logits stay float64):
    a token's share is then off by ~1e-7 of the total at most, and a token with :math:`e_v = 0` adds
    exactly 0.

    ``logprobs`` is :math:`\log \operatorname{softmax}(\ell)_y = \ell_y - \operatorname{logsumexp}(\ell)`
    of the **raw** model logits at the chosen token ``y``, before any processor: it is what the model
    believes, comparable across sampling settings (as OpenAI's API returns) and finite even for tokens
    a filter would have given probability 1. HF's ``output_scores`` would instead return the processed
    scores. Work is done in float32 (float64 stays float64), so that e.g. ``logits / 1e-6`` cannot
    overflow fp16. With ``sampled_logprobs`` a row's log-probability is instead
    :math:`\log \operatorname{softmax}(\tilde\ell)_y`, that of the distribution it was drawn from (with a
    temperature T alone, :math:`\log \operatorname{softmax}(\ell / T)_y`): what a policy-gradient
    objective's importance ratio divides by (training/objectives/grpo.py).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    raw = logits if logits.dtype == torch.float64 else logits.float()
    masked = raw if allowed is None else TokenMask(allowed)(raw)
    if isinstance(how, (SamplingParams, Sampler)):  # one for every row: no per-row keys to group by
        return _finish(raw, *_choose(_sampler(how), masked, history, generator), want_logprobs, sampled_logprobs)
    samplers = [_sampler(h) for h in how]
    if len(samplers) != raw.shape[0]:
        raise ValueError(f"one sampler per row: got {len(samplers)} for {raw.shape[0]} rows")
    groups = _groups(samplers)
    if len(groups) == 1:
        tokens, processed = _choose(samplers[0], masked, history, generator)
    else:
        tokens = torch.empty(raw.shape[0], dtype=torch.long, device=raw.device)
        processed = torch.empty_like(raw)
        for idx in groups:
            rows = torch.tensor(idx, device=raw.device)
            tokens[rows], processed[rows] = _choose(
                samplers[idx[0]], masked[rows], _history_rows(history, rows),
                [generator[i] for i in idx] if isinstance(generator, Sequence) else generator)
    return _finish(raw, tokens, processed, want_logprobs, sampled_logprobs)


def _finish(raw: Tensor, tokens: Tensor, processed: Tensor, want_logprobs: bool,
            sampled_logprobs: bool | Sequence[bool]) -> tuple[Tensor, Tensor | None]:
    """:func:`sample`'s result: the tokens and, if wanted, their log-probabilities (raw or as drawn)."""
    if not want_logprobs:
        return tokens, None
    logprobs = _token_logprobs(raw, tokens)
    if sampled_logprobs is True or (not isinstance(sampled_logprobs, bool) and any(sampled_logprobs)):
        drawn = _token_logprobs(processed, tokens)
        if isinstance(sampled_logprobs, bool):
            return tokens, drawn
        logprobs = torch.where(torch.tensor(list(sampled_logprobs), device=raw.device), drawn, logprobs)
    return tokens, logprobs


def _token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(logits)[b, tokens[b]] for each row b, as float32: ``log_probs(logits)[b, tokens[b]]``."""
    return (logits.gather(-1, tokens[:, None]).squeeze(-1) - row_logsumexp(logits)).float()


def row_logsumexp(logits: Tensor) -> Tensor:
    """logsumexp over the last dim, each row reduced alone: torch splits one row's sum over its threads but
    sums a block of rows row by row, so a row's value in a block could differ from its value alone in the
    last bit (4% of 49k-token rows on 2 threads); a token's log-probability must not depend on the rows
    beside it (a speculative verification's block, a batch). (..., V) -> (...)."""
    rows = logits.reshape(-1, logits.shape[-1])
    if rows.shape[0] <= 1:
        return torch.logsumexp(logits, dim=-1)
    return torch.cat([torch.logsumexp(r, dim=-1) for r in rows.split(1)]).reshape(logits.shape[:-1])


def log_probs(logits: Tensor) -> Tensor:
    """log softmax(logits) = logits - logsumexp(logits) over the last dim, as float32: the one formula of every
    reported log-probability (``torch.log_softmax`` rounds differently, by up to 1e-5 over 49k tokens), so a
    token's log-probability is the same number whichever path chose it."""
    return (logits - row_logsumexp(logits).unsqueeze(-1)).float()


def _sampler(how: SamplingParams | Sampler) -> Sampler:
    return how if isinstance(how, Sampler) else Sampler.of(how)


def _groups(samplers: Sequence[Sampler]) -> list[list[int]]:
    """The rows of each sampler key, in the order the keys first appear."""
    groups: dict[Hashable, list[int]] = {}
    for i, s in enumerate(samplers):
        groups.setdefault(s.key, []).append(i)
    return list(groups.values())


def _history_rows(history: Tensor | PenaltyHistory | None, rows: Tensor) -> Tensor | PenaltyHistory | None:
    """The history of ``rows`` (a ``[t]`` tensor is every row's)."""
    if history is None or (isinstance(history, Tensor) and history.dim() == 1):
        return history
    return history[rows]


def processed_logits(logits: Tensor, how: Sequence[SamplingParams | Sampler],
                     history: Tensor | PenaltyHistory | None = None) -> Tensor:
    r"""The processed logits :math:`\tilde\ell` ``[B, V]`` (float32, float64 stays float64) that :func:`sample`
    draws from, row b through its own sampler ``how[b]``: the target distribution is
    :math:`\operatorname{softmax}(\tilde\ell)` (speculative decoding's p). For a greedy sampler that is
    the penalised logits only (its choice is their argmax). Rows with equal keys are processed together."""
    raw = logits if logits.dtype == torch.float64 else logits.float()
    samplers = [_sampler(h) for h in how]
    groups = _groups(samplers)
    if len(groups) == 1:
        return _process(samplers[0], raw, history)
    out = torch.empty_like(raw)
    for idx in groups:
        rows = torch.tensor(idx, device=raw.device)
        out[rows] = _process(samplers[idx[0]], raw[rows], _history_rows(history, rows))
    return out


def _process(sampler: Sampler, raw: Tensor, history: Tensor | PenaltyHistory | None) -> Tensor:
    x = raw
    for proc in sampler.processors:
        x = proc(x, history)
    return x


def _choose(sampler: Sampler, raw: Tensor, history: Tensor | PenaltyHistory | None,
            generator: torch.Generator | Sequence[torch.Generator | None] | None) -> tuple[Tensor, Tensor]:
    """``sample``'s choice for rows that share ``sampler``: (token ids ``[B]``, the processed logits ``[B, V]``
    they were drawn from)."""
    x = _process(sampler, raw, history)
    if sampler.greedy:
        return x.argmax(dim=-1), x
    cdf = (x - x.amax(dim=-1, keepdim=True)).exp_().cumsum_(-1)  # one new tensor, then in place
    total = cdf[:, -1:].contiguous()  # [B, 1]: the softmax normaliser of each row
    u = _uniforms(generator, cdf.shape[0], cdf) * total
    # U * c_V may round up to c_V itself; the first position holding the whole mass is then the last token
    # that has any (the positions after it carry e_v = 0)
    last = torch.searchsorted(cdf, total)
    return torch.minimum(torch.searchsorted(cdf, u, right=True), last).squeeze(-1), x


def _uniforms(generator: torch.Generator | Sequence[torch.Generator | None] | None, n: int, like: Tensor) -> Tensor:
    """``[n, 1]`` uniforms in [0, 1): from the global RNG, from one generator, or one from each row's own."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(n, 1, generator=generator, dtype=like.dtype, device=like.device)
    return torch.cat([torch.rand(1, 1, generator=g, dtype=like.dtype, device=like.device) for g in generator])
