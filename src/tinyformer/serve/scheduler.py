"""Continuous batching: many requests share one KV cache and one forward pass per token.

The cache has ``max_batch`` rows ("slots"). A request waits in a bounded queue until a slot is free,
is prefilled alone into that slot (``cache.row_view(slot)``: prompt positions 0 .. P-1), and from then
on every step decodes one token for *all* running requests together::

    logits = model(tokens[:, None], cache=cache, cache_positions=positions)     # (B, 1, V)

Row b feeds its last token at its own position ``positions[b]`` and attends to its own cache row up
to that position, so requests of different lengths that started at different times share the step.
A finished, cancelled or timed-out request frees its slot at once and the next waiting request takes
it before the following step. Greedy output is the same as decoding the request alone: each row only
ever sees its own keys and values.

All torch work runs in one background thread. Other threads (the HTTP event loop) only ``submit``
and ``cancel``; results go back through each request's ``sink`` callable, which the caller makes
thread-safe (the server wraps ``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from tinyformer.components.kv_cache import KVCache
from tinyformer.errors import non_finite_message
from tinyformer.generation.sampling import (
    LogitsProcessor,
    PenaltyHistory,
    SamplingParams,
    build_processors,
    make_generator,
    penalty_history,
    sample_next,
)
from tinyformer.generation.streaming import StopStringMatcher, Utf8StreamDecoder

log = logging.getLogger("tinyformer.serve")

__all__ = ["GenerationRequest", "QueueFull", "Scheduler", "StepEvent", "TokenInfo", "sample_shared"]

_ids = itertools.count(1)


def sample_shared(logits: torch.Tensor, processors: Sequence[LogitsProcessor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_next`` for rows that share non-greedy parameters, no history and no seed: the same
    distribution, drawn by inverse transform sampling instead of ``torch.multinomial``.

    With q = softmax(processed logits) and its running sum c_v = sum_{u <= v} q_u, the token is the
    first v with c_v > U * c_V for one U ~ Uniform[0, 1) per row, so P(v) = q_v (tokens filtered to
    q_v = 0 cannot be hit). ``torch.multinomial`` draws one exponential per vocabulary entry instead
    (an exponential race), which for 16 rows x 32k tokens on a CPU costs about as much as the forward
    pass of a 15M model. Returns ``(token_ids (A,), logprobs (A,))`` with the logprob of the raw logits,
    exactly as ``sample_next`` does.
    """
    raw = logits if logits.dtype == torch.float64 else logits.float()
    x = raw
    for proc in processors:
        x = proc(x, None)
    # float32 is enough: each token's share c_v - c_{v-1} is off by ~1e-7 of the total at most, and a token
    # with q_v = 0 adds exactly 0, so it still cannot be drawn. (softmax/cumsum with dtype=float64 run an
    # unvectorised conversion path on CPU, ~30x slower than the whole float32 draw.)
    cdf = torch.softmax(x, dim=-1).cumsum(-1)
    u = torch.rand(cdf.size(0), 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True).clamp_max_(cdf.size(-1) - 1).squeeze(-1)
    logprobs = (raw.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(raw, dim=-1)).float()
    return tokens, logprobs


class QueueFull(Exception):
    """No free slot and the waiting queue is at ``max_queue``: the server answers 429."""


@dataclass
class TokenInfo:
    """One generated token: its id, log p under the model's raw distribution, and the ``top`` most
    probable alternatives as (id, log p), best first (empty unless the request asked for them)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class StepEvent:
    """What one step produced for one request: new text (possibly empty, e.g. held back as the start of
    a stop string or half a UTF-8 character), the tokens behind it, and, on the last event, why it ended.

    ``finish_reason`` is "stop" (end-of-sequence token or stop string), "length" (max_tokens or the end
    of the context), "timeout" or "error" (then ``error`` says why).
    """

    index: int
    text: str
    tokens: list[TokenInfo]
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class GenerationRequest:
    """One sequence to generate (one choice of an API request).

    ``params.max_new_tokens`` and ``params.stop_strings`` / ``stop_token_ids`` decide when it ends;
    ``top_logprobs`` > 0 asks for that many alternatives per token; ``deadline`` is a
    ``time.monotonic()`` value after which it ends with finish_reason "timeout".
    ``hidden_token_ids`` are generated but never shown as text (special tokens such as BOS).
    """

    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[StepEvent], None]
    index: int = 0
    top_logprobs: int = 0
    deadline: float | None = None
    hidden_token_ids: frozenset[int] = frozenset()
    id: int = field(default_factory=lambda: next(_ids))


class _Running:
    """Decoding state of one request that holds a slot."""

    def __init__(self, req: GenerationRequest, slot: int, token_bytes: Callable[[int], bytes],
                 device: torch.device) -> None:
        self.req = req
        self.device = device
        self.slot = slot
        self.pos = len(req.prompt_ids)  # where the next fed token goes in the cache
        self.last_token = -1
        self.generated: list[int] = []
        self.processors: list[LogitsProcessor] = build_processors(req.params)
        self.generator = make_generator(req.params, device)  # multinomial needs it on the logits' device
        self.stop_ids = frozenset(int(t) for t in req.params.stop_token_ids)
        self.decoder = Utf8StreamDecoder()
        self.stopper = StopStringMatcher(req.params.stop_strings)
        self.token_bytes = token_bytes
        # Rows with the same key are sampled in one call: no penalty looks at history and no seeded
        # generator must advance on its own. Everything else is sampled row by row.
        p = req.params
        shareable = (p.seed is None or p.greedy) and not self.processors_need_history()
        self.group_key: object = (p.temperature, p.top_k, p.top_p, p.min_p) if shareable else ("own", req.id)

    def processors_need_history(self) -> bool:
        p = self.req.params
        return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0

    def history(self) -> PenaltyHistory | None:
        """What the penalties see (``penalty_history`` decides, as for ``Generator``)."""
        return penalty_history(self.req.params, self.req.prompt_ids, self.generated, self.device)

    def accept(self, info: TokenInfo) -> StepEvent:
        """Record one sampled token and turn it into an event (with finish_reason when it ends here)."""
        tok = info.token_id
        self.generated.append(tok)
        self.last_token = tok
        text, finish = "", None
        if tok in self.stop_ids:
            finish = "stop"
        else:
            piece = b"" if tok in self.req.hidden_token_ids else self.token_bytes(tok)
            text, stopped = self.stopper.push(self.decoder.push(piece))
            if stopped:
                finish = "stop"
        if finish is None and len(self.generated) >= self.req.params.max_new_tokens:
            finish = "length"
        if finish is not None:
            tail, stopped = self.flush_text()
            text += tail
            finish = "stop" if stopped else finish
        return self.event(text, [info], finish)

    def flush_text(self) -> tuple[str, bool]:
        """End of output: the text held back (half a character, a possible stop-string start) and
        whether it completed a stop string after all."""
        if self.stopper.stopped:
            return "", True
        tail, stopped = self.stopper.push(self.decoder.flush())
        return (tail, True) if stopped else (tail + self.stopper.flush(), False)

    def event(self, text: str, tokens: list[TokenInfo], finish: str | None, error: str | None = None) -> StepEvent:
        return StepEvent(self.req.index, text, tokens, finish, error, len(self.req.prompt_ids), len(self.generated))


class Scheduler:
    """Continuous-batching generation over one model, in one background thread.

    ``model`` is a decoder LM with ``new_cache(batch, max_len)`` and ``forward(ids, cache=...,
    cache_positions=..., last_only=...)``; ``token_bytes(id)`` gives a token's raw bytes (for streaming
    text that never splits a UTF-8 character). ``max_len`` caps each slot's positions (default: the
    model's ``max_seq_len``).
    """

    def __init__(
        self,
        model: nn.Module,
        token_bytes: Callable[[int], bytes],
        *,
        max_batch: int = 16,
        max_queue: int = 64,
        max_len: int | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.model = model
        self.token_bytes = token_bytes
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.cache: KVCache = model.new_cache(max_batch, max_len)
        self.max_len = self.cache.max_len
        self._device = self.cache.layers[0][0].device
        self._cond = threading.Condition()
        self._waiting: deque[GenerationRequest] = deque()
        self._cancelled: set[int] = set()
        self._running: dict[int, _Running] = {}  # request id -> state; touched by the worker thread only
        self._free_slots = list(range(max_batch))  # kept sorted: admitting lowest first keeps rows compact
        self._stop = False
        self._thread: threading.Thread | None = None
        # counters for /health and the tests
        self.steps = 0
        self.peak_active = 0
        self.finished = 0
        self.cancelled = 0
        self.moves = 0

    # ------------------------------------------------------------------ called from any thread
    def start(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="tinyformer-scheduler", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def active_count(self) -> int:
        """Requests holding a slot."""
        return len(self._running)

    @property
    def waiting_count(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiting)

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "active": len(self._running),
                "waiting": len(self._waiting),
                "max_batch": self.max_batch,
                "max_queue": self.max_queue,
                "steps": self.steps,
                "peak_active": self.peak_active,
                "finished": self.finished,
                "cancelled": self.cancelled,
                "moves": self.moves,
            }

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        """Queue all of ``requests`` (the choices of one API call) or none: raises :class:`QueueFull`
        when the free slots plus ``max_queue`` cannot take them."""
        with self._cond:
            if self._stop:
                raise QueueFull("the server is shutting down")
            free = self.max_batch - len(self._running)
            if len(self._waiting) + len(requests) > free + self.max_queue:
                raise QueueFull(
                    f"the server is busy: {len(self._running)} requests running and {len(self._waiting)} "
                    f"waiting (max queue {self.max_queue}); retry shortly"
                )
            self._waiting.extend(requests)
            self._cond.notify_all()

    def cancel(self, request_ids: Sequence[int]) -> None:
        """Stop these requests (the client went away); their slots are free before the next step."""
        with self._cond:
            self._cancelled.update(request_ids)
            self._cond.notify_all()

    # ------------------------------------------------------------------ worker thread
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (self._stop or self._waiting or self._running or self._cancelled):
                        self._cond.wait()
                    if self._stop:
                        break
                    cancelled, self._cancelled = self._cancelled, set()
                try:
                    self._drop(cancelled)
                    self._expire()
                    self._admit()
                    self._compact()
                    if self._running:
                        self._step()
                except Exception as exc:  # a bug must not take the server down: fail the batch, go on
                    log.exception("decode step failed")
                    for state in list(self._running.values()):
                        self._finish(state, state.event("", [], "error", f"internal error: {exc}"))
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for state in list(self._running.values()):
            self._finish(state, state.event("", [], "error", "the server is shutting down"))
        for req in waiting:
            self._emit(req, StepEvent(req.index, "", [], "error", "the server is shutting down",
                                      len(req.prompt_ids), 0))

    def _emit(self, req: GenerationRequest, event: StepEvent) -> bool:
        try:
            req.sink(event)
            return True
        except Exception:  # the receiver is gone (event loop closed): treat as a disconnect
            log.warning("request %d: could not deliver a result; dropping it", req.id)
            return False

    def _release(self, state: _Running) -> None:
        del self._running[state.req.id]
        self._free_slots.append(state.slot)
        self._free_slots.sort()

    def _finish(self, state: _Running, event: StepEvent) -> None:
        self._release(state)
        self.finished += 1
        self._emit(state.req, event)

    def _drop(self, ids: set[int]) -> None:
        if not ids:
            return
        for rid in ids:
            state = self._running.get(rid)
            if state is not None:
                self._release(state)
                self.cancelled += 1
        with self._cond:
            kept = [r for r in self._waiting if r.id not in ids]
            self.cancelled += len(self._waiting) - len(kept)
            self._waiting = deque(kept)

    def _expire(self) -> None:
        now = time.monotonic()
        for state in list(self._running.values()):
            if state.req.deadline is not None and now > state.req.deadline:
                self._finish(state, state.event("", [], "timeout", "the request timed out"))
        with self._cond:
            late = [r for r in self._waiting if r.deadline is not None and now > r.deadline]
            if late:
                late_ids = {r.id for r in late}
                self._waiting = deque(r for r in self._waiting if r.id not in late_ids)
        for req in late:
            self.finished += 1
            self._emit(req, StepEvent(req.index, "", [], "timeout", "the request timed out while queued",
                                      len(req.prompt_ids), 0))

    def _admit(self) -> None:
        """Prefill waiting requests into free slots, one forward pass each, and sample their first token."""
        while self._free_slots:
            with self._cond:
                if not self._waiting:
                    return
                req = self._waiting.popleft()
            slot = self._free_slots.pop(0)
            state = _Running(req, slot, self.token_bytes, self._device)
            self._running[req.id] = state
            try:
                ids = torch.tensor(req.prompt_ids, dtype=torch.long, device=self._device)[None]
                logits = self.model(ids, cache=self.cache.row_view(slot), last_only=True)[:, -1]  # (1, V)
                event = self._sample(logits, [state])[0]
            except Exception as exc:
                log.exception("prefill of request %d failed", req.id)
                self._finish(state, state.event("", [], "error", f"prefill failed: {exc}"))
                continue
            self._deliver(state, event)

    def _compact(self) -> None:
        """Move requests from the highest used slots into free lower ones, so that a step decodes rows
        0 .. n_running - 1 and no free row in between. Moving copies the row's cache positions
        0 .. pos - 1 (a few MB at most); it happens once per request that finishes below another."""
        while self._running and self._free_slots:
            state = max(self._running.values(), key=lambda s: s.slot)
            dst = self._free_slots[0]
            if dst > state.slot:
                return
            self._free_slots.pop(0)
            for k, v in self.cache.layers:
                k[dst, :, : state.pos].copy_(k[state.slot, :, : state.pos])
                v[dst, :, : state.pos].copy_(v[state.slot, :, : state.pos])
            self._free_slots.append(state.slot)
            self._free_slots.sort()
            state.slot = dst
            self.moves += 1

    def _step(self) -> None:
        """One token for every running request: one forward pass over rows 0 .. highest used slot
        (after :meth:`_compact`, exactly the running requests)."""
        states = sorted(self._running.values(), key=lambda s: s.slot)
        rows = states[-1].slot + 1
        # Free rows inside the range decode a dummy token at position 0 of their own (unused) row.
        tokens = torch.zeros(rows, dtype=torch.long)
        positions = torch.zeros(rows, dtype=torch.long)
        slots = [s.slot for s in states]
        tokens[slots] = torch.tensor([s.last_token for s in states])
        positions[slots] = torch.tensor([s.pos for s in states])
        cache = self.cache if rows == self.cache.batch_size else self.cache.row_view(0, rows)
        logits = self.model(tokens[:, None].to(self._device), cache=cache,
                            cache_positions=positions.to(self._device))[:, 0]  # (rows, V)
        if len(slots) != rows:
            logits = logits[torch.tensor(slots, device=logits.device)]
        self.steps += 1
        self.peak_active = max(self.peak_active, len(states))
        for state in states:
            state.pos += 1
        for state, event in zip(states, self._sample(logits, states)):
            self._deliver(state, event)

    def _deliver(self, state: _Running, event: StepEvent) -> None:
        if event.finish_reason is None and state.pos >= self.max_len:
            # the slot is full: no position is left to feed the token just sampled
            tail, stopped = state.flush_text()
            event.text += tail
            event.finish_reason = "stop" if stopped else "length"
        if event.finish_reason is not None:
            self._finish(state, event)
        elif not self._emit(state.req, event):
            self._release(state)
            self.cancelled += 1

    def _sample(self, logits: torch.Tensor, states: list[_Running]) -> list[StepEvent]:
        """Sample one token per row of ``logits`` (A, V) with each request's own parameters.

        Rows that share sampling parameters and need neither a history nor their own seeded generator
        are sampled in one call (:func:`sample_shared`); the others one by one with ``sample_next``, so a
        seeded request draws the same random numbers whether or not it shares the batch.
        """
        n = len(states)
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        if not all(finite):  # those requests end with an error; the others are sampled as usual
            good = [i for i in range(n) if finite[i]]
            events = dict(zip(good, self._sample(logits[torch.tensor(good, dtype=torch.long, device=logits.device)],
                                                 [states[i] for i in good]) if good else []))
            message = non_finite_message("for this request")
            return [events[i] if i in events else states[i].event("", [], "model_error", message) for i in range(n)]
        tokens = [0] * n
        logps = [0.0] * n
        groups: dict[object, list[int]] = {}
        for i, s in enumerate(states):
            groups.setdefault(s.group_key, []).append(i)
        for key, idx in groups.items():
            first = states[idx[0]]
            rows = logits[idx[0] : idx[0] + 1] if len(idx) == 1 else logits[torch.tensor(idx, device=logits.device)]
            if first.req.params.greedy or key == ("own", first.req.id):
                tok, lp = sample_next(rows, first.req.params, first.history(), first.generator,
                                      processors=first.processors)
            else:
                tok, lp = sample_shared(rows, first.processors)
            for i, t, p in zip(idx, tok.tolist(), lp.tolist()):
                tokens[i], logps[i] = t, p
        tops: dict[int, list[tuple[int, float]]] = {}
        want = [i for i, s in enumerate(states) if s.req.top_logprobs > 0]
        if want:
            k = max(states[i].req.top_logprobs for i in want)
            lsm = torch.log_softmax(logits[torch.tensor(want, device=logits.device)].float(), dim=-1)
            values, ids = lsm.topk(min(k, lsm.size(-1)), dim=-1)
            for row, i in enumerate(want):
                kk = states[i].req.top_logprobs
                tops[i] = list(zip(ids[row, :kk].tolist(), values[row, :kk].tolist()))
        return [s.accept(TokenInfo(tokens[i], logps[i], tops.get(i, []))) for i, s in enumerate(states)]
