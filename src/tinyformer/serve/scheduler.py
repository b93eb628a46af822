"""Continuous batching: many requests share one KV cache and one forward pass per token.

The scheduler is a thin loop around a :class:`~tinyformer.generation.engine.BatchEngine` with
``max_batch`` rows ("slots"): admission, fairness, cancellation, timeouts. A request waits in a bounded
queue (first come, first served) until a slot is free; admitted requests are prefilled together (one
forward call for the new prompts, long prompts in chunks of ``prefill_chunk`` tokens interleaved with
the decode steps of the running requests), and from then on every step decodes one token for *all*
running requests together, each row at its own cache position. A finished, cancelled or timed-out
request frees its slot at once and the next waiting request takes it before the following step.
Greedy output is the same as decoding the request alone: each row only ever sees its own keys and
values.

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

from tinyformer.generation.compile_cache import PackageBuild, compiled_step
from tinyformer.generation.constraint import Matcher
from tinyformer.generation.engine import (
    BatchEngine,
    EngineRow,
    RowOutput,
    TokenInfo,
    check_compilable,
    new_prefix_cache,
)
from tinyformer.generation.sampling import SamplingParams
from tinyformer.generation.speculative import SpeculativeConfig
from tinyformer.generation.streaming import TextState

log = logging.getLogger("tinyformer.serve")

__all__ = ["GenerationRequest", "QueueFull", "Scheduler", "StepEvent", "TokenInfo"]

_ids = itertools.count(1)
SHUTTING_DOWN = "the server is shutting down; retry later"


class QueueFull(Exception):
    """No free slot and the waiting queue is at ``max_queue``: the server answers 429."""


@dataclass
class StepEvent:
    """What one step produced for one request: new text (possibly empty, e.g. held back as the start of
    a stop string or half a UTF-8 character), the tokens behind it, and, on the last event, why it ended.

    ``finish_reason`` is "stop" (end-of-sequence token or stop string), "length" (max_tokens or the end
    of the context), "timeout", "shutdown" (the server is stopping: :meth:`Scheduler.drain`) or "error" (then
    ``error`` says why).
    """

    index: int
    text: str
    tokens: list[TokenInfo]
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    complete: bool | None = None  # on the last event of a constrained request: whether its grammar accepted


@dataclass
class GenerationRequest:
    """One sequence to generate (one choice of an API request).

    ``params.max_new_tokens`` and ``params.stop_strings`` / ``stop_token_ids`` decide when it ends;
    ``logprobs`` False skips each token's log-probability (the API request did not ask for it: computing it
    is one more pass over the vocabulary per token); ``top_logprobs`` > 0 asks for that many alternatives
    per token; ``deadline`` is a
    ``time.monotonic()`` value after which it ends with finish_reason "timeout".
    """

    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[StepEvent], None]
    index: int = 0
    top_logprobs: int = 0
    deadline: float | None = None
    logprobs: bool = True
    speculative: SpeculativeConfig | None = None
    constraint: Matcher | None = None  # its own place in the language of params.constraint
    id: int = field(default_factory=lambda: next(_ids))


def _event(row: EngineRow, text: str, tokens: list[TokenInfo], finish: str | None,
           error: str | None = None) -> StepEvent:
    req: GenerationRequest = row.tag
    complete = row.constraint.accepting if finish is not None and row.constraint is not None else None
    return StepEvent(req.index, text, tokens, finish, error, len(req.prompt_ids), len(row.token_ids), complete)


class Scheduler:
    """Continuous-batching generation over one model, in one background thread.

    ``model`` is a decoder LM; ``token_bytes(id)`` gives a token's bytes as shown in text (for streaming
    text that never splits a UTF-8 character; special tokens as none: ``streaming.TokenBytes``).
    ``max_len`` caps each slot's positions (default: the model's ``max_seq_len``). ``compile`` decodes with
    the compiled step (see ``BatchEngine``): one graph per bucket of rows (1, 2, 4, ... ``max_batch``), all
    compiled by :meth:`start` before the scheduler takes its first request, so that no stream ever stalls
    for a compilation; ``prefill_chunk`` is the most prompt tokens a request feeds per step (None: its
    whole prompt at once).
    ``prefix_cache_mb`` > 0 keeps the K/V blocks of finished requests (prompt and completion) in a prefix
    cache of that size, so a request that shares a prefix with an earlier one (a system prompt, a chat
    history) prefills only the rest.
    ``max_draft_tokens`` K > 0 lets requests speculate with up to K drafts per step (``GenerationRequest.
    speculative``); ``draft_model`` is the draft model of those whose method is "draft".
    """

    def __init__(self, model: nn.Module, token_bytes: Callable[[int], bytes], *, max_batch: int = 16,
                 max_queue: int = 64, max_len: int | None = None, compile: bool | PackageBuild = False,
                 prefill_chunk: int | None = 256, prefix_cache_mb: float = 0, max_draft_tokens: int = 0,
                 draft_model: nn.Module | None = None) -> None:
        if max_batch < 1:  # the API's own checks, before a compiled step is prepared (the CLI checks its flags)
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if compile:
            check_compilable(model)
        self.model = model
        self.token_bytes = token_bytes
        self.max_batch = max_batch
        self.max_queue = max_queue
        compiled = compiled_step(model, compile) if compile else None
        self.engine = BatchEngine(model, max_batch=max_batch, max_len=max_len, compiled=compiled,
                                  prefill_chunk=prefill_chunk,
                                  prefix_cache=new_prefix_cache(model, prefix_cache_mb), buckets=True,
                                  max_draft_tokens=max_draft_tokens, draft_model=draft_model)
        self.max_len = self.engine.max_len
        self._cond = threading.Condition()
        self._waiting: deque[GenerationRequest] = deque()
        self._cancelled: set[int] = set()
        self._running: dict[int, EngineRow] = {}  # request id -> its row; touched by the worker thread only
        self._stop = False
        self._drain_until: float | None = None  # set by drain(): the running requests' last moment
        self._thread: threading.Thread | None = None
        # counters for /health and the tests
        self.steps = 0
        self.peak_active = 0
        self.finished = 0
        self.cancelled = 0

    # ------------------------------------------------------------------ called from any thread
    def start(self) -> None:
        """Start the worker thread; with ``compile``, first compile every bucket's decode step (seconds to
        minutes on a CPU; inductor's cache makes later starts quick)."""
        if self._thread is None:
            with torch.inference_mode():
                self.engine.warm_up()
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

    def drain(self, grace: float) -> None:
        """Begin a graceful shutdown: refuse new requests, end the queued ones now and the running ones
        after ``grace`` seconds (if they have not finished by then), each with a final "shutting down" error
        event, so that every stream ends with a proper last event instead of a cut connection."""
        with self._cond:
            self._drain_until = time.monotonic() + max(grace, 0.0)
            self._cond.notify_all()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"active": len(self._running), "waiting": len(self._waiting), "max_batch": self.max_batch,
                    "max_queue": self.max_queue, "steps": self.steps, "peak_active": self.peak_active,
                    "finished": self.finished, "cancelled": self.cancelled, "moves": self.engine.moves,
                    "draft_proposed": self.engine.draft_proposed, "draft_accepted": self.engine.draft_accepted,
                    **({"prefix_hits": pc.stats.hits, "prefix_tokens_reused": pc.stats.tokens_reused}
                       if (pc := self.engine.prefix_cache) is not None else {})}

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        """Queue all of ``requests`` (the choices of one API call) or none: raises :class:`QueueFull`
        when the free slots plus ``max_queue`` cannot take them."""
        with self._cond:
            if self._stop or self._drain_until is not None:
                raise QueueFull("the server is shutting down")
            free = self.max_batch - len(self._running)
            if len(self._waiting) + len(requests) > free + self.max_queue:
                raise QueueFull(f"the server is busy: {len(self._running)} requests running and {len(self._waiting)} "
                                f"waiting (max queue {self.max_queue}); retry shortly")
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
                    if self._drain_until is not None:
                        self._shut_down(running=time.monotonic() >= self._drain_until)
                    self.engine.compact()
                    self._admit()
                    if self._running:
                        self._step()
                except Exception as exc:  # a bug must not take the server down: fail the batch, go on
                    log.exception("decode step failed")
                    for row in list(self._running.values()):
                        self._finish(row, _event(row, "", [], "error", f"internal error: {exc}"))
        self._shut_down(running=True)

    def _shut_down(self, running: bool) -> None:
        """End the queued requests (and, with ``running``, those holding a slot) with a final error event."""
        waiting = self._take_waiting(lambda req: True)
        for row in list(self._running.values()) if running else []:
            self._finish(row, _event(row, "", [], "shutdown", SHUTTING_DOWN))
        for req in waiting:
            self._end_queued(req, "shutdown", SHUTTING_DOWN)

    def _take_waiting(self, which: Callable[[GenerationRequest], bool]) -> list[GenerationRequest]:
        """Remove the queued requests ``which`` selects, and return them."""
        with self._cond:
            taken = [r for r in self._waiting if which(r)]
            if taken:
                self._waiting = deque(r for r in self._waiting if not which(r))
        return taken

    def _end_queued(self, req: GenerationRequest, reason: str, error: str) -> None:
        """The final event of a request that never held a slot (no tokens generated)."""
        self._emit(req, StepEvent(req.index, "", [], reason, error, len(req.prompt_ids), 0))

    def _emit(self, req: GenerationRequest, event: StepEvent) -> bool:
        try:
            req.sink(event)
            return True
        except Exception:  # the receiver is gone (event loop closed): treat as a disconnect
            log.warning("request %d: could not deliver a result; dropping it", req.id)
            return False

    def _release(self, row: EngineRow) -> None:
        del self._running[row.tag.id]
        self.engine.remove(row)

    def _finish(self, row: EngineRow, event: StepEvent) -> None:
        self.finished += 1
        self._emit(row.tag, event)  # first: releasing may store prefix blocks, which the client need not wait for
        self._release(row)

    def _drop(self, ids: set[int]) -> None:
        if not ids:
            return
        for rid in ids:
            row = self._running.get(rid)
            if row is not None:
                self._release(row)
                self.cancelled += 1
        self.cancelled += len(self._take_waiting(lambda req: req.id in ids))

    def _expire(self) -> None:
        now = time.monotonic()
        for row in list(self._running.values()):
            if row.tag.deadline is not None and now > row.tag.deadline:
                self._finish(row, _event(row, "", [], "timeout", "the request timed out"))
        for req in self._take_waiting(lambda req: req.deadline is not None and now > req.deadline):
            self.finished += 1
            self._end_queued(req, "timeout", "the request timed out while queued")

    def _admit(self) -> None:
        """Waiting requests take the free slots, first come first served; the engine prefills them together."""
        while self.engine.free_slots:
            with self._cond:
                if not self._waiting:
                    return
                req = self._waiting.popleft()
            text = TextState(self.token_bytes, req.params.stop_token_ids, req.params.stop_strings)
            row = EngineRow(req.prompt_ids, req.params, text, want_logprobs=req.logprobs or req.top_logprobs > 0,
                            top_logprobs=req.top_logprobs, tag=req, speculative=req.speculative,
                            constraint=req.constraint)
            try:
                self.engine.add(row)
            except Exception as exc:
                log.exception("admission of request %d failed", req.id)
                self.finished += 1
                self._end_queued(req, "error", f"prefill failed: {exc}")
                continue
            self._running[req.id] = row

    def _step(self) -> None:
        """One engine step: a token for every decoding request, a prefill chunk for every prefilling one."""
        outs: list[RowOutput] = self.engine.step()
        self.steps += 1
        self.peak_active = max(self.peak_active, len(self._running))
        for o in outs:
            row = o.row
            event = _event(row, o.text, [] if o.token is None else [o.token], o.finish_reason, o.error)
            if o.finish_reason is not None:
                self._finish(row, event)
            elif not self._emit(row.tag, event):
                self._release(row)
                self.cancelled += 1
