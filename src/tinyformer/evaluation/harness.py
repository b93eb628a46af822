"""tinyformer as an lm-evaluation-harness model: ``--model tinyformer --model_args run=RUN``.

lm-eval asks a model for three things; here each is tinyformer code:

    loglikelihood(context, continuation)  -> (sum log p(continuation | context), is_greedy)
        lm-eval's TemplateLM tokenises the pair; :func:`~tinyformer.evaluation.scoring.score_continuations`
        scores batches with each shared context encoded once (KV cache) and the LM head run only on
        scored positions. Inputs longer than ``max_length + 1`` keep their last tokens, as the hf backend.
    loglikelihood_rolling(text)            -> sum log p(text)
        the text is cut into lm-eval's disjoint rolling windows of ``max_length`` predicted tokens
        (the first conditioned on ``prefix_token_id``), each window scored as above, summed.
    generate_until(context, gen_kwargs)    -> text
        :class:`~tinyformer.generation.generator.Generator` (batched, KV-cached; drawn by the one sampler,
        :func:`~tinyformer.generation.sampling.sample`: greedy unless ``do_sample``),
        the context left-cut to ``max_length - max_gen_toks`` tokens, the text cut at the first stop string.

lm-eval 0.4 finds models only in its own table or by import (it reads no entry points), so the model
is registered when this module is imported: ``tinyformer eval --harness TASKS`` does that, and
``python -m tinyformer.evaluation.harness run --model tinyformer --model_args run=RUN --tasks ...``
is lm-eval's own command line with the model registered. Local task YAMLs (``--include-path``) with
local JSONL data need no network.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm.auto import tqdm

from tinyformer.errors import ConfigError

__all__ = ["TinyformerLM", "run_harness"]

DEFAULT_BATCH_SIZE = 8
# lm-eval passes these to every model; a single-process CPU/GPU model has no use for them
_IGNORED_ARGS = ("max_batch_size",)


def _positive_int(name: str, value: Any) -> int:
    """An integer model argument (lm-eval passes them as strings from ``--model_args``)."""
    ok = isinstance(value, int) and not isinstance(value, bool) or isinstance(value, str) and value.strip().isdigit()
    if not ok or int(value) < 1:
        raise ConfigError(f"tinyformer model argument {name} must be a positive integer, got {value!r}")
    return int(value)


@register_model("tinyformer")
class TinyformerLM(TemplateLM):
    """An lm-eval model over a tinyformer run folder (``run``), or over a model and tokenizer already
    in memory (``model=..., tokenizer=...``)."""

    def __init__(self, run: str | None = None, batch_size: int | str = DEFAULT_BATCH_SIZE,
                 max_length: int | str | None = None, max_gen_toks: int | str = 256, device: str | None = "auto",
                 dtype: str | None = None, model: Any = None, tokenizer: Any = None, **kwargs: Any) -> None:
        super().__init__()
        from tinyformer.devices import parse_dtype, resolve_device
        from tinyformer.generation.generator import Generator

        unknown = sorted(set(kwargs) - set(_IGNORED_ARGS))
        if unknown:
            raise ConfigError(f"unknown tinyformer model argument(s): {', '.join(unknown)} "
                              "(known: run, batch_size, max_length, max_gen_toks, device, dtype)")
        if model is None:
            if run is None:
                raise ConfigError("the tinyformer lm-eval model needs run=RUN (a run folder)")
            gen = Generator.from_run(Path(run), device=resolve_device(device or "auto"), dtype=parse_dtype(dtype))
        else:
            gen = Generator(model, tokenizer)
        if gen.tokenizer is None:
            raise ConfigError("the tinyformer lm-eval model needs a tokenizer")
        self.generator = gen
        self.model = gen.model
        self.tokenizer = gen.tokenizer
        self._device = gen.device
        self.batch_size = DEFAULT_BATCH_SIZE if str(batch_size) == "auto" else _positive_int("batch_size",
                                                                                             batch_size)
        cap = self.model.cfg.max_seq_len
        self._max_length = cap if max_length is None else _positive_int("max_length", max_length)
        if self._max_length > cap and self.model.cfg.rope_type != "dynamic":
            raise ConfigError(f"max_length {self._max_length} is beyond the model's context of {cap} tokens")
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)

    # ---------------------------------------------------------------- tokens

    @property
    def eot_token_id(self) -> int:
        if self.tokenizer.eos_id is None:
            raise ConfigError("the run's tokenizer has no end-of-sequence token, which lm-eval needs")
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        # conditions an empty context and the first rolling window: BOS if there is one, else EOS (as hf)
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        # None: the tokenizer's own post-processor applies (a BOS prefix in some), as transformers does
        return list(self.tokenizer.encode(string, add_special_tokens=True if add_special_tokens is None
                                          else add_special_tokens))

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # ---------------------------------------------------------------- the three requests

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        from tinyformer.evaluation.scoring import score_continuations

        scores = score_continuations(self.model, [(ctx, cont) for _, ctx, cont in requests],
                                     batch_size=self.batch_size, max_length=self.max_length,
                                     progress=not disable_tqdm)
        out = []
        for (key, _, _), s in zip(requests, scores):
            answer = (s.logprob, s.is_greedy)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows: list[tuple[None, list[int], list[int]]] = []
        owner: list[int] = []
        for i, req in enumerate(requests):
            (text,) = req.args
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[i] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        from tinyformer.generation.sampling import GREEDY_TEMPERATURE, SamplingParams

        eos = self.tokenizer.decode([self.eot_token_id]) if self.tokenizer.eos_id is not None else None
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out = [""] * len(requests)
        bar = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            room = self.max_length - max_gen
            if room < 1:
                raise ConfigError(f"max_gen_toks {max_gen} leaves no room for a context in max_length "
                                  f"{self.max_length}")
            sample = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 0.0)) > 0
            params = SamplingParams(temperature=float(kwargs["temperature"]) if sample else GREEDY_TEMPERATURE,
                                    top_p=float(kwargs.get("top_p") or 1.0) if sample else 1.0,
                                    top_k=int(kwargs.get("top_k") or 0) if sample else 0,
                                    max_new_tokens=max_gen, stop_strings=[s for s in until if s and s != eos])
            # longest first: rows of a batch have similar lengths
            members = sorted(members, key=lambda i: -len(requests[i].args[0]))
            for j in range(0, len(members), self.batch_size):
                part = members[j : j + self.batch_size]
                prompts = [self.tok_encode(requests[i].args[0])[-room:] or [self.prefix_token_id] for i in part]
                for i, res in zip(part, self.generator.generate(prompts, params, logprobs=False)):
                    text = postprocess_generated_text(res.text, until, None)
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(part))
        bar.close()
        return out


def run_harness(run: str | Path, tasks: Sequence[str], *, include_path: str | Path | None = None,
                batch_size: int = DEFAULT_BATCH_SIZE, limit: int | None = None, num_fewshot: int | None = None,
                max_length: int | None = None, device: str = "auto", dtype: str | None = None,
                seed: int = 1234) -> dict[str, Any]:
    """Run lm-eval ``tasks`` on the model of ``run``; ``include_path`` adds a folder of task YAMLs.
    Returns lm-eval's results, ``{task: {"acc,none": ..., "acc_stderr,none": ..., ...}}``."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(f"--include-path {include_path} is not a folder")
    manager = None
    if include_path is not None:  # indexing lm-eval's own ~15k tasks takes seconds: skip it when not needed
        manager = TaskManager(include_path=str(include_path), include_defaults=False)
        if not set(tasks) <= set(manager.all_tasks):
            manager = None
    if manager is None:
        manager = TaskManager(include_path=str(include_path) if include_path is not None else None)
    known = set(manager.all_tasks)
    missing = [t for t in tasks if t not in known]
    if missing:
        where = f" (or in {include_path})" if include_path is not None else " (add --include-path DIR for your own)"
        raise ConfigError(f"unknown lm-eval task(s): {', '.join(missing)}: not among lm-eval's tasks{where}")
    lm = TinyformerLM(run=str(run), batch_size=batch_size, max_length=max_length, device=device, dtype=dtype)
    out = simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                          log_samples=False, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                          fewshot_random_seed=seed)
    return {name: {k: v for k, v in metrics.items() if k != "alias"} for name, metrics in out["results"].items()}


if __name__ == "__main__":  # lm-eval's command line, with the tinyformer model registered
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
