"""Helpers shared by the subcommands: loading a model config from a preset, file or run folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tinyformer.config import ModelConfig
from tinyformer.config_files import read_structured_file


def load_model_config(path: str | Path) -> ModelConfig:
    """A ModelConfig from a run folder, a config.json, or a YAML/TOML/JSON file whose fields are at the
    top level or under a ``model:`` key (which may name a ``preset`` plus overrides)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    data = read_structured_file(p)
    if isinstance(data.get("model"), dict):
        data = data["model"]
    data = dict(data)
    preset = data.pop("preset", None)
    if preset is not None:
        from tinyformer.presets import get_preset

        return get_preset(preset, **data)
    return ModelConfig.from_dict(data)


def format_count(n: float) -> str:
    """``n`` with a K / M / B / T suffix and two decimals (124.44M), as ``count`` and ``train`` print sizes."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def read_prompt(args: Any, stdin: bool = False) -> str:
    """``--prompt``, or the text of ``--prompt-file`` (UTF-8, read in text mode; with ``stdin``, ``-`` reads
    standard input); a missing, undecodable or empty prompt is a one-line GenerationError."""
    from tinyformer.errors import GenerationError

    if args.prompt is not None:
        text = args.prompt
    elif stdin and args.prompt_file == "-":
        text = sys.stdin.read()
    else:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise GenerationError(f"prompt file {path} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise GenerationError(f"prompt file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not text:
        raise GenerationError("the prompt is empty")
    return text


def add_no_verify_flag(p: Any) -> None:
    """``--no-verify`` of every command that loads a run's weights (see integrity.py)."""
    p.add_argument("--no-verify", action="store_true",
                   help="load the weights without checking them against the run's manifest.json checksums")


def compile_notice(what: str) -> str:
    """The line a command prints to stderr before ``torch.compile`` builds ``what`` (the first call waits
    for it): how long, and where inductor caches the result for the next process."""
    import getpass
    import os
    import tempfile

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "user"
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(Path(tempfile.gettempdir()) / f"torchinductor_{user}")
    return (f"tinyformer: --compile: torch.compile builds {what} at the first step (tens of seconds; the kernels are "
            f"cached in {cache}, so later runs start faster) ...")


def add_decoding_args(p: Any, compile_what: str) -> None:
    """The flags of every command that decodes with a run's model (generate, chat, serve): the run and how it
    is loaded, ``--compile`` / ``--no-compile`` (by default the compiled step where one is built, and a
    background build of it otherwise, see :mod:`tinyformer.generation.compile_cache`; ``compile_what``: what
    is compiled), the chat template's ``--template-timeout`` and speculative decoding
    (``generation/speculative.py``)."""
    from tinyformer.data.chat_template import DEFAULT_MAX_CHARS, DEFAULT_TIMEOUT_S
    from tinyformer.generation.speculative import DEFAULT_DRAFT_TOKENS, METHODS

    p.add_argument("--model", required=True, metavar="RUN", help="run folder (config.json, weights, tokenizer.json)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, mps (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations (default: float32 on CPU, bfloat16 on GPU, float16 where the GPU "
                        "has no bfloat16)")
    add_no_verify_flag(p)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help=f"decode with {compile_what}, compiled now where it is missing (on a CPU it needs a C++ "
                        "compiler; a model's first compile takes minutes, later runs load it in milliseconds); "
                        "--no-compile decodes eagerly (the code as written). Default: the compiled step where it was "
                        "built before, otherwise eagerly while a background process builds it for the next run; "
                        "TINYFORMER_COMPILE=0 makes eager the default, =1 --compile")
    p.add_argument("--template-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"stop rendering the model's chat template after this long (default {DEFAULT_TIMEOUT_S:g}; "
                        f"its output is limited to {DEFAULT_MAX_CHARS:,} characters)")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative", choices=METHODS, default=None,
                   help="propose tokens and verify them in one forward: 'ngram' looks them up in the prompt and "
                        "output (prompt lookup), 'draft' asks --draft-model; greedy output stays the same, sampled "
                        "output follows the same distribution (default: off)")
    g.add_argument("--draft-model", default=None, metavar="RUN",
                   help="run folder of a smaller model with the same tokenizer (implies --speculative draft)")
    g.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                   help=f"tokens proposed per step at most (default {DEFAULT_DRAFT_TOKENS})")


def decide_compile(flag: bool | None, model: Any, what: str = "the decode step", *,
                   run_dir: Any, dtype: Any) -> Any:  # -> bool | PackageBuild
    """Resolve ``--compile`` for ``model`` loaded from ``run_dir`` in ``dtype``
    (:func:`~tinyformer.generation.compile_cache.resolve_compile`) into the ``compile`` argument of
    ``Generator`` and ``Scheduler``: False (eager), True (the ``torch.compile``-d step of a GPU) or a
    :class:`~tinyformer.generation.compile_cache.PackageBuild` (a CPU's packaged step, built in the background
    by default). Prints the one-line notices on stderr: why the command decodes eagerly, or that a step is
    being compiled."""
    import functools

    from tinyformer.generation.compile_cache import PackageBuild, resolve_compile, use_compile_cache

    say = functools.partial(print, file=sys.stderr, flush=True)
    how, notice = resolve_compile(flag, model)
    if notice:
        say(notice)
    if how == "eager":
        return False
    if next(model.parameters()).device.type == "cpu":
        if how == "background":
            return PackageBuild(notice=say, background_run=str(run_dir), dtype=str(dtype).removeprefix("torch."))
        return PackageBuild(notice=say)
    folder, seen = use_compile_cache(model)
    if not seen:
        say(f"tinyformer: compiling {what} for this model, once (tens of seconds to minutes; the kernels are "
            f"cached in {folder} for later runs; --no-compile skips this) ...")
    return True


def template_timeout(args: Any) -> float:
    """``--template-timeout``, checked: a positive, finite number of seconds."""
    import math

    if not (math.isfinite(args.template_timeout) and args.template_timeout > 0):
        from tinyformer.errors import ConfigError

        raise ConfigError(f"--template-timeout must be a positive number of seconds, got {args.template_timeout}")
    return float(args.template_timeout)


def speculative_from_args(args: Any) -> Any:
    """The SpeculativeConfig the flags ask for (None: off), validated: one-line GenerationErrors."""
    from tinyformer.errors import GenerationError
    from tinyformer.generation.speculative import DEFAULT_DRAFT_TOKENS, SpeculativeConfig

    method = args.speculative or ("draft" if args.draft_model is not None else None)
    if method is None:
        if args.draft_tokens is not None:
            raise GenerationError("--draft-tokens needs --speculative ngram or --draft-model RUN")
        return None
    if method == "draft" and args.draft_model is None:
        raise GenerationError("--speculative draft needs --draft-model RUN")
    if method == "ngram" and args.draft_model is not None:
        raise GenerationError("--draft-model is used by --speculative draft, not ngram")
    k = DEFAULT_DRAFT_TOKENS if args.draft_tokens is None else args.draft_tokens
    if k < 1:
        raise GenerationError(f"--draft-tokens must be >= 1, got {k}")
    return SpeculativeConfig(method, k).validate()
