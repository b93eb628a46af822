"""The one decoding engine: sequences in the rows of a KV cache, each at its own position.

Every entry point that generates text (``Generator`` for ``tinyformer generate`` / ``chat`` / ``eval`` /
the trainer's samples, and the server's ``Scheduler``) drives a :class:`BatchEngine`. A sequence
(:class:`EngineRow`) takes a free row ("slot") of the cache and goes through two phases::

    prefill:  logits = model(prompt[pos : pos + n], cache row, positions pos .. pos + n - 1)
    decode:   y ~ q(. | logits);  logits = model(y, cache row, position pos)      one token per step

Each :meth:`BatchEngine.step` runs **one decode step** for every decoding row together::

    logits = model(tokens (R, 1), cache=cache rows 0 .. R-1 .at(positions (R,)))     # (R, V)

(row r attends to its own cache row up to its own position, so rows of different lengths share the
step), and then **one prefill round**: the rows still prefilling feed their next prompt tokens, at most
``prefill_chunk`` in all (all of them when None), first come first served (only the first row in line
feeds part of its prompt; the others join with their whole prompt or wait). Rows whose chunks start at the
same position and sit in neighbouring slots are prefilled in one forward call, right padded to the longest
chunk: causal attention keeps padding after a row's tokens invisible to them, and the padding's keys and
values are overwritten before any later token can see them. Long prompts, and many new prompts
at once, therefore advance chunk by chunk between the decode steps of the running rows, which never
stall for more than one chunk. A row whose prompt is fully fed samples its first token from the
prefill's last logits and decodes from the next step on. A row may start prefilling at ``pos > 0``
with the cache row already holding positions ``[0, pos)`` (a prefix cache hit).

With a ``compiled`` step (:class:`CompiledStep`) the decode step runs compiled graphs of fixed shapes over
rows [0, :meth:`BatchEngine.bucket`) (free rows decode a dummy token at a position their next writer
overwrites), which :meth:`BatchEngine.warm_up` compiles up front; the attended span ``[0, kv_len)`` is a
symbolic size, so one graph serves every step of a shape. A greedy step of one row without log-probabilities
returns the sampler's greedy case (``sample(logits, GREEDY)``) from its graph; every other step returns
logits, and all its rows are sampled in one :func:`~tinyformer.generation.sampling.sample` call, each with its
own parameters. On CPU the model's linear layers are laid out for decoding first
(:func:`~tinyformer.generation.weight_layout.prepare_for_decoding`).

Rows that carry a :class:`RowSearch` (beam search, greedy search: ``generation/beam.py``, for decoder-only
and encoder-decoder models alike) take their tokens from it instead of the sampler: given the logits of all
its rows, it picks each row's token and the row it continues, whose cache row (and tokens) the row then
takes over; its rows end together, when it says so.

A row ends on an end token or stop string (:class:`~tinyformer.generation.streaming.TextState`),
after ``max_new_tokens``, or when its cache row is full: ``context_policy="slide"`` then keeps its
last ``slide_keep`` tokens and prefills them again at positions 0 .. (positions stay inside the
trained range), ``"error"`` ends it with "length". LongRoPE rows are prefilled again when they outgrow
the original context (their cached keys were rotated with the short factors), and dynamic-NTK and
LongRoPE models decode row by row, since their rotary tables depend on each row's length.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from tinyformer.components.kv_cache import KVCache
from tinyformer.errors import ConfigError, GenerationError, NonFiniteOutputError, non_finite_message
from tinyformer.generation.constraint import Matcher, allowed_tokens, draft_masks
from tinyformer.generation.prefix_cache import PrefixCache, PrefixHit
from tinyformer.generation.sampling import (
    GREEDY,
    Sampler,
    SamplingParams,
    TokenMask,
    log_probs,
    make_generator,
    penalty_history,
    processed_logits,
    sample,
)
from tinyformer.generation.speculative import DraftModel, RowDrafts, SpeculativeConfig, accept_greedy, accept_sampled
from tinyformer.generation.streaming import TextState
from tinyformer.generation.weight_layout import prepare_for_decoding

__all__ = ["BatchEngine", "CompiledStep", "EngineRow", "RowOutput", "RowSearch", "TokenInfo", "new_prefix_cache"]

#: RoPE types whose rotary tables follow each row's length: such a model's rows are stepped one by one (no
#: compiled step, no prefix cache, no shared prompt prefill) and cannot speculate
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass
class TokenInfo:
    """One generated token: its id, log p under the model's raw distribution (None when not asked for),
    and the ``top`` most probable alternatives as (id, log p), best first (empty unless asked for)."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RowOutput:
    """What one step produced for one row: the token (None on an error), the text it completes, and,
    when the row ended here, why ("stop", "length", or "model_error" with ``error`` saying why)."""

    row: EngineRow
    token: TokenInfo | None
    text: str
    finish_reason: str | None = None
    error: str | None = None


class RowSearch(Protocol):
    """Picks the next tokens of its N rows together (beam search): from their logits (N, V), the tokens (N,)
    and the row each continues (N,) (None: each its own), or None when the search is over."""

    def advance(self, logits: Tensor) -> tuple[Tensor, Tensor | None] | None: ...


class EngineRow:
    """One sequence: its prompt, sampling parameters, text state, and where it stands in the cache.

    ``pos`` is the number of cache positions of its row filled so far; ``pending`` the tokens still to
    feed from ``pos`` on (the prompt while prefilling, else the last sampled token). ``want_logprobs``
    False skips the per-step log-normaliser (a lone greedy row then gets its argmax from the compiled graph);
    ``top_logprobs`` > 0 asks for that many alternatives per token. ``sampled_logprobs`` True records each
    token's log-probability under the distribution it was drawn from (the processed logits, see
    ``sampling.sample``) instead of the raw one. ``tag`` is the caller's (e.g. the server's request).
    ``speculative`` makes the row speculate (``generation/speculative.py``); ``drafts`` then holds its
    proposer state and counts once the row is added.
    ``constraint``: the row's own :class:`~tinyformer.generation.constraint.Matcher` (its place in the
    language of ``params.constraint``): each token is drawn from the tokens it allows and advances it, an
    end token only once the output is complete, and the row ends ("stop") when nothing can follow.
    ``search``: a :class:`RowSearch` (beam search, ``generation/beam.py``) that picks this row's tokens, and
    those of the other rows it holds, instead of the sampler; its rows sit in neighbouring slots, in its order.
    """

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, text: TextState, *,
                 want_logprobs: bool = True, top_logprobs: int = 0, tag: Any = None,
                 speculative: SpeculativeConfig | None = None, constraint: Matcher | None = None,
                 sampled_logprobs: bool = False, search: RowSearch | None = None) -> None:
        self.prompt_ids = list(prompt_ids)
        self.search = search
        self.speculative = speculative  # checked when the row is added
        self.drafts: RowDrafts | None = None
        self.params = params
        self.text = text
        self.want_logprobs = want_logprobs
        self.sampled_logprobs = sampled_logprobs
        self.top_logprobs = top_logprobs
        self.tag = tag
        self.constraint = constraint
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.slot = -1
        self.pos = 0
        self.pending: list[int] = []
        self.prefilling = True
        self.prefix_hit: PrefixHit | None = None  # the prefix-cache hit it was loaded from, pinned until it is removed
        self.slid = False  # its cache positions no longer hold prompt + tokens from position 0
        self.sampler = Sampler.of(params)  # built once; rows with equal sampler keys are processed together
        self.generator: torch.Generator | None = None
        # the plain argmax, no logprobs: what the compiled greedy step returns from its graph
        self.ids_only = self.sampler.key == GREEDY.key and not want_logprobs and top_logprobs == 0 \
            and constraint is None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class CompiledStep:
    """The compiled decode step of one model, shared by every engine over it (each new shape compiles once).

    ``step(tokens (R, 1), positions (R,), cache, span)``: one token per row at ``positions``, attending
    over cache slots [0, len(span)) masked per row: logits (R, V), or the argmax ids (R,) for the greedy
    variant. Only the span's length is symbolic, so a (rows, cache length) shape compiles once.
    """

    traced = True  # dynamo traces the calls: the engine marks the span's size symbolic

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._fns: dict[bool, Callable[..., Tensor]] = {}

    def logits(self, tokens: Tensor, positions: Tensor, cache: Any, span: Tensor) -> Tensor:
        return self.verify(tokens, positions, cache, span)[:, -1]

    def verify(self, tokens: Tensor, positions: Tensor, cache: Any, span: Tensor) -> Tensor:
        """A speculative verification: row r's tokens (R, T) at positions[r] .. positions[r] + T - 1, attending
        over cache slots [0, len(span)): logits (R, T, V)."""
        return self.model(tokens, cache=cache.at(positions, span.shape[0], per_query=True))

    def verifier(self, positions: int, rows: int, cache: Any) -> Callable[..., Tensor] | None:
        """The compiled verification of ``rows`` rows over 2 .. ``positions`` tokens each on ``cache``'s layout
        (:meth:`verify`), or None while there is none: the engine verifies eagerly (the ``torch.compile``-d
        step compiles none; a CPU's :class:`~tinyformer.generation.compile_cache.PackagedStep` does)."""
        return None

    def expect(self, rows: int, ids_only: bool, positions: int) -> None:
        """An engine that speculates says what it decodes ``rows`` rows with: the ``ids_only`` one-position
        step and the verification of ``positions`` tokens per row at most (a background builder of
        packages builds both together)."""

    def greedy(self, tokens: Tensor, positions: Tensor, cache: Any, span: Tensor) -> Tensor:
        # the sampler's greedy case inside the graph: a batch-1 greedy step then returns 8 bytes instead of
        # the (1, V) logits, and the argmax fuses with the LM head (docs/benchmarks/decode.md)
        return sample(self.logits(tokens, positions, cache, span), GREEDY, want_logprobs=False)[0]

    def get(self, ids_only: bool) -> Callable[..., Tensor]:
        if ids_only not in self._fns:
            options = {}
            if next(self.model.parameters()).device.type == "cpu":
                # The C++ wrapper removes the Python call overhead of the generated kernels, which is
                # most of what a small model's decode step costs.
                options["cpp_wrapper"] = True
                prepare_for_decoding(self.model)
            fn = self.greedy if ids_only else self.logits
            # dynamo keeps at most recompile_limit (8) graphs per code object, and every CompiledStep shares
            # these two methods' code: buckets x cache lengths x models of one process need more
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._fns[ids_only] = torch.compile(fn, fullgraph=True, dynamic=False, options=options)
        return self._fns[ids_only]


def check_speculative(spec: SpeculativeConfig, cfg: Any, has_draft: bool, max_draft_tokens: int) -> None:
    """GenerationError unless a row of a ``cfg`` model may speculate with ``spec`` (validated) on an engine that
    verifies ``max_draft_tokens`` drafts at most and holds a draft model when ``has_draft``."""
    spec.validate()
    if cfg.rope_type in LENGTH_DEPENDENT_ROPE:
        raise GenerationError("speculative decoding does not support dynamic-NTK or LongRoPE models (their "
                              "rotary tables follow each row's length)")
    if spec.draft_tokens > max_draft_tokens:
        raise GenerationError(f"{spec.draft_tokens} draft tokens were asked; this engine verifies "
                              f"{max_draft_tokens} at most")
    if spec.method == "draft" and not has_draft:
        raise GenerationError("speculative method 'draft' needs a draft model (--draft-model RUN)")


def default_slide_keep(max_len: int) -> int:
    """Tokens a full row keeps when it slides (``context_policy="slide"``): three quarters of ``max_len``
    (at least 1), so a slide re-prefills most of the context and happens once per max_len / 4 tokens."""
    return max(1, max_len - max(1, max_len // 4))


def new_prefix_cache(model: nn.Module, megabytes: float) -> PrefixCache | None:
    """A prefix cache of ``megabytes`` for ``model``'s KV caches (their dtype and device); None for 0."""
    if megabytes < 0:
        raise ConfigError(f"the prefix cache size must be >= 0 MB, got {megabytes}")
    if megabytes == 0:
        return None
    k = model.new_cache(1, 1).layers[0][0]
    return PrefixCache(model.cfg, budget_bytes=int(megabytes * 2**20), device=k.device, dtype=k.dtype)


def check_compilable(model: nn.Module) -> None:
    """GenerationError when the model holds a kernel ``torch.compile`` cannot trace, or when it sits on the
    CPU and no C++ compiler is found (inductor writes C++ for the CPU; without one the first step would fail
    deep inside the compiler, and ``serve --compile`` compiles at start-up)."""
    if any(getattr(m, "kernel", None) == "fbgemm" for m in model.modules()):
        raise GenerationError("the quantized kernel 'fbgemm' cannot be compiled (torch.compile does not trace "
                              "it): drop --compile, or quantize with another --kernel")
    if next(model.parameters()).device.type == "cpu" and cpp_compiler() is None:
        raise GenerationError(f"--compile on a CPU needs a C++ compiler (g++ or clang++; set CXX to choose one): "
                              f"{os.environ.get('CXX') or 'g++'} was not found")


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would call (``CXX``, else g++, else clang++), or None. Looked up on PATH
    rather than asked of inductor, whose import costs a decoding process 3 s when it only loads packages."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "clang++"]
    return next((path for path in map(shutil.which, names) if path), None)


class BatchEngine:
    """Rows of one KV cache (``max_batch`` x ``max_len``) decoded together; see the module docstring.

    ``add(row)`` gives a row a free slot (lowest first), ``remove(row)`` frees it, ``step()`` advances
    every row by one step and returns what each row that produced a token (or failed) produced.
    Finished rows stay in their slot until removed. ``compiled`` is a shared :class:`CompiledStep`, or
    None to decode eagerly; ``buckets`` pads a compiled step of several rows to the next power of two
    instead of to ``max_batch`` (see :meth:`bucket`).

    ``max_draft_tokens`` K > 0 lets rows speculate with up to K drafts per step (their rows of a
    sliding-window layer's ring get K spare slots, so a rollback loses nothing); ``draft_model`` is the
    draft model of rows whose method is "draft" (it shares the model's tokenizer).
    """

    def __init__(self, model: nn.Module, *, max_batch: int, max_len: int | None = None,
                 compiled: CompiledStep | None = None, prefill_chunk: int | None = None,
                 context_policy: str = "error", slide_keep: int | None = None,
                 prefix_cache: PrefixCache | None = None, buckets: bool = False,
                 max_draft_tokens: int = 0, draft_model: nn.Module | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {max_draft_tokens}")
        self.model = model
        cfg = model.cfg
        self.cache: KVCache = model.new_cache(max_batch, max_len, spare_slots=max_draft_tokens)
        self.max_len = self.cache.max_len
        self.max_batch = max_batch
        self.device = next(model.parameters()).device
        self.prefill_chunk = prefill_chunk
        self.context_policy = context_policy
        self.slide_keep = slide_keep if slide_keep is not None else default_slide_keep(self.max_len)
        # dynamic NTK and LongRoPE pick their rotary tables from the length seen: a per-row, host-side decision
        self.per_row = cfg.rope_type in LENGTH_DEPENDENT_ROPE
        rs = cfg.rope_scaling or {}
        self.long_from = int(rs["original_max_position_embeddings"]) if cfg.rope_type == "longrope" else -1
        self.compiled = None if self.per_row else compiled
        self.pow2_buckets = buckets
        # right-padded batched prefill would write padding into ring slots still inside a row's window
        self.pad_prefill = self.cache.indexed_by_position and not self.per_row
        # a PrefixCache (generation/prefix_cache.py) shared by the requests of this engine, when its rows
        # hold position p at index p (no rolling ring) and keys do not depend on the sequence's length
        self.prefix_cache = prefix_cache if prefix_cache is not None and not self.per_row \
            and prefix_cache.enabled_for(self.cache) else None
        self.rows: list[EngineRow] = []
        self._free = list(range(max_batch))
        self._views: dict[int, KVCache] = {max_batch: self.cache}
        self._last_shapes: list[tuple[int, bool]] = []
        self.moves = 0
        self.max_draft_tokens = max_draft_tokens
        self.draft_proposed = self.draft_accepted = 0  # over every row this engine verified
        self.draft = None if draft_model is None or not max_draft_tokens else \
            DraftModel(draft_model, max_batch, self.max_len, max_draft_tokens)

    # ------------------------------------------------------------------ rows
    @property
    def free_slots(self) -> int:
        return len(self._free)

    def add(self, row: EngineRow, *, prefilled: int = 0) -> None:
        """Give ``row`` the lowest free slot; its cache row is taken to hold its first ``prefilled``
        prompt positions already, so prefilling starts there. With a prefix cache, the longest cached
        prefix of the prompt is loaded into the row and prefilling starts after it."""
        if not self._free:
            raise RuntimeError("no free slot in the batch")
        ids = row.prompt_ids
        if len(ids) > self.max_len:
            if self.context_policy != "slide":
                raise GenerationError(f"the prompt has {len(ids)} tokens but the cache holds {self.max_len}")
            ids = ids[-self.max_len:]
            prefilled = 0
        if not 0 <= prefilled < len(ids):
            raise ValueError(f"prefilled must be in [0, {len(ids)}), got {prefilled}")
        if row.speculative is not None:
            check_speculative(row.speculative, self.model.cfg, self.draft is not None, self.max_draft_tokens)
            if row.sampled_logprobs:  # a verification records the raw log-probabilities (_token_infos)
                raise GenerationError("sampled_logprobs is not supported with speculative decoding")
            row.drafts = RowDrafts(row.speculative)
        row.slot = self._free.pop(0)
        if self.prefix_cache is not None and prefilled == 0 and ids is row.prompt_ids:
            hit = self.prefix_cache.lookup(ids)
            if hit.length:
                self.prefix_cache.load(hit, self.cache, row.slot)
                prefilled = hit.length
            row.prefix_hit = hit
        row.slid = ids is not row.prompt_ids
        row.pos, row.pending, row.prefilling = prefilled, list(ids[prefilled:]), True
        if row.params.seed is not None and not row.params.greedy:
            row.generator = make_generator(row.params, self.device)
        self.rows.append(row)

    def add_group(self, rows: Sequence[EngineRow]) -> None:
        """Add rows that share one prompt (n samples of it): the prompt's first len - 1 tokens are prefilled
        once, in the first row's slot, and their keys and values copied to the others' slots (causal K/V at
        position p depend on tokens 0..p only, so each copy holds what prefilling it alone writes); every row
        then feeds the last prompt token itself and samples as usual. Falls back to :meth:`add` per row where
        that does not hold or does not pay (one row, a one-token prompt, ring slots, per-row RoPE, a prefix
        cache, a prompt longer than the cache)."""
        ids = rows[0].prompt_ids if rows else []
        if (len(rows) < 2 or len(ids) < 2 or len(ids) > self.max_len or self.per_row or self.prefix_cache is not None
                or not self.cache.indexed_by_position or any(r.prompt_ids != ids for r in rows)):
            for r in rows:
                self.add(r)
            return
        n = len(ids) - 1
        first = rows[0]
        self.add(first)
        first.pending = first.pending[n:]
        with torch.inference_mode():
            self._forward_rows([first], [ids[:n]])
        for r in rows[1:]:
            self.add(r, prefilled=n)
            for k, v in self.cache.layers:
                k[r.slot, :, :n].copy_(k[first.slot, :, :n])
                v[r.slot, :, :n].copy_(v[first.slot, :, :n])

    def remove(self, row: EngineRow) -> None:
        """Free the row's slot (finished or cancelled). With a prefix cache, the whole blocks of the tokens
        whose keys and values the row holds (prompt and generated tokens) are stored first, so a later
        request that continues this one (the next turn of a chat) finds them, and its hit is released."""
        if self.prefix_cache is not None:
            # a row that failed on non-finite logits may hold non-finite keys and values: never shared
            if not row.slid and row.pos > 0 and row.finish_reason != "model_error":
                self.prefix_cache.store(row.prompt_ids + row.token_ids, self.cache, row.slot, row.pos)
            if row.prefix_hit is not None:
                self.prefix_cache.release(row.prefix_hit)
                row.prefix_hit = None
        self.rows.remove(row)
        self._free.append(row.slot)
        self._free.sort()

    def compact(self) -> None:
        """Move rows from the highest used slots into free lower ones, so that a decode step covers rows
        0 .. n-1 and no free row in between. Moving copies the row's filled cache positions (a few MB at
        most); it happens once per row that finishes below another."""
        while self.rows and self._free:
            row = max(self.rows, key=lambda r: r.slot)
            dst = self._free[0]
            if dst > row.slot:
                return
            self._free.pop(0)
            for k, v in self.cache.layers:
                k[dst, :, : row.pos].copy_(k[row.slot, :, : row.pos])
                v[dst, :, : row.pos].copy_(v[row.slot, :, : row.pos])
            self._free.append(row.slot)
            self._free.sort()
            row.slot = dst
            if row.drafts is not None:  # its draft-model row stays behind: prefill the new one from scratch
                row.drafts.draft_pos = 0
            self.moves += 1

    # ------------------------------------------------------------------ one step
    def run(self) -> Iterator[list[RowOutput]]:
        """Step until no row is left: yields each step's outputs, then removes the rows that finished in it.
        A row that failed raises :class:`NonFiniteOutputError` with its error (rows still held then stay)."""
        while self.rows:
            outs = self.step()
            for o in outs:
                if o.error is not None:
                    raise NonFiniteOutputError(o.error)
            yield outs
            for o in outs:
                if o.finish_reason is not None:
                    self.remove(o.row)

    def step(self) -> list[RowOutput]:
        """One decode step for the decoding rows, then one prefill round for the prefilling ones."""
        decoding = [r for r in self.rows if not r.prefilling and not r.finished]
        out = self._decode(decoding) if decoding else []
        return out + self._prefill([r for r in self.rows if r.prefilling and not r.finished])

    def _view(self, n: int) -> KVCache:
        """Rows [0, n) of the cache (one view per size, so a compiled step sees the same object)."""
        if n not in self._views:
            self._views[n] = self.cache.row_view(0, n)
        return self._views[n]

    def _positions(self, n: int) -> list[int]:
        """Each slot's position in a step over slots [0, n): its row's ``pos``. A slot without a decoding row
        decodes a dummy token at the position its next writer (a prefilling row, or a row admitted later)
        overwrites before anything reads it: its own row's, else 0."""
        positions = [0] * n
        for r in self.rows:
            if r.slot < n:
                positions[r.slot] = r.pos
        return positions

    def bucket(self, n: int) -> int:
        """The rows a compiled step over rows [0, n) runs: 1 for one row; else ``max_batch``, or with
        ``buckets`` the next power of two, at most ``max_batch``. Each bucket is one graph (a compilation
        takes seconds to tens of seconds on a CPU): a one-shot batch (``Generator``) compiles two at most,
        a server compiles its five up front and pads by at most 2x, where padding every step to
        ``max_batch`` rows made a step of 4 rows cost as much as one of 16."""
        if n <= 1:
            return 1
        if not self.pow2_buckets:
            return self.max_batch
        return min(1 << (n - 1).bit_length(), self.max_batch)

    def buckets(self) -> list[int]:
        """Every bucket size, smallest first (one compiled graph each)."""
        return sorted({self.bucket(n) for n in range(1, self.max_batch + 1)})

    def warm_up(self) -> None:
        """Compile the decode step of every bucket now (and its verification, where rows may speculate), so
        that no request waits for a compilation later (a no-op without ``compiled``). Runs each graph once on
        dummy tokens at position 0 of the free rows, which a row's prefill overwrites before anything reads
        them; call it while no row is in the engine, in the same grad mode as the steps
        (``torch.inference_mode()``)."""
        if self.compiled is None:
            return
        if self.rows:
            raise RuntimeError("warm_up() needs an empty engine: it writes dummy keys at position 0")
        # a span of 2, not 1: dynamo specialises sizes 0 and 1, and the graph must take any span
        span = torch.empty(min(2, self.max_len), device=self.device)
        if self.compiled.traced:
            torch._dynamo.maybe_mark_dynamic(span, 0)
        most = self.max_draft_tokens + 1
        for n in self.buckets():
            t = torch.zeros(n, 1, dtype=torch.long, device=self.device)
            p = torch.zeros(n, dtype=torch.long, device=self.device)
            for ids_only in ((False, True) if n == 1 else (False,)):
                if self.max_draft_tokens:
                    self.compiled.expect(n, ids_only, most)
                self.compiled.get(ids_only)(t, p, self._view(n), span)
            if self.max_draft_tokens:  # and the bucket's speculative verification, where the step compiles one
                self.compiled.verifier(most, n, self._view(n))

    def _decode(self, rows: list[EngineRow]) -> list[RowOutput]:
        dev = self.device
        if self.per_row:
            logits = torch.cat([self._forward_rows([r], [r.pending]) for r in rows])
            return self._pick(logits, rows)
        n = max(r.slot for r in rows) + 1
        if self.max_draft_tokens:
            drafts = self._propose(rows, n)
            if drafts:
                return self._verify(rows, drafts, n)
        compiled = self.compiled
        if compiled is not None:
            n = self.bucket(n)
        tokens = [0] * n
        positions = self._positions(n)
        for r in rows:
            tokens[r.slot] = r.pending[0]
        kv = max(positions) + 1
        t = torch.tensor(tokens, device=dev)[:, None]
        p = torch.tensor(positions, device=dev)
        cache = self._view(n)
        picked: Tensor | None = None
        if compiled is None:
            logits = self.model(t, cache=cache.at(p, kv, per_query=True))[:, -1]
        else:
            # greedy ids from the graph for one row (a bucket of several returns logits: one graph per bucket)
            ids_only = n == 1 and all(r.ids_only for r in rows)
            if self.max_draft_tokens:  # a background builder builds the verification alongside
                compiled.expect(n, ids_only, self.max_draft_tokens + 1)
            step = compiled.get(ids_only)
            # the span to attend over, as the length of a tensor whose size the compiled step treats as symbolic
            span = torch.empty(kv, device=dev)
            if compiled.traced:
                torch._dynamo.maybe_mark_dynamic(span, 0)
            shape = (n, ids_only)
            # When the last two steps had these shapes, the inputs come from the same places with the same
            # shapes, strides and dtypes, only values change, so the guards would pass; skipping their
            # check saves 2-3% of a step (one check per parameter). The stance holds for this call only.
            same = compiled.traced and self._last_shapes == [shape, shape]
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if same else nullcontext():
                res = step(t, p, cache, span)
            self._last_shapes = (self._last_shapes + [shape])[-2:]
            picked, logits = (res, None) if ids_only else (None, res)
        for r in rows:
            r.pos += 1
        index = torch.tensor([r.slot for r in rows], device=dev)
        if picked is not None:  # greedy ids from the compiled step (the prefill's logits were checked)
            return [self._accept(r, TokenInfo(tok, None)) for r, tok in zip(rows, picked[index].tolist())]
        assert logits is not None
        if len(rows) != n or any(r.slot != i for i, r in enumerate(rows)):
            logits = logits[index]
        return self._pick(logits, rows)

    # ------------------------------------------------------------------ speculative decoding
    def _propose(self, rows: list[EngineRow], n: int) -> dict[int, list[int]]:
        """The drafts of each speculating row for this step, by ``id(row)`` (rows without any left out). The
        verifying forward writes positions pos .. pos + K of every row in slots [0, n), so K is capped to the
        room every one of them has left, and to the row's remaining token budget minus the token it emits."""
        room = self.max_len - 1 - max(r.pos for r in self.rows if r.slot < n)
        drafts: dict[int, list[int]] = {}
        for r in rows:
            state = r.drafts
            if state is None:
                continue
            k = state.budget(min(room, r.params.max_new_tokens - len(r.token_ids) - 1))
            if k <= 0:
                continue
            seq = r.prompt_ids + r.token_ids
            if state.ngram is not None:
                state.ngram.extend(seq)
                proposal = state.ngram.propose(k)
            else:
                assert self.draft is not None
                proposal = self.draft.propose(r.slot, seq, state, k, r.sampler, r.generator)
            if proposal and r.constraint is not None and (r.sampler.greedy or state.ngram is not None):
                # a draft the grammar refuses would be rejected at once (its target probability is 0), so
                # it is not verified; a sampled model draft stays whole, as cutting it would bias the draw
                proposal = proposal[: r.constraint.check_draft(proposal)]
            if proposal:
                drafts[id(r)] = proposal
        return drafts

    def _verify(self, rows: list[EngineRow], drafts: dict[int, list[int]], n: int) -> list[RowOutput]:
        """One forward over T = 1 + the most drafts for the rows in slots [0, n): each decoding row feeds its
        pending token and its drafts at pos .. (right padded to T; the other slots a dummy block their next
        writer overwrites); each row then keeps the drafts the model agrees with and one token more
        (``generation/speculative.py``), and its cache row forgets the rest (``KVCache.truncate``). With a
        compiled step the forward is its compiled verification (over the rows of the step's bucket, T
        symbolic) once that exists, and eager until then."""
        dev = self.device
        T = 1 + max(len(d) for d in drafts.values())
        verify = None
        if self.compiled is not None:
            b, most = self.bucket(n), self.max_draft_tokens + 1
            self.compiled.expect(b, b == 1 and all(r.ids_only for r in rows), most)
            # every row of the bucket writes T positions: all of them must fit, with the free slot the
            # compiled graph keeps after the span
            if max(r.pos for r in self.rows if r.slot < b) + T < self.max_len:
                verify = self.compiled.verifier(most, b, self._view(b))
                if verify is not None:
                    n = b
        tokens = [[0] * T for _ in range(n)]
        positions = self._positions(n)
        feeds = [[r.pending[0]] + drafts.get(id(r), []) for r in rows]
        for r, f in zip(rows, feeds):
            tokens[r.slot][: len(f)] = f
        p = torch.tensor(positions, device=dev)
        t = torch.tensor(tokens, device=dev)
        if verify is None:
            # each query attends as the one-token step at its position does: greedy output stays plain's
            logits = self.model(t, cache=self._view(n).at(p, max(positions) + T, per_query=True))
        else:
            logits = verify(t, p, self._view(n), torch.empty(max(positions) + T, device=dev))
        # entry e: row r's logits after its j-th fed token, j = 0 .. len(drafts)
        owner = [(r, j) for r, f in zip(rows, feeds) for j in range(len(f))]
        flat = logits.flatten(0, 1)[torch.tensor([r.slot * T + j for r, j in owner], device=dev)]
        V = flat.shape[-1]
        finite = _finite_rows(flat)
        history = None
        if any(r.sampler.penalised for r in rows):
            seen = [r.token_ids + f[1 : j + 1] for r, f in zip(rows, feeds) for j in range(len(f))]
            history = penalty_history([r.params for r, _ in owner], [r.prompt_ids for r, _ in owner], seen, dev)
        # a constrained row's target at its j-th position is the plain path's: the logits masked by its
        # grammar after the first j drafts (constraint.draft_masks), then processed
        allowed = None
        if any(r.constraint is not None for r in rows):
            allowed = torch.cat([draft_masks(r.constraint, f[1:], V) if r.constraint is not None
                                 else torch.ones(len(f), V, dtype=torch.bool) for r, f in zip(rows, feeds)]).to(dev)
        x = processed_logits(flat if allowed is None else TokenMask(allowed)(flat.float()),
                             [r.sampler for r, _ in owner], history)
        targets = x.argmax(dim=-1).tolist() if any(r.sampler.greedy for r in rows) else []
        out: list[RowOutput] = []
        e = 0
        for r, f in zip(rows, feeds):
            first, e = e, e + len(f)
            d = f[1:]
            if allowed is not None and r.constraint is not None:
                # the grammar cannot go on after j of the drafts: emit at most j - 1 of them (at j = 0 the
                # row is stuck now, and ends as the plain path ends it)
                empty = (~allowed[first:e].any(dim=-1)).nonzero()
                if len(empty):
                    j = int(empty[0])
                    if j == 0:
                        out.append(_failed(r, _stuck(r)))
                        continue
                    d = d[: j - 1]
            if not all(finite[first:e]):
                out.append(_failed(r, _non_finite(r)))
                continue
            if r.sampler.greedy:
                m, y = accept_greedy(targets[first : first + len(d) + 1], d)
            else:
                q = r.drafts.q if r.drafts is not None and r.drafts.ngram is None else None
                m, y = accept_sampled(x[first : first + len(d) + 1], d, q, r.generator)
            if r.drafts is not None and d:
                r.drafts.record(len(d), m)
                self.draft_proposed += len(d)
                self.draft_accepted += m
            emitted = d[:m] + [y]
            infos = self._token_infos(flat[first : first + m + 1], emitted, r)
            start = r.pos
            for i, info in enumerate(infos):
                r.pos = start + 1 + i
                out.append(self._accept(r, info))
                if r.finished or r.prefilling:
                    break
            if not r.finished and not r.prefilling:
                if r.pos < start + T:  # forget the rejected drafts and the padding
                    self.cache.row_view(r.slot).truncate(r.pos, old=start + T)
                if self.draft is not None and r.drafts is not None and r.drafts.ngram is None and d:
                    self.draft.rollback(r.slot, r.drafts, r.drafts.base + m)
        return out

    def _token_infos(self, logits: Tensor, tokens: list[int], row: EngineRow) -> list[TokenInfo]:
        """``row``'s TokenInfo of each token, chosen from the raw ``logits`` (len(tokens), V) of its position."""
        lps: list[float | None] = [None] * len(tokens)
        tops: dict[int, list[tuple[int, float]]] = {}
        if row.want_logprobs or row.top_logprobs:
            lsm = log_probs(logits.float())
            if row.want_logprobs:
                lps = lsm.gather(1, torch.tensor(tokens, device=lsm.device)[:, None]).squeeze(1).tolist()
            if row.top_logprobs:
                values, ids = lsm.topk(min(row.top_logprobs, lsm.size(-1)), dim=-1)
                tops = {i: list(zip(ids[i].tolist(), values[i].tolist())) for i in range(len(tokens))}
        return [TokenInfo(t, lps[i], tops.get(i, [])) for i, t in enumerate(tokens)]

    def _prefill(self, rows: list[EngineRow]) -> list[RowOutput]:
        """One prefill round, as the module docstring says. Only the first row in line may feed part of its
        prompt, as starting a prompt that cannot finish this step delays the first token of every prompt behind
        it: 16 prompts of 200 tokens with a budget of 256 reached their median first token 1.3-1.5x later when
        each step also fed 56 tokens of the next."""
        budget = self.prefill_chunk
        take: dict[int, int] = {}
        for r in rows:
            n = len(r.pending) if budget is None else min(len(r.pending), budget)
            if n == 0 or (take and n < len(r.pending)):
                break
            take[id(r)] = n
            if budget is not None:
                budget -= n
        groups: list[list[EngineRow]] = []
        for r in sorted((r for r in rows if id(r) in take), key=lambda r: (r.pos, r.slot)):
            last = groups[-1][-1] if groups else None
            if self.pad_prefill and last is not None and last.pos == r.pos and last.slot + 1 == r.slot:
                groups[-1].append(r)
            else:
                groups.append([r])
        done: list[EngineRow] = []
        logits: list[Tensor] = []
        for group in groups:
            feeds = [r.pending[: take[id(r)]] for r in group]
            for r, f in zip(group, feeds):
                r.pending = r.pending[len(f):]
            out = self._forward_rows(group, feeds)
            for i, r in enumerate(group):
                if not r.pending:
                    r.prefilling = False
                    done.append(r)
                    logits.append(out[i : i + 1])
        return self._pick(torch.cat(logits), done) if done else []

    def _forward_rows(self, group: list[EngineRow], feeds: list[list[int]]) -> Tensor:
        """Feed ``feeds[i]`` to the rows of ``group`` (neighbouring slots, same position), right padded:
        the logits at each row's last fed token (len(group), V)."""
        start, lo = group[0].pos, group[0].slot
        T = max(len(f) for f in feeds)
        x = torch.tensor([f + [0] * (T - len(f)) for f in feeds], device=self.device)
        view = self.cache.row_view(lo, lo + len(group))
        view.length = start
        if all(len(f) == T for f in feeds):
            logits = self.model(x, cache=view, last_only=True)[:, -1]
        else:
            h = self.model.hidden_states(x, cache=view)
            last = torch.tensor([len(f) - 1 for f in feeds], device=self.device)
            h = h[torch.arange(len(group), device=self.device), last]
            logits = self.model.logits(h)
        for r, f in zip(group, feeds):
            r.pos += len(f)
        return logits

    # ------------------------------------------------------------------ sampling
    def _pick(self, logits: Tensor, rows: list[EngineRow]) -> list[RowOutput]:
        """The next token of each row of ``logits`` (A, V): the rows of a search from their search
        (:meth:`_search`), the others sampled (:meth:`_sample`)."""
        if all(r.search is None for r in rows):
            return self._sample(logits, rows)
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault(id(r.search), []).append(i)
        out: list[RowOutput] = []
        for idx in groups.values():
            if rows[idx[0]].search is not None:  # a search's rows in its order, which is their slots'
                idx.sort(key=lambda i: rows[i].slot)
            part = [rows[i] for i in idx]
            x = logits if idx == list(range(len(rows))) else logits[torch.tensor(idx, device=logits.device)]
            out += self._sample(x, part) if part[0].search is None else self._search(x, part)
        return out

    def _search(self, logits: Tensor, rows: list[EngineRow]) -> list[RowOutput]:
        """One step of the search of ``rows`` (all of its rows, in its order, at one position): each row
        takes over the cache row and the tokens of the row its next token continues, and feeds that token
        next. The rows end together, when the search is over; the caller reads the hypotheses from it."""
        # the prompt's logits are checked, as a search's log-softmax would turn NaN into any token; a later
        # step's check would cost as much as the log-softmax itself
        if not rows[0].token_ids and not bool(torch.isfinite(logits).all()):
            return self._sample_but(logits, rows, [True] * len(rows), _non_finite)
        picked = rows[0].search.advance(logits)
        if picked is None:
            for r in rows:
                r.finish_reason = "stop"
            return [RowOutput(r, None, "", "stop") for r in rows]
        tokens, index = picked
        if index is not None:
            lo, hi = rows[0].slot, rows[-1].slot + 1
            if hi - lo != len(rows):
                raise RuntimeError("the rows of a search must sit in neighbouring slots")
            # the filled positions of each row (a ring: all its slots, at the same places in every row)
            n = rows[0].pos if self.cache.indexed_by_position else None
            moved = index.to(self.device)
            for k, v in self.cache.layers:
                for x in (k, v):
                    x[lo:hi, :, :n].copy_(x[lo:hi, :, :n].index_select(0, moved))
            history = [rows[i].token_ids for i in index.tolist()]
            for r, h in zip(rows, history):
                r.token_ids = list(h)
        out = []
        for r, tok in zip(rows, tokens.tolist()):
            r.token_ids.append(tok)
            r.pending = [tok]
            out.append(RowOutput(r, TokenInfo(tok, None), ""))
        return out

    def _sample(self, logits: Tensor, rows: list[EngineRow]) -> list[RowOutput]:
        """One token per row of ``logits`` (A, V), with each row's own parameters, in one :func:`sample` call
        (rows with equal sampler keys share their processors; a seeded row draws from its own generator, so
        it draws the same numbers whether or not it shares the batch)."""
        n = len(rows)
        finite = _finite_rows(logits)
        if not all(finite):  # those rows end with an error; the others are sampled as usual
            return self._sample_but(logits, rows, [not f for f in finite], _non_finite)
        history = None
        if any(r.sampler.penalised for r in rows):
            history = penalty_history([r.params for r in rows], [r.prompt_ids for r in rows],
                                      [r.token_ids for r in rows], logits.device)
        generators = [r.generator for r in rows] if any(r.generator is not None for r in rows) else None
        # each constrained row's own mask (generation/constraint.py; _verify masks speculative drafts alike)
        allowed = None
        if any(r.constraint is not None for r in rows):
            allowed = allowed_tokens([r.constraint for r in rows], logits.shape[-1], logits.device)
            # a matcher that stopped before its row ended found the grammar cannot be completed from here
            stuck = [e or (r.constraint is not None and r.constraint.stopped)
                     for e, r in zip((~allowed.any(dim=-1)).tolist(), rows)]
            if any(stuck):  # the vocabulary cannot write what the grammar needs next: those rows end with an error
                return self._sample_but(logits, rows, stuck, _stuck)
        drawn = [r.sampled_logprobs for r in rows]
        tok, lp = sample(logits, [r.sampler for r in rows], history, generators,
                         want_logprobs=any(r.want_logprobs for r in rows), allowed=allowed,
                         sampled_logprobs=drawn[0] if len(set(drawn)) == 1 else drawn)
        tokens: list[int] = tok.tolist()
        # a row that did not ask for logprobs gets none, whichever rows shared its call
        logps: list[float | None] = [x if r.want_logprobs else None for x, r in zip(lp.tolist(), rows)] \
            if lp is not None else [None] * n
        tops: dict[int, list[tuple[int, float]]] = {}
        want = [i for i, r in enumerate(rows) if r.top_logprobs > 0]
        if want:
            k = max(rows[i].top_logprobs for i in want)
            lsm = log_probs(logits[torch.tensor(want, device=logits.device)].float())
            values, ids = lsm.topk(min(k, lsm.size(-1)), dim=-1)
            for j, i in enumerate(want):
                kk = rows[i].top_logprobs
                tops[i] = list(zip(ids[j, :kk].tolist(), values[j, :kk].tolist()))
        return [self._accept(r, TokenInfo(tokens[i], logps[i], tops.get(i, []))) for i, r in enumerate(rows)]

    def _sample_but(self, logits: Tensor, rows: list[EngineRow], bad: list[bool],
                    why: Callable[[EngineRow], str]) -> list[RowOutput]:
        """Sample the rows not marked ``bad``; the bad ones end with "model_error" and ``why(row)``."""
        good = [i for i in range(len(rows)) if not bad[i]]
        outs = dict(zip(good, self._sample(logits[torch.tensor(good, dtype=torch.long, device=logits.device)],
                                           [rows[i] for i in good]) if good else []))
        return [outs[i] if i in outs else _failed(r, why(r)) for i, r in enumerate(rows)]

    def _accept(self, row: EngineRow, info: TokenInfo) -> RowOutput:
        """Record one token of ``row``: its text, whether the row ends, and what it feeds next."""
        tok = info.token_id
        row.token_ids.append(tok)
        if row.want_logprobs and info.logprob is not None:
            row.logprobs.append(info.logprob)
        text, ended = row.text.accept(tok)
        finish = "stop" if ended else None
        if row.constraint is not None:
            row.constraint.advance(tok)
            if row.constraint.stopped:  # complete, and nothing may follow: the row ends here
                finish = "stop"
        if finish is None and len(row.token_ids) >= row.params.max_new_tokens:
            finish = "length"
        if finish is None:
            if row.pos >= self.max_len:  # the row is full: no position is left to feed the token
                if self.context_policy == "slide":
                    # keep the last slide_keep tokens and prefill them again at positions 0 ..
                    row.pos, row.pending, row.prefilling = 0, (row.prompt_ids + row.token_ids)[-self.slide_keep:], True
                    row.slid = True
                else:
                    finish = "length"
            elif row.pos == self.long_from:
                # LongRoPE: the sequence now outgrows the original context, so every position takes the long
                # factors; the cached keys were rotated with the short ones: prefill again, as transformers'
                # Phi-3 does
                keep = row.pos + 1
                row.pos, row.pending, row.prefilling = 0, (row.prompt_ids + row.token_ids)[-keep:], True
            else:
                row.pending = [tok]
        if finish is not None:
            text += row.text.close()
            finish = "stop" if row.text.stopped else finish
            row.finish_reason = finish
        return RowOutput(row, info, text, finish)


def _finite_rows(logits: Tensor) -> list[bool]:
    """Whether each row of ``logits`` (A, V) is finite: iff its largest and smallest logits are (max/min
    propagate NaN, and both are vectorised single passes; isfinite(logits).all() writes a mask of the whole
    (A, V) first, ~25x slower)."""
    return (torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))).tolist()


def _non_finite(r: EngineRow) -> str:
    return non_finite_message(f"for generated token {len(r.token_ids) + 1}")


def _stuck(r: EngineRow) -> str:
    assert r.constraint is not None
    return (f"no token of the vocabulary continues {r.constraint.grammar.describe()} after "
            f"{len(r.token_ids)} tokens: the tokenizer cannot write what it needs")


def _failed(r: EngineRow, why: str) -> RowOutput:
    """``r`` ends here with "model_error" and ``why``."""
    r.finish_reason = "model_error"
    return RowOutput(r, None, r.text.close(), "model_error", why)
