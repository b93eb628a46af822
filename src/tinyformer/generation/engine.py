"""The decoding engine: prompts in, tokens and text out, one token per step against the KV cache.

    prefill:  logits_P = model(prompt_{0..P-1}, cache)             one forward pass over the prompt
    decode:   y_t ~ q(. | logits_t)                                  sampling.sample_next
              logits_{t+1} = model(y_t, cache)                       one token per step, O(1) new K/V rows

Batches of prompts of different lengths are **left padded** to the longest, with an attention mask
(1 = token, 0 = padding). The model derives each row's positions from the mask (cumsum - 1), so a
row sees exactly the keys and positions it would see alone, and every row's generated tokens start
at the same column. Greedy decoding of a batch therefore gives the same tokens as decoding each
prompt alone; for sampling, row ``b`` draws from its own generator seeded with ``seed + b``, so
row ``b`` of a batch equals the prompt decoded alone with seed ``seed + b``.

Stopping, per row: the end-of-sequence token, any of ``params.stop_token_ids``, a stop string (even
one spread over several tokens; it is never shown), or ``max_new_tokens``. Text is produced
incrementally from each token's raw bytes (``Tokenizer.token_bytes``), so a stream never shows half
a UTF-8 character.

Context overflow never passes silently. ``context_policy="error"`` refuses a request whose prompt
plus ``max_new_tokens`` does not fit ``max_seq_len``; ``"slide"`` keeps going: whenever the cache is
full it keeps the last ``slide_keep`` tokens, clears the cache and prefills them again (positions
restart at 0, so they stay inside the trained range). A batch slides when its longest row fills the
context.

Beam search (``Generator.beam_search``) is :func:`tinyformer.generation.beam.beam_search`, the one
search shared with encoder-decoder models, stepping the KV cache.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from tinyformer.errors import GenerationError, NonFiniteOutputError, TinyformerError, non_finite_message
from tinyformer.generation.beam import (
    DEFAULT_EARLY_STOPPING,
    DEFAULT_LENGTH_PENALTY,
    DEFAULT_NUM_RETURN_SEQUENCES,
    EarlyStopping,
    beam_search,
    validate_beam_args,
)
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
from tinyformer.generation.weight_layout import store_input_major

__all__ = [
    "CONTEXT_POLICIES",
    "GenerationResult",
    "GenerationTimings",
    "Generator",
    "TextStream",
]

CONTEXT_POLICIES = ("error", "slide")
# With ``compile=True`` the cache length is rounded up to a multiple of this, so that requests of
# similar lengths share one compiled step (each new shape compiles again).
STATIC_CACHE_BLOCK = 128


@dataclass
class GenerationResult:
    """One generated sequence.

    ``token_ids`` are every generated id (the prompt excluded), including the token that ended the
    sequence (EOS, a stop token, or the last token of a stop string); ``logprobs[i]`` is
    log p(token_ids[i]) under the model's raw distribution (empty when not asked for). ``text`` is the
    decoded text without the end-of-sequence token, stop tokens and stop strings. ``finish_reason`` is
    "stop" (EOS, stop token or stop string) or "length" (``max_new_tokens``).
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_token_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "logprobs": self.logprobs,
                "finish_reason": self.finish_reason}


@dataclass
class GenerationTimings:
    """Wall-clock cost of the last request, as llama.cpp reports it: ``prefill_ms`` for the forward pass over the
    prompt (``prompt_tokens`` of the longest row), then ``decode_tokens_per_s`` = decode steps / their time,
    where the steps are the forward passes after the prefill (``completion_tokens`` - 1: the first new token
    comes from the prefill's logits) and their time runs from the end of the prefill to the last token
    (sampling and any context slide included). ``completion_tokens`` counts the longest row's tokens."""

    prompt_tokens: int = 0
    prefill_ms: float = 0.0
    completion_tokens: int = 0
    decode_tokens_per_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "prefill_ms": round(self.prefill_ms, 3),
                "completion_tokens": self.completion_tokens,
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 3)}


class TextStream(Iterator[str]):
    """Iterator over the text pieces of one generation; ``result`` holds the full
    :class:`GenerationResult` once the iterator is exhausted."""

    def __init__(self, pieces: Iterator[str], row: _Row) -> None:
        self._pieces = pieces
        self._row = row

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    @property
    def result(self) -> GenerationResult:
        if self._row.finish_reason is None:
            raise RuntimeError("the stream has not finished yet")
        return self._row.result()


class _Row:
    """Text state of one sequence: ids, logprobs, incremental UTF-8 decoding and stop-string matching."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, token_bytes: Callable[[int], bytes],
                 end_ids: frozenset[int]) -> None:
        self.prompt_ids = prompt_ids
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.pieces: list[str] = []
        self.finish_reason: str | None = None
        self._token_bytes = token_bytes
        self._end_ids = end_ids
        self._decoder = Utf8StreamDecoder()
        self._stopper = StopStringMatcher(params.stop_strings)

    def accept(self, token: int, logprob: float | None) -> str:
        """Record one token; return the text it completes ("" while a character or a possible stop
        string is incomplete, and always "" once the row has finished)."""
        if self.finish_reason is not None:
            return ""
        self.token_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if token in self._end_ids:
            return self.close("stop")
        text, stopped = self._stopper.push(self._decoder.push(self._token_bytes(token)))
        self.pieces.append(text)
        if stopped:
            self.finish_reason = "stop"
        return text

    def close(self, reason: str) -> str:
        """End the row: release held-back text (half a character becomes U+FFFD; a held possible
        start of a stop string is shown unless it completes one)."""
        if self.finish_reason is not None:
            return ""
        tail, stopped = self._stopper.push(self._decoder.flush())
        if not stopped:
            tail += self._stopper.flush()
        self.finish_reason = "stop" if stopped else reason
        self.pieces.append(tail)
        return tail

    def result(self) -> GenerationResult:
        return GenerationResult("".join(self.pieces), self.token_ids, self.logprobs, self.finish_reason or "length",
                                self.prompt_ids)


def check_finite(logits: Tensor, index: int) -> Tensor:
    """``logits`` unchanged when every value is finite; else NonFiniteOutputError. NaN logits would
    otherwise sample token 0 or nothing at all, and inf ones an arbitrary token, silently. One reduction
    over (B, V) per step, small beside the forward pass that produced them."""
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteOutputError(non_finite_message(f"for generated token {index + 1}"))
    return logits


# ------------------------------------------------------------------------------------------------
# the generator
# ------------------------------------------------------------------------------------------------


class Generator:
    """Text generation with a decoder LM (``DecoderLM``) and its tokenizer.

    ``generate(prompts, params)`` decodes a batch; ``stream(prompt, params)`` yields text as it is
    produced; ``beam_search(prompt, ...)`` returns the best hypotheses. Prompts are text (encoded with
    the tokenizer) or lists of token ids. ``tokenizer`` may be None for id prompts only (no text,
    no stop strings). ``eos_token_id`` (default: the tokenizer's) ends a sequence; set it to None to
    generate exactly ``max_new_tokens``.

    ``compile=True`` decodes with a ``torch.compile``-d step: each row at its own cache positions (no
    padding), attending over the cache slots filled so far with a per-row mask; the cache length is
    rounded up to a multiple of ``STATIC_CACHE_BLOCK``, and only the attended span's length is a
    symbolic size. The first request of each (batch, cache length) shape pays the compilation (tens of
    seconds on CPU); every later token is cheaper, since the many small
    kernels of a layer are fused and called without Python in between. Requests that would slide their
    context, and dynamic-NTK and LongRoPE models, are decoded eagerly. On CPU it also stores the model's linear weights
    input-major (:func:`~tinyformer.generation.weight_layout.store_input_major`), as ``from_run`` does
    for the model it loads: same values and shapes, faster batch-1 products for weights read from DRAM.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        device: torch.device | str | None = None,
        *,
        context_policy: str = "error",
        slide_keep: int | None = None,
        compile: bool = False,
    ) -> None:
        cfg = getattr(model, "cfg", None)
        if cfg is None or cfg.arch != "decoder" or not hasattr(model, "new_cache"):
            arch = getattr(cfg, "arch", type(model).__name__)
            raise GenerationError(f"text generation needs a decoder language model; this one is {arch!r}")
        if context_policy not in CONTEXT_POLICIES:
            raise GenerationError(
                f"context policy must be one of {', '.join(CONTEXT_POLICIES)}, got {context_policy!r}"
            )
        if compile and any(getattr(m, "kernel", None) == "fbgemm" for m in model.modules()):
            raise GenerationError("the quantized kernel 'fbgemm' cannot be compiled (torch.compile does not trace "
                                  "it): drop --compile, or quantize with another --kernel")
        self.max_seq_len = cfg.max_seq_len
        keep = slide_keep if slide_keep is not None else max(1, self.max_seq_len - max(1, self.max_seq_len // 4))
        if not 1 <= keep < self.max_seq_len:
            raise GenerationError(f"slide_keep must be in [1, {self.max_seq_len - 1}], got {keep}")
        self.model = model if device is None else model.to(device)
        self.model.eval()
        self.device = next(self.model.parameters()).device
        self.tokenizer = tokenizer
        self.vocab_size = cfg.vocab_size
        self.context_policy = context_policy
        self.slide_keep = keep
        self.eos_token_id: int | None = getattr(tokenizer, "eos_id", None)
        # Special tokens (BOS, PAD, a template's <|im_start|>, ...) are control symbols, not text: they
        # are generated and returned as ids but shown as nothing, like decode(skip_special_tokens=True).
        backend = getattr(tokenizer, "backend", None)
        self.hidden_token_ids = frozenset(
            i for i, t in (backend.get_added_tokens_decoder().items() if backend is not None else ()) if t.special
        )
        self._bytes: dict[int, bytes] = {}
        self.compile = compile
        self._steps: dict[bool, Callable[[Tensor, Tensor, Any, Tensor], Tensor]] = {}
        self.timings = GenerationTimings()  # of the last generate() / stream(), once it has finished

    @classmethod
    def from_run(cls, run_dir: Any, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                 verify: bool = True, **kwargs: Any) -> Generator:
        """Load the model and tokenizer of a run folder (weights checked against its manifest unless
        ``verify`` is False)."""
        from tinyformer.run_folder import load_model, load_tokenizer

        model = load_model(run_dir, device=device, dtype=dtype, verify=verify)
        if next(model.parameters()).device.type == "cpu":  # the model is this generator's alone
            store_input_major(model)
        return cls(model, load_tokenizer(run_dir), device, **kwargs)

    # ---------------------------------------------------------------- prompts and text

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt, checked: not empty and inside the model's vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise GenerationError("the prompt is empty")
            if self.tokenizer is None:
                raise GenerationError("a text prompt needs a tokenizer; pass token ids instead")
            # Only foreign tokenizers have a post-processor (e.g. a BOS prefix); the trained kinds add nothing.
            special = getattr(self.tokenizer, "kind", "hf") == "hf"
            try:
                ids = list(self.tokenizer.encode(prompt, add_special_tokens=special))
            except TinyformerError:
                raise
            except Exception as exc:  # the `tokenizers` backend raises bare Exceptions
                raise GenerationError(f"the tokenizer cannot encode the prompt: {exc}") from None
        else:
            ids = [int(i) for i in prompt]
        if not ids:
            raise GenerationError("the prompt is empty")
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise GenerationError(f"token id {bad} is outside the model's vocabulary (0 .. {self.vocab_size - 1})")
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of a token (memoised). Special tokens and ids the tokenizer does not know (a model
        vocabulary padded beyond the tokenizer's) stand for no text."""
        b = self._bytes.get(token_id)
        if b is None:
            b = b""
            if self.tokenizer is not None and token_id < self.tokenizer.vocab_size \
                    and token_id not in self.hidden_token_ids:
                try:
                    b = self.tokenizer.token_bytes(token_id)
                except Exception:  # a gap in a foreign vocabulary
                    b = b""
            self._bytes[token_id] = b
        return b

    # ---------------------------------------------------------------- public API

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], params: SamplingParams | None = None,
                 *, logprobs: bool = True) -> list[GenerationResult]:
        """Decode every prompt (as one left-padded batch); one result per prompt, in order.
        ``logprobs=False`` leaves ``GenerationResult.logprobs`` empty and saves the per-step
        log-normaliser over the vocabulary (greedy decoding is then a bare argmax)."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], int)):
            raise TypeError("generate() takes a list of prompts; wrap a single prompt in a list")
        params = (params or SamplingParams()).validate()
        rows = self._rows([self.encode(p) for p in prompts], params)
        for _ in self._decode(rows, params, logprobs):
            pass
        return [row.result() for row in rows]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               logprobs: bool = True) -> TextStream:
        """Decode one prompt, yielding text as soon as it is complete UTF-8 and cannot be part of a
        stop string. After the iterator is exhausted, ``.result`` holds the GenerationResult."""
        params = (params or SamplingParams()).validate()
        rows = self._rows([self.encode(prompt)], params)

        def pieces() -> Iterator[str]:
            for deltas in self._decode(rows, params, logprobs):
                if deltas[0]:
                    yield deltas[0]

        return TextStream(pieces(), rows[0])

    def beam_search(self, prompt: str | Sequence[int], num_beams: int, max_new_tokens: int,
                    length_penalty: float = DEFAULT_LENGTH_PENALTY, stop_token_ids: Sequence[int] = (), *,
                    early_stopping: EarlyStopping = DEFAULT_EARLY_STOPPING,
                    num_return_sequences: int = DEFAULT_NUM_RETURN_SEQUENCES) -> list[GenerationResult]:
        """The best ``num_return_sequences`` of ``num_beams`` hypotheses for ``prompt``, best first: HF
        ``generate(num_beams=..., do_sample=False)`` (see :mod:`tinyformer.generation.beam` for the score).
        EOS and ``stop_token_ids`` end a hypothesis; ``finish_reason`` is "stop" for one that ended so."""
        ids = self.encode(prompt)
        SamplingParams(max_new_tokens=max_new_tokens).validate()
        validate_beam_args(num_beams, length_penalty, early_stopping, num_return_sequences)
        self._check_fits(len(ids), max_new_tokens)
        ends = set(int(t) for t in stop_token_ids)
        if self.eos_token_id is not None:
            ends.add(self.eos_token_id)
        with torch.inference_mode():
            cache = self.model.new_cache(1, len(ids) + max_new_tokens)
            x = torch.tensor([ids], device=self.device)
            logits = check_finite(self.model(x, cache=cache, last_only=True)[:, -1], 0)

            def step(tokens: Tensor, cache: Any) -> Tensor:
                return self.model(tokens[:, None], cache=cache)[:, -1]

            hyps = beam_search(step, logits, cache, num_beams=num_beams, max_new_tokens=max_new_tokens,
                               eos_token_ids=sorted(ends), length_penalty=length_penalty,
                               early_stopping=early_stopping, num_return_sequences=num_return_sequences)[0]
        results = []
        for hyp in hyps:
            text = b"".join(self.token_bytes(i) for i in hyp.output_ids).decode("utf-8", errors="replace")
            results.append(GenerationResult(text, hyp.token_ids, hyp.token_logprobs, hyp.finish_reason, ids))
        return results

    # ---------------------------------------------------------------- decoding

    def _rows(self, prompts: list[list[int]], params: SamplingParams) -> list[_Row]:
        if not prompts:
            return []
        if params.stop_strings and self.tokenizer is None:
            raise GenerationError("stop strings need a tokenizer")
        ends = frozenset(int(t) for t in params.stop_token_ids) | (
            frozenset() if self.eos_token_id is None else frozenset([self.eos_token_id])
        )
        if self.context_policy == "error":
            self._check_fits(max(len(p) for p in prompts), params.max_new_tokens)
        return [_Row(p, params, self.token_bytes, ends) for p in prompts]

    def _check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        L = self.max_seq_len
        if prompt_len >= L:
            raise GenerationError(
                f"the prompt has {prompt_len} tokens but the model's context is {L} tokens "
                "(leaving no room to generate); shorten the prompt or use context policy 'slide'"
            )
        if prompt_len + max_new_tokens > L:
            raise GenerationError(
                f"the prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the model's "
                f"context of {L} tokens; ask for at most {L - prompt_len} new tokens or use context "
                "policy 'slide'"
            )

    def _decode(self, rows: list[_Row], params: SamplingParams, want_logprobs: bool = True) -> Iterator[list[str]]:
        """Run the batch to the end, yielding after every step the new text of each row."""
        if not rows:
            return
        budget = params.max_new_tokens
        if budget == 0:
            for row in rows:
                row.close("length")
            return
        L = self.max_seq_len
        B = len(rows)
        # under "slide" a prompt longer than the context keeps its last L tokens
        prompts = [r.prompt_ids[-L:] for r in rows]
        P = max(len(p) for p in prompts)
        width = P + budget
        dev = self.device
        # hist: the token columns, left padded with -1 (ignored by the penalties); seq: the same with
        # padding as token 0 (masked out, never seen)
        hist = torch.full((B, width), -1, dtype=torch.long)
        for b, p in enumerate(prompts):
            hist[b, P - len(p) : P] = torch.tensor(p)
        hist = hist.to(dev)
        seq = hist.clamp_min(0)
        # columns [0, pad_end) hold padding in some row; a window starting at or after it needs no mask
        pad_end = P - min(len(p) for p in prompts)
        mask = None
        if pad_end > 0:
            mask = torch.ones(B, width, dtype=torch.long, device=dev)
            mask[:, :P] = hist[:, :P] >= 0

        processors = build_processors(params)
        generators: list[torch.Generator | None] | None = None
        if params.seed is not None and not params.greedy:
            generators = [make_generator(dataclasses.replace(params, seed=(params.seed + b) % 2**64), dev)
                          for b in range(B)]

        def forward(start: int, stop: int) -> Tensor:
            """Feed columns [cache.length + start, stop) (the cache holds [start, ...)): next-token logits (B, V)."""
            fed = seq[:, start + cache.length : stop]
            window_mask = mask[:, start:stop] if mask is not None and start < pad_end else None
            return self.model(fed, attention_mask=window_mask, cache=cache, last_only=True)[:, -1]

        # dynamic NTK and LongRoPE pick their tables from the length seen, a host-side decision
        rs = self.model.cfg.rope_scaling or {}
        long_from = int(rs["original_max_position_embeddings"]) if self.model.cfg.rope_type == "longrope" else -1
        static = self.compile and width <= L and self.model.cfg.rope_type not in ("dynamic", "longrope")
        started = time.perf_counter()
        self.timings = GenerationTimings(prompt_tokens=P)
        with torch.inference_mode():
            if static:  # every row at its own positions; one compiled step per token
                # one slot more than the request needs: the attended span then never covers the whole
                # cache, a case the compiled step would specialise (compile again) for
                cache = self.model.new_cache(B, -(-(width + 1) // STATIC_CACHE_BLOCK) * STATIC_CACHE_BLOCK)
                logits = self._prefill_rows(prompts, cache)
                positions = torch.tensor([len(p) for p in prompts], device=dev)
            else:  # left-padded columns, the cache holding columns [start, ...)
                cache = self.model.new_cache(B, min(width, L))
                start = 0
                logits = forward(start, P)
            prefilled = time.perf_counter()
            self.timings.prefill_ms = (prefilled - started) * 1e3
            # greedy without log-probabilities needs only the argmax, which the compiled step then
            # computes itself (one fused reduction instead of a separate call over the logits)
            ids_only = params.greedy and not processors and not want_logprobs
            picked: Tensor | None = None
            for t in range(budget):
                c = P + t  # the column being sampled
                history = penalty_history(params, hist[:, :P], hist[:, P:c])
                if picked is None:  # the compiled greedy step returns ids only: its prefill logits were checked
                    check_finite(logits, t)
                if picked is not None:
                    tokens, logprobs = picked, None
                elif ids_only:
                    tokens, logprobs = logits.argmax(dim=-1), None
                else:
                    tokens, logprobs = self._sample(logits, params, history, generators, processors)
                seq[:, c] = tokens
                hist[:, c] = tokens
                lps = [None] * B if logprobs is None or not want_logprobs else logprobs.tolist()
                deltas = [row.accept(tok, lp) for row, tok, lp in zip(rows, tokens.tolist(), lps)]
                self.timings.completion_tokens = t + 1
                if t:
                    self.timings.decode_tokens_per_s = t / max(time.perf_counter() - prefilled, 1e-9)
                yield deltas
                if t == budget - 1 or all(row.finish_reason is not None for row in rows):
                    break
                if static:
                    step = self._compiled_step(ids_only)
                    # the slots [0, c + 1) hold every row's tokens so far: the span to attend over, passed
                    # as the length of a tensor whose size the compiled step treats as symbolic
                    span = torch.empty(c + 1, device=dev)
                    torch._dynamo.maybe_mark_dynamic(span, 0)
                    if t < 2:  # Dynamo checks its guards (and compiles a new shape) as usual
                        out = step(tokens[:, None], positions, cache, span)
                    else:
                        # From the second step on, every step's inputs come from the same place (the
                        # previous step) with the same shapes, strides and dtypes; only values change, so
                        # the guards would pass: skipping their check saves 2-3% of a step (hundreds of
                        # tensor checks, one per parameter). The stance is process-wide, like Dynamo's
                        # other settings: it holds for this one call only.
                        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                            out = step(tokens[:, None], positions, cache, span)
                    picked, logits = (out, logits) if ids_only else (None, out)
                    positions += 1
                    continue
                if c - start == cache.max_len:  # full: keep the last slide_keep tokens and prefill again
                    start = c + 1 - self.slide_keep
                    cache.reset()
                elif c - start == long_from:
                    # LongRoPE: the sequence now outgrows the original context, so every position takes the
                    # long factors; the cached keys were rotated with the short ones: prefill again, as
                    # transformers' Phi-3 does
                    cache.reset()
                logits = forward(start, c + 1)
        yield [row.close("length") for row in rows]

    def _prefill_rows(self, prompts: list[list[int]], cache: Any) -> Tensor:
        """Prefill row b of ``cache`` with prompt b at positions 0 .. len-1 (no padding): logits (B, V)."""
        if len({len(p) for p in prompts}) == 1:
            x = torch.tensor(prompts, device=self.device)
            return self.model(x, cache=cache, last_only=True)[:, -1]
        return torch.cat([self.model(torch.tensor([p], device=self.device), cache=cache.row_view(b),
                                     last_only=True)[:, -1] for b, p in enumerate(prompts)])

    def _static_step(self, tokens: Tensor, positions: Tensor, cache: Any, span: Tensor) -> Tensor:
        """One token per row at ``positions`` (B,), attending over cache slots [0, len(span)) (masked per
        row): logits (B, V). Every shape but that span's depends on the batch size and cache length only,
        and the span's is symbolic, so one compiled graph serves every step of a request."""
        return self.model(tokens, cache=cache, cache_positions=positions, kv_len=span.shape[0])[:, -1]

    def _static_greedy_step(self, tokens: Tensor, positions: Tensor, cache: Any, span: Tensor) -> Tensor:
        """``_static_step`` followed by the argmax: the next token ids (B,)."""
        return self._static_step(tokens, positions, cache, span).argmax(dim=-1)

    def _compiled_step(self, ids_only: bool) -> Callable[[Tensor, Tensor, Any, Tensor], Tensor]:
        """The compiled static step: next-token ids if ``ids_only`` (greedy), else logits."""
        if ids_only not in self._steps:
            options = {}
            if self.device.type == "cpu":
                # The C++ wrapper removes the Python call overhead of the generated kernels, which is
                # most of what a small model's decode step costs.
                options["cpp_wrapper"] = True
                store_input_major(self.model)
            step = self._static_greedy_step if ids_only else self._static_step
            self._steps[ids_only] = torch.compile(step, fullgraph=True, dynamic=False, options=options)
        return self._steps[ids_only]

    @staticmethod
    def _sample(logits: Tensor, params: SamplingParams, history: PenaltyHistory | None,
                generators: list[torch.Generator | None] | None,
                processors: list[LogitsProcessor]) -> tuple[Tensor, Tensor]:
        if generators is None:
            return sample_next(logits, params, history, None, processors=processors)
        # seeded sampling: each row draws from its own generator, so a row's random numbers do not
        # depend on which other rows share the batch
        picks = [sample_next(logits[b : b + 1], params, None if history is None else history[b : b + 1], g,
                             processors=processors) for b, g in enumerate(generators)]
        return torch.cat([p[0] for p in picks]), torch.cat([p[1] for p in picks])
