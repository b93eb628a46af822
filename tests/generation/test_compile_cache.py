"""The compiled decode step by default, and its kernels cached on disk between processes
(tinyformer.generation.compile_cache)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from test_generate_cli import make_run

from tinyformer.config import ModelConfig
from tinyformer.errors import GenerationError
from tinyformer.generation import compile_cache
from tinyformer.models.decoder import DecoderLM
from tinyformer.run_folder import load_model, save_model

# A process that runs `tinyformer generate` in-process, then prints the graphs inductor built anew and loaded
# from its cache (stderr keeps the command's own notices).
CHILD = """
import json, sys
from tinyformer.cli.main import main
from tinyformer.generation.compile_cache import compiled_graphs
code = main(sys.argv[1:])
print("GRAPHS " + json.dumps(compiled_graphs()), flush=True)
sys.exit(code)
"""


def child(args: list[str], env: dict[str, str]) -> tuple[dict, dict, str]:
    """(the generated sample, the graph counts, stderr) of one `generate --json` process."""
    proc = subprocess.run([sys.executable, "-c", CHILD, "generate", *args, "--json", "--temperature", "0",
                           "--max-new-tokens", "12", "--prompt", "the fox"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    graphs = json.loads(next(x for x in lines if x.startswith("GRAPHS "))[len("GRAPHS "):])
    sample = json.loads(next(x for x in lines if x.startswith("{")))
    return sample, graphs, proc.stderr


def tiny_model() -> DecoderLM:
    return DecoderLM(ModelConfig(vocab_size=40, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64,
                                 max_seq_len=64))


def test_eager_is_the_default_unless_the_flag_or_the_environment_asks_for_compiled(monkeypatch):
    model = tiny_model()
    monkeypatch.delenv(compile_cache.ENV_DEFAULT, raising=False)
    assert compile_cache.resolve_compile(None, model) == (False, None)
    assert compile_cache.resolve_compile(True, model) == (True, None)
    monkeypatch.setenv(compile_cache.ENV_DEFAULT, "1")
    assert compile_cache.resolve_compile(None, model) == (True, None)
    assert compile_cache.resolve_compile(False, model) == (False, None)  # an explicit --no-compile wins


def test_without_a_cpp_compiler_the_environment_default_decodes_eagerly_with_one_line_but_compile_fails(
        monkeypatch):
    from torch._inductor import cpp_builder

    def missing():
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", missing)
    monkeypatch.setenv(compile_cache.ENV_DEFAULT, "1")
    use, notice = compile_cache.resolve_compile(None, tiny_model())
    assert use is False and notice is not None and "\n" not in notice
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


def test_a_second_process_compiles_nothing_and_a_changed_model_compiles_again(tmp_path, cli_env):
    """The first `generate` compiles (and says so once), the second loads every graph from the cache and
    decodes the same tokens, and eager decoding gives them too; another model's shapes miss the cache."""
    run = make_run(tmp_path / "run")
    env = dict(cli_env, TINYFORMER_CACHE=str(tmp_path / "cache"))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env[compile_cache.ENV_DEFAULT] = "1"  # compiled unless --no-compile, as --compile on every command
    first, graphs1, err1 = child(["--model", str(run)], env)
    second, graphs2, err2 = child(["--model", str(run)], env)
    eager, graphs3, _ = child(["--model", str(run), "--no-compile"], env)
    assert graphs1["compiled"] > 0 and graphs1["cached"] == 0
    assert "compiling the decode step for this model, once" in err1
    assert graphs2 == {"compiled": 0, "cached": graphs1["compiled"]}
    assert "compiling" not in err2
    assert graphs3 == {"compiled": 0, "cached": 0}
    assert first["token_ids"] == second["token_ids"] == eager["token_ids"]
    folders = [f.name for f in (tmp_path / "cache" / "compile").iterdir()]
    assert folders == [compile_cache.compile_cache_dir().name]  # torch-<version>-<cpu tag>
    other = make_run(tmp_path / "other")
    wider = DecoderLM(dataclasses.replace(load_model(other).cfg, d_model=48))
    save_model(other, wider)  # the same tokenizer, another width: new graphs
    _, graphs4, err4 = child(["--model", str(other)], env)
    assert graphs4["compiled"] > 0 and "compiling the decode step for this model, once" in err4
