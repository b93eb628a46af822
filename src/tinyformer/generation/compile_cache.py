"""The compiled decode step of generate, chat and serve, built once and kept on disk between invocations.

On a CPU a small model's eager decode step is mostly Python and kernel-launch overhead, which a compiled
step removes (docs/benchmarks/decode.md). On a CPU the compiled step is an **AOTInductor package**
(:class:`PackagedStep`): ``torch.export`` traces one decode step (the attended span and the cache length
symbolic), inductor compiles it to a shared library, and the package is stored in the compile cache. The
first process to need a shape builds it (minutes for SmolLM2-135M's 30 layers on 2 cores); every later one
loads it in milliseconds, without importing torch's compiler, and hands it the model's own weights. A
speculative verification (the target over up to K + 1 positions per row, ``generation/speculative.py``) is a
package of its own, its positions symbolic too (:meth:`PackagedStep.verifier`). On a
GPU it is the ``torch.compile``-d step (:class:`~tinyformer.generation.engine.CompiledStep`), whose kernels
inductor caches in the same folder.

What the commands do (:func:`resolve_compile`): by default (no flag) they decode with the package where it
exists, and otherwise decode eagerly while a separate low-priority process builds it for the next run
(one line on stderr says so). ``--compile`` builds a missing package now, before decoding; ``--no-compile``
decodes eagerly (the code as written); ``TINYFORMER_COMPILE=0`` makes eager the default, ``=1``
``--compile``. Where nothing can compile (no C++ compiler, a kernel the exporter cannot trace) the default
decodes eagerly, and ``--compile`` is an error that says why.

Where the cache lives::

    $TINYFORMER_CACHE (default $XDG_CACHE_HOME/tinyformer, ~/.cache/tinyformer) / compile / torch-<version>-<cpu tag>
        packages/<digest>.pt2      one decode step or verification each (PackagedStep.name: code, model,
                                   rows, positions, cache layout)
        packages/build.log         what the background builds printed

The torch version and the CPU are part of the folder name, so that a new torch or another CPU (kernels are
generated for the CPU's instruction set) starts afresh instead of reading stale code; a package's name
digests tinyformer's own source too, so an upgraded tinyformer builds anew.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from tinyformer.components import quant_kernels
from tinyformer.components.kv_cache import KVCache
from tinyformer.data.named import default_cache_dir
from tinyformer.errors import GenerationError
from tinyformer.generation.engine import CompiledStep, check_compilable
from tinyformer.generation.weight_layout import load_for_decoding, prepare_for_decoding

__all__ = ["ENV_DEFAULT", "PackageBuild", "PackagedStep", "build_package", "compile_cache_dir", "compiled_step",
           "cpu_tag", "default_inductor_cache", "model_key", "resolve_compile", "source_digest", "use_compile_cache"]

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


def use_compile_cache(model: nn.Module) -> tuple[Path, bool]:
    """(The cache folder in force, whether this model's step has compiled there before.) The folder is
    ``TORCHINDUCTOR_CACHE_DIR`` (see :func:`default_inductor_cache`; unset: this module's), created, and kept
    in the variable. When the process exits having compiled or loaded an inductor graph, the model is recorded
    as seen there."""
    folder = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or compile_cache_dir())
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GenerationError(f"cannot create the compile cache {folder}: {exc.strerror or exc}") from None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    marker = folder / "seen" / model_key(model)
    seen = marker.exists()
    if not seen:
        atexit.register(_mark_seen, marker)
    return folder, seen


def _mark_seen(marker: Path) -> None:
    # a best effort: failing to write costs the next start only its first-time wording
    from torch._dynamo.utils import counters

    # this process's inductor graphs: built anew (cache misses) or loaded from the cache (hits)
    if int(counters["inductor"]["fxgraph_cache_miss"]) + int(counters["inductor"]["fxgraph_cache_hit"]) == 0:
        return
    with contextlib.suppress(OSError):
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()


def resolve_compile(flag: bool | None, model: nn.Module) -> tuple[str, str | None]:
    """How to decode, and the one-line notice to print (None for none). The ways: "eager"; "compile", the
    compiled step, built at the first step of a shape where no package holds it; "background", the
    compiled step where a package holds it, else eagerly while a process of its own builds the package for
    the next run (:class:`PackagedStep`).

    ``flag`` False (``--no-compile``): eager. ``flag`` True (``--compile``): compile, or raise
    :class:`GenerationError` saying why it cannot. ``flag`` None (neither): ``TINYFORMER_COMPILE`` decides;
    "0" is eager; "1" compiles where the device is a CPU or a CUDA GPU, the model's kernels can be traced and
    a C++ compiler exists (CPU), and otherwise decodes eagerly with a notice naming the reason; unset, a
    CPU goes "background" where it can compile and eager with that notice where it cannot, and any other
    device decodes eagerly without a word.
    """
    if flag is False:
        return "eager", None
    setting = os.environ.get(ENV_DEFAULT, "").strip().lower()
    if flag is None and setting in ("0", "false", "no", "off"):
        return "eager", None
    default = flag is None and setting not in ("1", "true", "yes", "on")
    device = next(model.parameters()).device
    if default and device.type != "cpu":
        return "eager", None
    try:
        if device.type not in ("cpu", "cuda"):
            raise GenerationError(f"the compiled step is not built for {device.type} devices")
        check_compilable(model)
    except GenerationError as exc:
        if flag:
            raise
        return "eager", f"tinyformer: decoding eagerly ({exc}); --no-compile silences this"
    return ("background" if default else "compile"), None


# ------------------------------------------------------------------------------------------------
# the decode step as AOTInductor packages
# ------------------------------------------------------------------------------------------------


@functools.cache
def source_digest() -> str:
    """A digest of tinyformer's own source files (Python and C++): a package holds the graph the code traced,
    so code that changed must not load it."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


class _StepGraph(nn.Module):
    """What a package holds: one decode step over a cache laid out like ``layout``'s, its buffers given as
    inputs. ``(tokens (R, 1), positions (R,), span (kv,), keys [L x (R, H_kv, S, d)], values [...])`` ->
    logits (R, V), or the greedy ids (R,) with ``ids_only``; row r's token goes to position positions[r] and
    attends over cache slots [0, kv), kv < S. With ``positions`` T > 1, a speculative verification:
    tokens (R, T) at positions[r] .. positions[r] + T - 1 -> logits (R, T, V)."""

    def __init__(self, model: nn.Module, layout: KVCache, ids_only: bool, positions: int = 1) -> None:
        super().__init__()
        self.model, self.layout, self.ids_only, self.positions = model, layout, ids_only, positions

    def forward(self, tokens: Tensor, positions: Tensor, span: Tensor, keys: list[Tensor],
                values: list[Tensor]) -> Tensor:
        # the span never reaches the end of the cache (the engine keeps a free slot): said here, the graph
        # needs no second variant for kv == S
        torch._check(span.shape[0] < keys[0].shape[2])
        cache = copy.copy(self.layout)
        cache.store = [type(s)(k, v, s.window) for s, k, v in zip(self.layout.store, keys, values)]
        step = CompiledStep(self.model)
        if self.positions > 1:
            return step.verify(tokens, positions, cache, span)
        return (step.greedy if self.ids_only else step.logits)(tokens, positions, cache, span)


@dataclass(frozen=True)
class PackageBuild:
    """How :class:`PackagedStep` builds a package it does not find. ``background_run`` set: by a process of
    its own while this one decodes eagerly, loading that run folder in ``dtype`` as this process did;
    None: here, at the first step of the shape. ``notice`` gets the one line that says so (None: silent)."""

    notice: Callable[[str], None] | None = None
    background_run: str | None = None
    dtype: str = "float32"  # torch dtype name


class PackagedStep(CompiledStep):
    """The compiled decode step kept as AOTInductor packages (``torch._inductor.aoti_compile_and_package``)
    in ``folder``, built and loaded as the module docstring says, where the ``torch.compile``-d step traced
    the whole model again in every process (18 s for SmolLM2-135M). The package holds no weights, so it costs
    no second copy. A verification (:meth:`verifier`) takes T = 2 .. K + 1 tokens per row (K the engine's
    draft budget), T symbolic like the span, so one package serves every number of drafts.

    A package's name digests what its code depends on: tinyformer's source (:func:`source_digest`), the
    model (:func:`model_key`, with every tensor's strides), the rows, whether it returns greedy ids, the
    positions per row (1, or the verification's K + 1 at most), and the cache's layer kinds and dtype;
    torch's version and the CPU name the folder (:func:`compile_cache_dir`).

    A missing package is built here, or, with ``build.background_run``, by a separate low-priority process
    (``python -m tinyformer.generation.compile_cache``) while this one decodes that shape eagerly
    (:class:`PackageBuild`); one builder runs at a time, and it builds the decode step and the verification
    of an engine that speculates one after the other (:meth:`expect`). A shape that does not export (a
    kernel or layer the exporter cannot trace) decodes with the ``torch.compile``-d step instead (eagerly in
    the background mode, and a verification always eagerly), as does a call whose span is outside the
    package's range; a ``.failed`` file beside where its package would be keeps later processes from trying
    again (sliding-window rings, whose attended span is bounded, do not export yet). A process that waits on
    a background build looks for the package every 10 s and takes it up once it is there (a chat or a server
    keeps running)."""

    traced = False  # a package is no dynamo graph: nothing to mark, and no import of torch's compiler

    def __init__(self, model: nn.Module, folder: Path, build: PackageBuild = PackageBuild()) -> None:
        super().__init__(model)
        self.folder = folder
        self.build = build
        self._builder: subprocess.Popen | None = None  # the background builder this process started last
        self._tried: set[tuple] = set()  # shapes a builder was started for (or could not be: another's lock)
        self._packages: dict[tuple, Callable[..., Tensor] | None] = {}
        # shapes whose package a background builder may still write: (its path, when to look again), so that
        # a long chat or server session switches to the package once it is there
        self._awaited: dict[tuple, tuple[Path, float]] = {}
        self.built: list[Path] = []  # packages this process compiled (the others were loaded)
        # what an engine that speculates decodes with, by rows: (ids_only of its one-position step, positions
        # of its verification); a background builder builds both, one after the other (expect)
        self._companions: dict[int, tuple[bool, int]] = {}

    def get(self, ids_only: bool) -> Callable[..., Tensor]:
        return functools.partial(self._call, ids_only)

    def expect(self, rows: int, ids_only: bool, positions: int) -> None:
        self._companions[rows] = (ids_only, positions)

    def verifier(self, positions: int, rows: int, cache: KVCache) -> Callable[..., Tensor] | None:
        if positions < 2:
            return None
        fn = self._lookup(self._key(False, rows, cache, positions), cache)
        return None if fn is None else functools.partial(self._verify_call, fn, positions)

    def _verify_call(self, fn: Callable[..., Tensor], most: int, tokens: Tensor, positions: Tensor, cache: KVCache,
                     span: Tensor) -> Tensor:
        if not 2 <= tokens.shape[1] <= most or span.shape[0] >= cache.store[0].k.shape[2]:
            return self.verify(tokens, positions, cache, span)  # outside the package's range: eagerly
        return self._run(fn, tokens, positions, cache, span)

    def _call(self, ids_only: bool, tokens: Tensor, positions: Tensor, cache: KVCache, span: Tensor) -> Tensor:
        fn = self._lookup(self._key(ids_only, tokens.shape[0], cache), cache)
        if fn is None or not 2 <= span.shape[0] < cache.store[0].k.shape[2]:
            if self.build.background_run is not None:  # eager, as without --compile
                return (self.greedy if ids_only else self.logits)(tokens, positions, cache, span)
            torch._dynamo.maybe_mark_dynamic(span, 0)
            return super().get(ids_only)(tokens, positions, cache, span)
        return self._run(fn, tokens, positions, cache, span)

    @staticmethod
    def _run(fn: Callable[..., list[Tensor]], tokens: Tensor, positions: Tensor, cache: KVCache,
             span: Tensor) -> Tensor:
        # the graph's inputs, flattened as torch.export flattened (tokens, positions, span, keys, values)
        return fn([tokens, positions, span, *(s.k for s in cache.store), *(s.v for s in cache.store)])[0]

    def _lookup(self, key: tuple, cache: KVCache) -> Callable[..., list[Tensor]] | None:
        """The loaded package of ``key``, or None (not built: built now, or by a background builder)."""
        if key not in self._packages or (key in self._awaited and time.monotonic() >= self._awaited[key][1]):
            self._packages[key] = self._package(key, cache)
        return self._packages[key]

    @staticmethod
    def _key(ids_only: bool, rows: int, cache: KVCache, positions: int = 1) -> tuple:
        """What tells this process's packages apart (the model is the same for all of them)."""
        return ids_only, rows, positions, tuple(s.kind for s in cache.store), cache.store[0].k.dtype

    def name(self, ids_only: bool, rows: int, cache: KVCache, positions: int = 1) -> str:
        """The file name of the package for this model and shape (see the class docstring)."""
        tensors = list(self.model.named_parameters()) + list(self.model.named_buffers())
        parts = [source_digest(), model_key(self.model), f"rows={rows}", f"ids_only={ids_only}",
                 f"positions={positions}", repr([s.kind for s in cache.store]), str(cache.store[0].k.dtype)]
        parts += [f"{name}:{tuple(t.stride())}" for name, t in tensors]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24] + ".pt2"

    def _package(self, key: tuple, cache: KVCache) -> Callable[..., list[Tensor]] | None:
        ids_only, rows, positions = key[:3]
        prepare_for_decoding(self.model)  # before the name: the package is built for the layers' layout
        path = self.folder / self.name(ids_only, rows, cache, positions)
        if failed_marker(path).is_file():  # this shape did not export here before: not again each run
            return None
        graph = _StepGraph(self.model, cache, ids_only, positions)
        if not path.is_file():
            if self.build.background_run is not None:
                if key not in self._tried and (self._builder is None or self._builder.poll() is not None):
                    self._spawn_builder(key, cache)
                self._awaited[key] = (path, time.monotonic() + 10.0)
                return None
            if self.build.notice is not None:
                what = "decode step" if positions == 1 else f"speculative verification ({positions} positions)"
                self.build.notice(f"tinyformer: compiling the {what} for this model ({rows} row(s)), once "
                                  f"(minutes for a model of tens of layers; later runs load it from {self.folder}; "
                                  "--no-compile skips this) ...")
            try:
                build_package(graph, path, rows, cache)
            except Exception as exc:  # the exporter's many error types: the torch.compile-d step serves this shape
                mark_failed(path, exc)
                return None
            self.built.append(path)
        self._awaited.pop(key, None)
        if quant_kernels.uses_kernels(self.model):  # its graph calls torch.ops.tinyformer.*: registered first
            quant_kernels.available()
        return self._load(path, graph)

    def _load(self, path: Path, graph: _StepGraph) -> Callable[[list[Tensor]], list[Tensor]]:
        # the C++ loader itself: torch._inductor's Python wrapper would import torch's compiler (3 s)
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        tensors = {**dict(graph.named_parameters(remove_duplicate=False)),
                   **dict(graph.named_buffers(remove_duplicate=False))}
        constants = {name: tensors[name].detach() for name in loader.get_constant_fqns()}
        # (map, use the inactive buffer, check every constant is given, user managed: the model's own memory)
        loader.load_constants(constants, False, True, True)
        return loader.boxed_run

    def _spawn_builder(self, key: tuple, cache: KVCache) -> None:
        """Start the builder of ``key``'s package, and of its companion's (:meth:`expect`) where that is
        missing too, unless another process is building (the folder's lock file, taken here and removed by
        the builder when it ends)."""
        run = self.build.background_run
        assert run is not None
        ids_only, rows, positions = key[:3]
        jobs = [key]
        other = None
        if rows in self._companions:
            companion_ids, most = self._companions[rows]
            other = self._key(False, rows, cache, most) if positions == 1 else self._key(companion_ids, rows, cache)
        if other is not None and other != key and other not in self._tried:
            path = self.folder / self.name(other[0], rows, cache, other[2])
            if not path.is_file() and not failed_marker(path).is_file():
                jobs.append(other)
        self._tried.update(jobs)  # tried once per process: a lock held by another process is not waited for
        if not take_lock(self.folder / ".building"):
            return
        spare = next((s.kind[2] - s.window for s in cache.store if s.kind[0] == "ring"), 0)
        cmd = [sys.executable, "-m", "tinyformer.generation.compile_cache", "--run", run, "--dtype", self.build.dtype,
               "--rows", str(rows), "--max-len", str(cache.max_len),
               "--spare-slots", str(spare), "--cache-dtype", str(cache.store[0].k.dtype).removeprefix("torch.")]
        for ids, _, n, *_ in jobs:
            cmd += ["--package", "ids" if ids else "logits", str(n), str(self.folder / self.name(ids, rows, cache, n))]
        try:  # the builder holds the lock from here on and removes it when it ends
            with open(self.folder / "build.log", "ab") as log:
                self._builder = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                    env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(self.folder.parent)})
        except OSError:
            (self.folder / ".building").unlink(missing_ok=True)
            return
        if self.build.notice is not None and len(self._tried) == len(jobs):  # the process's first builder
            self.build.notice(f"tinyformer: decoding eagerly; the compiled decode step for this model is being "
                              f"built in the background (minutes, once; --no-compile turns this off), and later "
                              f"runs will load it from {self.folder}")


def failed_marker(path: Path) -> Path:
    """``<package>.failed``: the shape of ``path`` could not be exported or compiled here (its first error line
    inside); as the package's name digests the code and the model, a changed one tries again."""
    return path.with_suffix(".failed")


def mark_failed(path: Path, exc: BaseException) -> None:
    with contextlib.suppress(OSError):
        failed_marker(path).write_text(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}\n")


def take_lock(lock: Path) -> bool:
    """Create ``lock`` (and its folder) unless it exists; one an hour old is stale (its builder died)."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        if lock.exists() and time.time() - lock.stat().st_mtime >= 3600:
            lock.unlink(missing_ok=True)
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except OSError:  # it exists (another builder), or the folder cannot be written: no build
        return False


def build_package(graph: _StepGraph, path: Path, rows: int, cache: KVCache) -> None:
    """Export ``graph`` (one decode step of ``rows`` rows over a cache laid out like ``cache``) and compile it
    to the AOTInductor package ``path``, written whole or not at all."""
    from torch._inductor import aoti_compile_and_package
    from torch.export import Dim, export

    device = cache.store[0].k.device
    kv, slots = Dim("kv", min=2, max=2**20 - 1), Dim("slots", min=3, max=2**20)
    # dense layers hold every position (S symbolic); a ring's slot count is part of its kind
    cache_dims = [{2: slots} if s.kind[0] == "dense" else {} for s in cache.store]
    with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecations, not ours to act on
        # fresh example buffers: the engine's may be inference tensors, which export cannot write
        keys = [torch.zeros_like(s.k, memory_format=torch.contiguous_format) for s in cache.store]
        values = [torch.zeros_like(k) for k in keys]
        T = graph.positions
        tokens = torch.zeros(rows, T, dtype=torch.long, device=device)
        positions = torch.ones(rows, dtype=torch.long, device=device)
        # a verification's tokens per row are symbolic too: one package serves every number of drafts
        token_dims = {1: Dim("T", min=2, max=T)} if T > 1 else {}
        exported = export(graph, (tokens, positions, torch.empty(T + 1, device=device), keys, values),
                          dynamic_shapes=(token_dims, {}, {0: kv}, cache_dims, cache_dims), strict=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{os.getpid()}.{path.name}")  # the packager wants the .pt2 suffix
        configs: dict[str, bool | int] = {"aot_inductor.package_constants_in_so": False}
        if T > 1:
            # inductor sizes its own loops (norms, RoPE, cache writes) by T's example value and splits them over
            # OpenMP threads, ~150 parallel regions a forward; with sleeping threads (OMP_WAIT_POLICY=PASSIVE,
            # the CLI's choice on a busy machine) each wake-up cost more than the loop: one thread for them
            # (the products and the attention are our ops, threaded as before; docs/benchmarks/speculative.md)
            configs["cpp.threads"] = 1
        try:
            aoti_compile_and_package(exported, package_path=str(tmp), inductor_configs=configs)
            os.replace(tmp, path)  # whole or not at all: another process may be loading it
        finally:
            tmp.unlink(missing_ok=True)


def compiled_step(model: nn.Module, build: bool | PackageBuild = True) -> CompiledStep:
    """The compiled decode step for ``model`` (``build``: the ``compile`` argument of ``Generator`` and
    ``Scheduler``): kept as packages in the compile cache on a CPU (:class:`PackagedStep`, built as a
    :class:`PackageBuild` says; True: in the foreground, silently), the ``torch.compile``-d step elsewhere."""
    if next(model.parameters()).device.type == "cpu":
        return PackagedStep(model, compile_cache_dir() / "packages",
                            build if isinstance(build, PackageBuild) else PackageBuild())
    return CompiledStep(model)


def main(argv: list[str] | None = None) -> int:
    """The background builder of :class:`PackagedStep`: load the run as the decoding process did, lay out a
    cache alike, and build each ``--package`` in turn (those that exist by then are skipped), unless its
    name (the model and shape it digests) differs from the one asked for. Removes the folder's lock file
    (taken by its starter) when it ends."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m tinyformer.generation.compile_cache")
    p.add_argument("--run", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--max-len", type=int, required=True)
    p.add_argument("--spare-slots", type=int, default=0)
    p.add_argument("--cache-dtype", required=True)
    p.add_argument("--package", nargs=3, action="append", required=True, metavar=("ids|logits", "POSITIONS", "OUT"),
                   help="a package to build: greedy ids or logits, positions per row (1: the decode step; more: "
                        "the verification of up to that many), its path")
    args = p.parse_args(argv)
    os.nice(10)  # the user's own work first
    outs = [Path(out) for _, _, out in args.package]
    lock = outs[0].parent / ".building"  # taken by the process that started this one
    try:
        model = load_for_decoding(args.run, dtype=getattr(torch, args.dtype), verify=False)
        cache = model.new_cache(args.rows, args.max_len, dtype=getattr(torch, args.cache_dtype),
                                spare_slots=args.spare_slots)
        step = PackagedStep(model, outs[0].parent)
        code = 0
        for (kind, positions, _), out in zip(args.package, outs):
            ids_only, positions = kind == "ids", int(positions)
            if step.name(ids_only, args.rows, cache, positions) != out.name:
                print(f"{out.name}: this process lays out another model or cache; nothing built", file=sys.stderr)
                code = 1
                continue
            if out.is_file():
                continue
            try:
                build_package(_StepGraph(model, cache, ids_only, positions), out, args.rows, cache)
            except Exception:
                mark_failed(out, sys.exc_info()[1])
                traceback.print_exc()  # to build.log
                code = 1
                continue
            print(f"built {out}", file=sys.stderr)
        return code
    finally:
        lock.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
