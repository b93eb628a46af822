"""The compiled decode step by default: packages built once (in the background by default) and loaded by
every later process (tinyformer.generation.compile_cache)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_generate_cli import make_run

from tinyformer.config import ModelConfig
from tinyformer.errors import GenerationError
from tinyformer.generation import compile_cache
from tinyformer.generation.weight_layout import prepare_for_decoding
from tinyformer.models.decoder import DecoderLM
from tinyformer.run_folder import load_model, save_model

# A process that runs `tinyformer generate` in-process, then prints whether torch's compiler was imported and
# the packages it built (stderr keeps the command's own notices).
CHILD = """
import json, sys
from tinyformer.cli.main import main
from tinyformer.generation import compile_cache
built = []
build = compile_cache.build_package
compile_cache.build_package = lambda graph, path, *a: (built.append(path.name), build(graph, path, *a))
code = main(sys.argv[1:])
print("STEP " + json.dumps({"built": built, "compiler": "torch._dynamo" in sys.modules}), flush=True)
sys.exit(code)
"""


def child(args: list[str], env: dict[str, str]) -> tuple[dict, dict, str]:
    """(the generated sample, what the process built and imported, stderr) of one `generate --json` process."""
    proc = subprocess.run([sys.executable, "-c", CHILD, "generate", *args, "--json", "--temperature", "0",
                           "--max-new-tokens", "12", "--prompt", "the fox"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    step = json.loads(next(x for x in lines if x.startswith("STEP "))[len("STEP "):])
    sample = json.loads(next(x for x in lines if x.startswith("{")))
    return sample, step, proc.stderr


def packages(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.glob("compile/*/packages/*.pt2"))


def wait_for_builder(cache: Path, timeout: float = 600) -> None:
    """Until the background builder has released its lock (or the time is up: the caller's asserts fail)."""
    end = time.monotonic() + timeout
    time.sleep(1)
    while time.monotonic() < end and any(cache.glob("compile/*/packages/.building")):
        time.sleep(1)


def tiny_model() -> DecoderLM:
    return DecoderLM(ModelConfig(vocab_size=40, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64,
                                 max_seq_len=64))


def test_the_default_is_the_packaged_step_built_in_the_background_unless_a_flag_or_the_environment_says(
        monkeypatch):
    model = tiny_model()
    monkeypatch.delenv(compile_cache.ENV_DEFAULT, raising=False)
    assert compile_cache.resolve_compile(None, model) == ("background", None)
    assert compile_cache.resolve_compile(True, model) == ("compile", None)
    assert compile_cache.resolve_compile(False, model) == ("eager", None)
    monkeypatch.setenv(compile_cache.ENV_DEFAULT, "1")
    assert compile_cache.resolve_compile(None, model) == ("compile", None)
    assert compile_cache.resolve_compile(False, model) == ("eager", None)  # an explicit --no-compile wins
    monkeypatch.setenv(compile_cache.ENV_DEFAULT, "0")
    assert compile_cache.resolve_compile(None, model) == ("eager", None)
    assert compile_cache.resolve_compile(True, model) == ("compile", None)


def test_without_a_cpp_compiler_the_default_decodes_eagerly_and_compile_fails(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++-compiler")  # the compiler inductor would call, not on PATH
    for setting in (None, "1"):  # the default, and TINYFORMER_COMPILE=1: eager, with one line saying why
        if setting is None:
            monkeypatch.delenv(compile_cache.ENV_DEFAULT, raising=False)
        else:
            monkeypatch.setenv(compile_cache.ENV_DEFAULT, setting)
        how, notice = compile_cache.resolve_compile(None, tiny_model())
        assert how == "eager" and notice is not None and "\n" not in notice
        assert notice.startswith("tinyformer: decoding eagerly") and "C++ compiler" in notice
    with pytest.raises(GenerationError, match="C\\+\\+ compiler"):
        compile_cache.resolve_compile(True, tiny_model())


def test_the_cache_folder_is_keyed_by_torch_version_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("TINYFORMER_CACHE", str(tmp_path))
    here = compile_cache.compile_cache_dir()
    assert here.parent == tmp_path / "compile"
    assert here.name == f"torch-{torch.__version__.replace('+', '_')}-{compile_cache.cpu_tag()}"
    assert compile_cache.compile_cache_dir("9.9.9") != here  # a new torch reads none of the old code
    monkeypatch.setattr(compile_cache, "cpu_tag", lambda: "othercpu00")
    assert compile_cache.compile_cache_dir() != here  # nor does another CPU


def test_the_model_key_follows_shapes_and_dtypes_not_values():
    a, b = tiny_model(), tiny_model()  # different random values, same shapes
    assert compile_cache.model_key(a) == compile_cache.model_key(b)
    assert compile_cache.model_key(a) != compile_cache.model_key(a.to(torch.bfloat16))
    wider = DecoderLM(ModelConfig(vocab_size=40, d_model=48, n_layer=2, n_head=4, n_kv_head=2, d_ff=64,
                                  max_seq_len=64))
    assert compile_cache.model_key(a) != compile_cache.model_key(wider)


def test_the_package_name_follows_the_source_the_rows_and_the_weights_layout(monkeypatch, tmp_path):
    model = tiny_model()
    step = compile_cache.PackagedStep(model, tmp_path)
    cache = model.new_cache(2, 32)
    name = step.name(False, 2, cache)
    assert name == compile_cache.PackagedStep(tiny_model(), tmp_path).name(False, 2, cache)  # values: no
    assert step.name(True, 2, cache) != name and step.name(False, 1, cache) != name
    assert step.name(False, 2, model.new_cache(2, 32, dtype=torch.bfloat16)) != name
    monkeypatch.setattr(compile_cache, "source_digest", lambda: "changedcode")
    assert step.name(False, 2, cache) != name  # tinyformer's code changed: the graph may have too
    monkeypatch.undo()
    from tinyformer.generation.weight_layout import store_input_major

    store_input_major(model)  # same values, other strides: a package reads constants by their layout
    assert step.name(False, 2, cache) != name


def test_a_verification_package_keeps_inductors_own_loops_on_one_thread_and_a_step_package_does_not(
        monkeypatch, tmp_path):
    """inductor threads its loops by the example T of a verification (5 tokens x d_model values): ~150 OpenMP
    regions a forward, each a wake-up of sleeping threads under OMP_WAIT_POLICY=PASSIVE, which cost more than
    the loops (docs/benchmarks/speculative.md). A verification is built with ``cpp.threads`` 1; a one-token
    step, which inductor keeps serial by itself, with inductor's defaults."""
    import torch._inductor

    asked: dict[int, dict] = {}

    def no_compile(exported, package_path, inductor_configs):
        asked[graph.positions] = dict(inductor_configs)
        raise RuntimeError("not compiled here")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compile)
    model = tiny_model()
    for positions in (1, 5):
        cache = model.new_cache(1, 32)
        graph = compile_cache._StepGraph(model, cache, ids_only=False, positions=positions)
        with pytest.raises(RuntimeError, match="not compiled here"):
            compile_cache.build_package(graph, tmp_path / f"p{positions}.pt2", 1, cache)
    assert asked[5].get("cpp.threads") == 1
    assert "cpp.threads" not in asked[1]
    assert not list(tmp_path.glob("*.pt2")) and not list(tmp_path.glob(".*"))  # nothing half-written is left


def test_a_package_built_in_the_background_is_loaded_by_later_processes_without_the_compiler(tmp_path, cli_env):
    """The first `generate` (no flag) decodes eagerly and starts a background build (saying so once); the next
    loads the package, imports none of torch's compiler, builds nothing and decodes the same tokens as
    eager decoding; a model of another shape is built anew by `--compile`, in the foreground."""
    run = make_run(tmp_path / "run")
    cache = tmp_path / "cache"
    env = dict(cli_env, TINYFORMER_CACHE=str(cache))
    env.pop(compile_cache.ENV_DEFAULT, None)  # the default, as a user has it
    first, step1, err1 = child(["--model", str(run)], env)
    assert step1["built"] == [] and "being built in the background" in err1
    wait_for_builder(cache)
    assert len(packages(cache)) == 1, (cache / "compile").glob("*/packages/build.log")
    second, step2, err2 = child(["--model", str(run)], env)
    eager, _, _ = child(["--model", str(run), "--no-compile"], env)
    assert step2 == {"built": [], "compiler": False}
    assert "compil" not in err2 and "background" not in err2
    assert first["token_ids"] == second["token_ids"] == eager["token_ids"]
    folders = [f.name for f in (cache / "compile").iterdir()]
    assert folders == [compile_cache.compile_cache_dir().name]  # torch-<version>-<cpu tag>
    other = make_run(tmp_path / "other")
    wider = DecoderLM(dataclasses.replace(load_model(other).cfg, d_model=48))
    save_model(other, wider)  # the same tokenizer, another width: a new package
    third, step3, err3 = child(["--model", str(other), "--compile"], env)
    assert len(step3["built"]) == 1 and "compiling the decode step for this model" in err3
    assert len(packages(cache)) == 2
    assert third["token_ids"] == child(["--model", str(other), "--no-compile"], env)[0]["token_ids"]


def test_a_shape_that_failed_to_build_here_is_not_tried_again(monkeypatch, tmp_path):
    """The `.failed` marker beside a package's place: a later process decodes that shape without the package
    and starts no build (an export that fails, e.g. a sliding-window ring, would fail again every run)."""
    model = tiny_model()
    step = compile_cache.PackagedStep(model, tmp_path)
    cache = model.new_cache(1, 32)
    prepare_for_decoding(model)  # as _package does before it names the package
    path = tmp_path / step.name(False, 1, cache)
    compile_cache.mark_failed(path, RuntimeError("Constraints violated (kv)!\nmore lines"))
    assert compile_cache.failed_marker(path).read_text() == "RuntimeError: Constraints violated (kv)!\n"

    class BuildStarted(BaseException):  # not an Exception: the step's fallback must not swallow it
        pass

    def no_build(*args):
        raise BuildStarted

    monkeypatch.setattr(compile_cache, "build_package", no_build)
    assert step._package(step._key(False, 1, cache), cache) is None
    background = compile_cache.PackagedStep(model, tmp_path, compile_cache.PackageBuild(background_run="run"))
    monkeypatch.setattr(background, "_spawn_builder", no_build)
    assert background._package(background._key(False, 1, cache), cache) is None


def test_a_background_builder_builds_the_decode_step_and_the_verification_together(monkeypatch, tmp_path):
    """An engine that speculates needs two packages: the one-position step and the verification over up to
    K + 1 positions. The first one asked for starts one builder for both (one builder at a time), and the
    verification's name digests its positions."""
    model = tiny_model()
    cache = model.new_cache(1, 32)
    step = compile_cache.PackagedStep(model, tmp_path, compile_cache.PackageBuild(background_run="RUN"))
    prepare_for_decoding(model)  # as _package does (a model this size asks for no kernels), before Popen is faked
    assert step.name(False, 1, cache, 5) not in (step.name(False, 1, cache), step.name(False, 1, cache, 3))
    started: list[list[str]] = []

    class Builder:
        def __init__(self, cmd, **kwargs):
            started.append(cmd)

        def poll(self):
            return None  # still building

    monkeypatch.setattr(compile_cache.subprocess, "Popen", Builder)
    step.expect(1, True, 5)
    assert step._package(step._key(True, 1, cache), cache) is None  # decodes eagerly meanwhile
    assert step.verifier(5, 1, cache) is None  # verifies eagerly meanwhile; no second builder
    assert len(started) == 1
    jobs = [started[0][i + 1 : i + 4] for i, a in enumerate(started[0]) if a == "--package"]
    assert jobs == [["ids", "1", str(tmp_path / step.name(True, 1, cache))],
                    ["logits", "5", str(tmp_path / step.name(False, 1, cache, 5))]]
