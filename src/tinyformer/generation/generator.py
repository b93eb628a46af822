"""Text generation for a decoder LM: prompts in, tokens and text out.

:class:`Generator` turns prompts (text or ids) into rows of a
:class:`~tinyformer.generation.engine.BatchEngine`, the one decoding loop every entry point shares (its
module docstring says how rows are prefilled, decoded, sampled and slid). Each row sits at its own cache
positions (no padding), so greedy decoding of a batch gives the same tokens as decoding each prompt alone;
for sampling, row ``b`` draws from its own generator seeded with ``seed + b``, so row ``b`` of a batch
equals the prompt decoded alone with seed ``seed + b``.

Stopping, per row: the end-of-sequence token, any of ``params.stop_token_ids``, a stop string (even
one spread over several tokens; it is never shown), or ``max_new_tokens``. Text is produced
incrementally from each token's raw bytes (``Tokenizer.token_bytes``), so a stream never shows half
a UTF-8 character.

Context overflow never passes silently: ``context_policy="error"`` refuses a request whose prompt plus
``max_new_tokens`` does not fit ``max_seq_len``; ``"slide"`` keeps going (the engine slides a full row).
Beam search (``Generator.beam_search``) runs on the same engine, its rows' tokens picked by the search of
:mod:`tinyformer.generation.beam` instead of sampled; ``num_beams=1`` is greedy search.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tinyformer.errors import GenerationError, TinyformerError
from tinyformer.generation.beam import (
    DEFAULT_EARLY_STOPPING,
    DEFAULT_LENGTH_PENALTY,
    DEFAULT_NUM_RETURN_SEQUENCES,
    EarlyStopping,
    new_search,
    validate_beam_args,
)
from tinyformer.generation.compile_cache import PackageBuild, compiled_step
from tinyformer.generation.constraint import Matcher, TokenVocabulary
from tinyformer.generation.engine import (
    LENGTH_DEPENDENT_ROPE,
    BatchEngine,
    CompiledStep,
    EngineRow,
    check_compilable,
    check_speculative,
    default_slide_keep,
)
from tinyformer.generation.prefix_cache import PrefixCache
from tinyformer.generation.sampling import SamplingParams
from tinyformer.generation.speculative import SpeculativeConfig
from tinyformer.generation.streaming import TextState, TokenBytes
from tinyformer.generation.weight_layout import load_for_decoding

__all__ = ["CONTEXT_POLICIES", "GenerationResult", "GenerationTimings", "Generator", "TextStream"]

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
    "stop" (EOS, stop token or stop string) or "length" (``max_new_tokens``). ``complete``: with a
    ``params.constraint``, whether the text is a whole sentence of its language (False: the budget ran out
    first, and the text is only a prefix); None without a constraint.
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_token_ids: list[int] = field(default_factory=list)
    complete: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"text": self.text, "token_ids": self.token_ids, "logprobs": self.logprobs,
               "finish_reason": self.finish_reason}
        if self.complete is not None:
            out["complete"] = self.complete
        return out


@dataclass
class GenerationTimings:
    """Wall-clock cost of the last request, as llama.cpp reports it: ``prefill_ms`` for the forward pass over the
    prompt (``prompt_tokens`` of the longest row), then ``decode_tokens_per_s`` = decode steps / their time,
    where the steps are the forward passes after the prefill (``completion_tokens`` - 1: the first new token
    comes from the prefill's logits) and their time runs from the end of the prefill to the last token
    (sampling and any context slide included). ``completion_tokens`` counts the longest row's tokens.
    With speculative decoding, ``draft_proposed`` counts the draft tokens verified and ``draft_accepted``
    those kept, over every row (None without speculation)."""

    prompt_tokens: int = 0
    prefill_ms: float = 0.0
    completion_tokens: int = 0
    decode_tokens_per_s: float = 0.0
    draft_proposed: int | None = None
    draft_accepted: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"prompt_tokens": self.prompt_tokens, "prefill_ms": round(self.prefill_ms, 3),
               "completion_tokens": self.completion_tokens,
               "decode_tokens_per_s": round(self.decode_tokens_per_s, 3)}
        if self.draft_proposed is not None:
            out.update(draft_proposed=self.draft_proposed, draft_accepted=self.draft_accepted)
        return out


class TextStream(Iterator[str]):
    """Iterator over the text pieces of one generation; ``result`` holds the full
    :class:`GenerationResult` once the iterator is exhausted."""

    def __init__(self, pieces: Iterator[str], row: EngineRow) -> None:
        self._pieces = pieces
        self._row = row

    def __next__(self) -> str:
        return next(self._pieces)

    @property
    def result(self) -> GenerationResult:
        if self._row.finish_reason is None:
            raise RuntimeError("the stream has not finished yet")
        return _result(self._row)


def _result(row: EngineRow) -> GenerationResult:
    complete = None if row.constraint is None else row.constraint.accepting
    return GenerationResult(row.text.text, row.token_ids, row.logprobs, row.finish_reason or "length", row.prompt_ids,
                            complete)


def check_draft(model: nn.Module, tokenizer: Any, draft: nn.Module, draft_tokenizer: Any) -> None:
    """GenerationError unless ``draft`` can propose tokens for ``model``: a decoder of the same vocabulary size
    with the same tokenizer (no tokenizer given for either: the vocabulary sizes alone are compared): drafts are
    token ids, so both tokenizers must mean the same text by every id."""
    def fingerprint(tok: Any) -> object:
        # the id of every token (the merges follow from the vocabulary for the BPE kinds) and the end token
        backend = getattr(tok, "backend", None)
        vocab = backend.get_vocab(with_added_tokens=True) if backend is not None else None
        return vocab, getattr(tok, "eos_id", None)

    dcfg = getattr(draft, "cfg", None)
    if dcfg is None or dcfg.arch != "decoder" or not hasattr(draft, "new_cache"):
        raise GenerationError("the draft model must be a decoder language model")
    if dcfg.vocab_size != model.cfg.vocab_size:
        raise GenerationError(f"the draft model's vocabulary has {dcfg.vocab_size} tokens, the model's "
                              f"{model.cfg.vocab_size}: a draft model must share the model's tokenizer")
    if dcfg.rope_type in LENGTH_DEPENDENT_ROPE:
        raise GenerationError("a draft model with dynamic-NTK or LongRoPE positions is not supported")
    if (tokenizer is None) != (draft_tokenizer is None):
        raise GenerationError("a draft model needs tokenizers for both models, to check that they agree")
    if tokenizer is not None and fingerprint(tokenizer) != fingerprint(draft_tokenizer):
        raise GenerationError("the draft model's tokenizer differs from the model's: a draft model must share "
                              "the model's tokenizer")


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

    ``compile`` (True, or a :class:`~tinyformer.generation.compile_cache.PackageBuild`) decodes with the
    compiled step of :func:`~tinyformer.generation.compile_cache.compiled_step` (see :meth:`_decode` for the
    cache length); requests that would slide their context, and dynamic-NTK and LongRoPE models, are
    decoded eagerly. On CPU the model's linear
    layers are laid out for decoding first (:func:`~tinyformer.generation.weight_layout.prepare_for_decoding`).

    ``prefix_cache`` (a :class:`~tinyformer.generation.prefix_cache.PrefixCache`) is kept across requests:
    each prompt starts from the longest cached prefix of whole blocks, and each finished sequence stores
    its blocks, so the next turn of a chat prefills only what is new.

    ``speculative`` (a :class:`~tinyformer.generation.speculative.SpeculativeConfig`) decodes with drafts
    verified K at a time: prompt lookup ("ngram"), or ``draft_model`` ("draft", a smaller model with the same
    tokenizer, ``draft_tokenizer`` to check it). Greedy output is the plain greedy output, sampled output
    follows the same distribution; beam search does not speculate.
    """

    def __init__(self, model: nn.Module, tokenizer: Any = None, device: torch.device | str | None = None, *,
                 context_policy: str = "error", slide_keep: int | None = None, compile: bool | PackageBuild = False,
                 prefix_cache: PrefixCache | None = None, speculative: SpeculativeConfig | None = None,
                 draft_model: nn.Module | None = None, draft_tokenizer: Any = None) -> None:
        cfg = getattr(model, "cfg", None)
        if cfg is None or cfg.arch != "decoder" or not hasattr(model, "new_cache"):
            arch = getattr(cfg, "arch", type(model).__name__)
            raise GenerationError(f"text generation needs a decoder language model; this one is {arch!r}")
        if context_policy not in CONTEXT_POLICIES:
            raise GenerationError(f"context policy must be one of {', '.join(CONTEXT_POLICIES)}, "
                                  f"got {context_policy!r}")
        if compile:
            check_compilable(model)
        if speculative is not None:
            check_speculative(speculative, cfg, draft_model is not None, speculative.draft_tokens)
            if speculative.method == "draft":
                check_draft(model, tokenizer, draft_model, draft_tokenizer)
        elif draft_model is not None:
            raise GenerationError("a draft model is used by speculative method 'draft' only")
        self.speculative = speculative
        self.draft_model = draft_model if speculative is not None and speculative.method == "draft" else None
        if self.draft_model is not None:
            self.draft_model.eval()
        self.max_seq_len = cfg.max_seq_len
        keep = slide_keep if slide_keep is not None else default_slide_keep(self.max_seq_len)
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
        # token_bytes(id): a token's bytes as shown in text (memoised); special tokens are generated and returned
        # as ids but stand for no text, as do ids the tokenizer does not know (streaming.TokenBytes)
        self.token_bytes = TokenBytes(tokenizer)
        self.compile = compile
        self._compiled: CompiledStep | None = None
        self.prefix_cache = prefix_cache
        self.timings = GenerationTimings()  # of the last generate() / stream(), once it has finished

    @classmethod
    def from_run(cls, run_dir: Any, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                 verify: bool = True, draft_run: Any = None, **kwargs: Any) -> Generator:
        """Load the model and tokenizer of a run folder (weights checked against its manifest unless
        ``verify`` is False); ``draft_run``, the run folder of a draft model (``speculative`` method "draft")."""
        from tinyformer.run_folder import load_tokenizer

        model = load_for_decoding(run_dir, device, dtype, verify)  # the model is this generator's alone
        if draft_run is not None:
            draft = load_for_decoding(draft_run, device, dtype, verify)
            kwargs.update(draft_model=draft, draft_tokenizer=load_tokenizer(draft_run))
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

    # ---------------------------------------------------------------- public API

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], params: SamplingParams | None = None,
                 *, logprobs: bool = True, sampled_logprobs: bool = False) -> list[GenerationResult]:
        """Decode every prompt (as one left-padded batch); one result per prompt, in order.
        ``logprobs=False`` leaves ``GenerationResult.logprobs`` empty and saves the per-step
        log-normaliser over the vocabulary (greedy decoding is then a bare argmax). ``sampled_logprobs``
        gives each token's log-probability under the distribution it was drawn from (e.g. softmax(logits / T))
        instead of the raw one."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], int)):
            raise TypeError("generate() takes a list of prompts; wrap a single prompt in a list")
        params = (params or SamplingParams()).validate()
        rows = self._rows([self.encode(p) for p in prompts], params, logprobs, sampled_logprobs)
        for _ in self._decode(rows):
            pass
        return [_result(row) for row in rows]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               logprobs: bool = True) -> TextStream:
        """Decode one prompt, yielding text as soon as it is complete UTF-8 and cannot be part of a
        stop string. After the iterator is exhausted, ``.result`` holds the GenerationResult."""
        params = (params or SamplingParams()).validate()
        rows = self._rows([self.encode(prompt)], params, logprobs)

        def pieces() -> Iterator[str]:
            for deltas in self._decode(rows):
                if deltas[0]:
                    yield deltas[0]

        return TextStream(pieces(), rows[0])

    def beam_search(self, prompt: str | Sequence[int], num_beams: int, max_new_tokens: int,
                    length_penalty: float = DEFAULT_LENGTH_PENALTY, stop_token_ids: Sequence[int] = (), *,
                    early_stopping: EarlyStopping = DEFAULT_EARLY_STOPPING,
                    num_return_sequences: int = DEFAULT_NUM_RETURN_SEQUENCES) -> list[GenerationResult]:
        """The best ``num_return_sequences`` of ``num_beams`` hypotheses for ``prompt``, best first: HF
        ``generate(num_beams=..., do_sample=False)`` (see :mod:`tinyformer.generation.beam` for the score;
        ``num_beams=1`` is greedy search). EOS and ``stop_token_ids`` end a hypothesis; ``finish_reason`` is
        "stop" for one that ended so."""
        if self.speculative is not None:
            raise GenerationError("speculative decoding does not apply to beam search: drop --speculative or "
                                  "--num-beams")
        ids = self.encode(prompt)
        params = SamplingParams(max_new_tokens=max_new_tokens).validate()
        validate_beam_args(num_beams, length_penalty, early_stopping, num_return_sequences)
        self._check_fits(len(ids), max_new_tokens)
        ends = self._ends(stop_token_ids)
        if max_new_tokens == 0:
            return []
        # K rows of the prompt, prefilled once (BatchEngine.add_group), whose tokens the search picks
        search = new_search(1, num_beams, max_new_tokens, sorted(ends), length_penalty, early_stopping)
        rows = [EngineRow(ids, params, TextState(self.token_bytes, ends), search=search) for _ in range(num_beams)]
        for _ in self._decode(rows):
            pass
        return [GenerationResult(b"".join(map(self.token_bytes, hyp.output_ids)).decode("utf-8", errors="replace"),
                                 hyp.token_ids, hyp.token_logprobs, hyp.finish_reason, ids)
                for hyp in search.results(num_return_sequences)[0]]

    # ---------------------------------------------------------------- decoding

    def _rows(self, prompts: list[list[int]], params: SamplingParams, want_logprobs: bool = True,
              sampled_logprobs: bool = False) -> list[EngineRow]:
        """One engine row per prompt; with a seed, row b samples with seed + b (so it equals that prompt
        decoded alone with seed + b)."""
        if not prompts:
            return []
        if params.stop_strings and self.tokenizer is None:
            raise GenerationError("stop strings need a tokenizer")
        ends = self._ends(params.stop_token_ids)
        if self.context_policy == "error":
            self._check_fits(max(len(p) for p in prompts), params.max_new_tokens)
        vocab = None
        if params.constraint is not None:
            if self.tokenizer is None:
                raise GenerationError("structured output needs a tokenizer (each token's bytes)")
            vocab = TokenVocabulary.of(self.tokenizer, self.vocab_size, ends)
        rows = []
        for b, p in enumerate(prompts):
            row_params = dataclasses.replace(params, seed=(params.seed + b) % 2**64) if params.seed is not None and b \
                else params
            matcher = Matcher(params.constraint, vocab) if vocab is not None else None
            rows.append(EngineRow(p, row_params, TextState(self.token_bytes, ends, params.stop_strings),
                                  want_logprobs=want_logprobs, speculative=self.speculative, constraint=matcher,
                                  sampled_logprobs=sampled_logprobs))
        return rows

    def _ends(self, stop_token_ids: Sequence[int]) -> frozenset[int]:
        """The token ids that end a sequence: ``stop_token_ids`` and the end-of-sequence token."""
        ends = frozenset(int(t) for t in stop_token_ids)
        return ends if self.eos_token_id is None else ends | {self.eos_token_id}

    def _check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        L = self.max_seq_len
        if prompt_len >= L:
            raise GenerationError(f"the prompt has {prompt_len} tokens but the model's context is {L} tokens "
                                  "(leaving no room to generate); shorten the prompt or use context policy 'slide'")
        if prompt_len + max_new_tokens > L:
            raise GenerationError(f"the prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) exceeds "
                                  f"the model's context of {L} tokens; ask for at most {L - prompt_len} new tokens "
                                  "or use context policy 'slide'")

    def _decode(self, rows: list[EngineRow]) -> Iterator[list[str]]:
        """Run the rows to the end on one :class:`BatchEngine`, yielding after every step the new text of
        each row. With ``compile`` the cache length is rounded up to a multiple of ``STATIC_CACHE_BLOCK``
        (one slot more than the request needs: the attended span then never covers the whole cache, a case
        the compiled step would specialise for), so requests of similar lengths share one compiled step."""
        if not rows:
            return
        budget = rows[0].params.max_new_tokens
        if budget == 0:
            for row in rows:
                row.text.close()
                row.finish_reason = "length"
            return
        L = self.max_seq_len
        P = min(L, max(len(r.prompt_ids) for r in rows))
        width = P + budget
        static = self.compile and width <= L
        if static and self._compiled is None:
            self._compiled = compiled_step(self.model, self.compile)
        max_len = -(-(width + 1) // STATIC_CACHE_BLOCK) * STATIC_CACHE_BLOCK if static else min(width, L)
        engine = BatchEngine(self.model, max_batch=len(rows), max_len=max_len,
                             compiled=self._compiled if static else None, context_policy=self.context_policy,
                             slide_keep=self.slide_keep, prefix_cache=self.prefix_cache,
                             max_draft_tokens=0 if self.speculative is None else self.speculative.draft_tokens,
                             draft_model=self.draft_model)
        # runs of rows with the same prompt (n samples of one prompt) prefill it once (BatchEngine.add_group)
        for _, group in itertools.groupby(rows, key=lambda r: r.prompt_ids):
            engine.add_group(list(group))
        index = {id(r): b for b, r in enumerate(rows)}
        started = time.perf_counter()
        self.timings = GenerationTimings(prompt_tokens=P)
        prefilled = started
        with torch.inference_mode(), contextlib.ExitStack() as stack:
            # rows still held when decoding stops early (an error, a stream left unfinished) release their
            # prefix-cache blocks
            stack.callback(lambda: [engine.remove(r) for r in list(engine.rows)])
            for outs in engine.run():
                deltas = [""] * len(rows)
                for o in outs:
                    deltas[index[id(o.row)]] = o.text
                n = max(len(r.token_ids) for r in rows)
                if self.timings.completion_tokens == 0:
                    prefilled = time.perf_counter()
                    self.timings.prefill_ms = (prefilled - started) * 1e3
                elif n > 1:
                    self.timings.decode_tokens_per_s = (n - 1) / max(time.perf_counter() - prefilled, 1e-9)
                self.timings.completion_tokens = n
                if self.speculative is not None:
                    self.timings.draft_proposed = sum(r.drafts.proposed for r in rows if r.drafts is not None)
                    self.timings.draft_accepted = sum(r.drafts.accepted for r in rows if r.drafts is not None)
                yield deltas
