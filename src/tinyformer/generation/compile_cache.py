"""The compiled decode step of generate, chat and serve, with its kernels kept on disk between invocations.

``--compile`` (or ``TINYFORMER_COMPILE=1`` in the environment) decodes with the ``torch.compile``-d step
(:class:`~tinyformer.generation.engine.CompiledStep`): on a CPU a small model's eager step is mostly Python and
kernel-launch overhead, which the compiled step removes (docs/benchmarks/decode.md). Compiling costs from tens
of seconds (a few layers) to minutes (SmolLM2-135M's 30: 240 s on 2 cores) the first time; inductor's on-disk
caches (the FX graph cache and the AOTAutograd cache) make every later process load the generated code
instead of building it again, leaving dynamo's trace of the step (18 s of a 28 s run for SmolLM2-135M, where
the eager command took 10 s). That is why eager decoding stays the default: the compiled step pays for itself
only over long outputs (docs/benchmarks/quantized.md has the figures).

Where the cache lives::

    $TINYFORMER_CACHE (default $XDG_CACHE_HOME/tinyformer, ~/.cache/tinyformer) / compile / torch-<version>-<cpu tag>

The torch version and the CPU are part of the folder name, so that a new torch or another CPU (kernels are
generated for the CPU's instruction set) starts a fresh cache instead of reading stale code; within the
folder inductor keys every graph by its own content (the model's shapes and dtypes, the compiler's
settings), so a changed model misses and compiles anew. A ``TORCHINDUCTOR_CACHE_DIR`` set by the user is
left alone. The command line sets the variable before torch's compiler is imported (importing
``torch._dynamo`` fixes its cache folders). The folder ``seen/`` beside the caches remembers which model
shapes have compiled here, so the command says so when this start compiles rather than loads.

:func:`resolve_compile` decides: an explicit ``--compile`` that cannot be honoured is an error; the
environment's ``TINYFORMER_COMPILE=1`` falls back to eager decoding with a one-line notice (no C++ compiler,
a kernel that cannot be traced, a device the compiler does not serve).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import platform
from pathlib import Path

import torch
from torch import nn

from tinyformer.data.named import default_cache_dir
from tinyformer.errors import GenerationError
from tinyformer.generation.engine import check_compilable

__all__ = ["ENV_DEFAULT", "compile_cache_dir", "compiled_graphs", "cpu_tag", "default_inductor_cache",
           "model_key", "point_inductor_at_cache", "resolve_compile", "use_compile_cache"]

ENV_DEFAULT = "TINYFORMER_COMPILE"  # "1": generate, chat and serve compile unless --no-compile


def cpu_tag() -> str:
    """A short digest of the CPU's model name and feature flags (``/proc/cpuinfo``'s first processor, or
    ``platform.processor()`` where there is none): inductor writes C++ for the instruction set it finds."""
    text = platform.machine() + "|" + platform.processor()
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace").split("\n\n")[0]
        text += "|" + "|".join(line for line in info.splitlines()
                                if line.split(":")[0].strip() in ("vendor_id", "model name", "flags", "Features"))
    except OSError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def compile_cache_dir(version: str | None = None) -> Path:
    """``<tinyformer's cache>/compile/torch-<version>-<cpu tag>`` (the data sets' cache folder,
    :func:`~tinyformer.data.named.default_cache_dir`; ``version``: torch's own by default)."""
    version = torch.__version__ if version is None else version
    return default_cache_dir() / "compile" / f"torch-{version.replace('+', '_')}-{cpu_tag()}"


def model_key(model: nn.Module) -> str:
    """A digest of what the compiled step's code depends on: the config, the parameters' and buffers' names,
    shapes and dtypes (quantized layers included), and the device type; not the values, which are inputs."""
    cfg = getattr(model, "cfg", None)
    parts = [json.dumps(cfg.to_dict() if hasattr(cfg, "to_dict") else repr(cfg), sort_keys=True, default=str)]
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        parts.append(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.device.type}")
    # a quantized layer's kernel name (attention layers hold a function under the same name: not a key)
    parts.extend(f"{name}:{m.kernel}" for name, m in model.named_modules()
                 if isinstance(getattr(m, "kernel", None), str))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def default_inductor_cache() -> None:
    """Make :func:`compile_cache_dir` inductor's cache unless ``TORCHINDUCTOR_CACHE_DIR`` is set. Call it before
    ``torch._dynamo`` is first imported: that import fixes its own cache folders from the variable (or sets
    the variable to inductor's default in the temp folder, which is then indistinguishable from a user's)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir()))


def point_inductor_at_cache() -> Path:
    """The folder in force (``TORCHINDUCTOR_CACHE_DIR``, see :func:`default_inductor_cache`; unset: this
    module's), created, and kept in the variable."""
    folder = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or compile_cache_dir())
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GenerationError(f"cannot create the compile cache {folder}: {exc.strerror or exc}") from None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


def use_compile_cache(model: nn.Module) -> tuple[Path, bool]:
    """(The cache folder in force, whether this model's step has compiled there before.) When the process
    exits having compiled or loaded a graph, the model is recorded as seen there (:func:`compiled_graphs`)."""
    folder = point_inductor_at_cache()
    marker = folder / "seen" / model_key(model)
    seen = marker.exists()
    if not seen:
        atexit.register(_mark_seen, marker)
    return folder, seen


def compiled_graphs() -> dict[str, int]:
    """This process's inductor graphs so far: ``{"compiled": built anew, "cached": loaded from the cache}``."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return {"compiled": int(c["fxgraph_cache_miss"]), "cached": int(c["fxgraph_cache_hit"])}


def _mark_seen(marker: Path) -> None:
    # a best effort: failing to write costs the next start only its first-time wording
    if sum(compiled_graphs().values()) == 0:
        return
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass


def resolve_compile(flag: bool | None, model: nn.Module) -> tuple[bool, str | None]:
    """Whether to decode with the compiled step, and the one-line notice to print (None for none).

    ``flag`` True (``--compile``): compile, or raise :class:`GenerationError` saying why it cannot.
    ``flag`` False (``--no-compile``): eager. ``flag`` None (neither): eager, unless ``TINYFORMER_COMPILE=1``,
    which compiles where the device is a CPU or a CUDA GPU, the model's kernels can be traced and a C++
    compiler exists (CPU), and otherwise decodes eagerly with a notice naming the reason.
    """
    if flag is False:
        return False, None
    if flag is None and os.environ.get(ENV_DEFAULT, "0").strip().lower() not in ("1", "true", "yes", "on"):
        return False, None
    try:
        point_inductor_at_cache()
        device = next(model.parameters()).device
        if device.type not in ("cpu", "cuda"):
            raise GenerationError(f"the compiled step is not built for {device.type} devices")
        check_compilable(model)
    except GenerationError as exc:
        if flag:
            raise
        return False, f"tinyformer: decoding eagerly ({exc}); --no-compile silences this"
    return True, None
