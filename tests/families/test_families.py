"""The model-family registry: every model type and GGUF architecture the converters accept has one family folder,
each folder has the required parts, the export choice among families is the documented decision, and the RoPE
permutation at the GGUF boundary round-trips."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from tinyformer import families
from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError
from tinyformer.families.llama.hf import layout_problem

FOLDER = Path(families.__file__).parent
#: What the converters accept, written out independently of the registry (config.json model_type, GGUF
#: general.architecture), with the family each belongs to.
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen", "qwen3": "qwen",
               "qwen3_moe": "qwen", "phi3": "phi3", "gemma2": "gemma", "gemma3_text": "gemma", "gpt2": "gpt2",
               "bert": "bert"}
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen", "qwen3": "qwen", "qwen3moe": "qwen", "phi3": "phi3",
              "gemma2": "gemma", "gemma3": "gemma"}


def family_folders() -> list[Path]:
    return sorted(p for p in FOLDER.iterdir() if (p / "__init__.py").is_file())


def test_the_registry_covers_every_model_type_and_gguf_architecture_once():
    by_type = {t: f.name for f in families.FAMILIES for t in f.adapter.model_types}
    assert by_type == MODEL_TYPES
    assert sum(len(f.adapter.model_types) for f in families.FAMILIES) == len(MODEL_TYPES)  # none listed twice
    for model_type, family in MODEL_TYPES.items():
        assert families.adapter_for_hf({"model_type": model_type}).name == family
    by_arch = {a.name: f.name for f in families.FAMILIES for a in f.gguf}
    assert by_arch == GGUF_ARCHS and set(families.GGUF_ARCHS) == set(GGUF_ARCHS)
    with pytest.raises(ConfigError, match="'falcon'.*not supported; supported model types: bert, gemma2"):
        families.adapter_for_hf({"model_type": "falcon"})


def test_every_gguf_architecture_is_one_llama_cpp_knows():
    gguf = pytest.importorskip("gguf")
    assert set(GGUF_ARCHS) <= set(gguf.MODEL_ARCH_NAMES.values())


def test_each_llama_layout_type_names_a_gguf_architecture_of_its_own_family():
    for family in families.FAMILIES:
        layout = getattr(__import__(f"tinyformer.families.{family.name}.hf", fromlist=["x"]), "LAYOUT", None)
        if layout is None:
            continue
        for kind in layout.types.values():
            assert GGUF_ARCHS[kind.gguf_arch] == family.name, kind.model_type


def test_each_family_folder_has_its_parts_and_one_registry_entry():
    folders = family_folders()
    assert [p.name for p in folders] == sorted(f.name for f in families.FAMILIES)
    registry = ast.parse((FOLDER / "__init__.py").read_text(encoding="utf-8"))
    listed = [n for n in ast.walk(registry) if isinstance(n, ast.AnnAssign) and ast.unparse(n.target) == "FAMILIES"]
    assert len(listed) == 1 and ast.unparse(listed[0].value).count(".FAMILY") == len(folders)
    for folder, family in zip(folders, sorted(families.FAMILIES, key=lambda f: f.name)):
        assert (folder / "hf.py").is_file(), folder  # HF config translation + tensor names
        assert (folder / "gguf.py").is_file() == bool(family.gguf), folder  # GGUF import and export maps
        assert (family.gguf_arch_for is not None) == bool(family.gguf), folder
        assert (folder / "presets.py").is_file() == bool(family.presets), folder
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))) or ""
        assert "RoPE" in doc, f"{folder.name}/__init__.py does not state its RoPE convention"
        for part in ("hf.py", "gguf.py", "presets.py"):
            if (folder / part).is_file():
                assert part in doc, f"{folder.name}/__init__.py does not list {part}"


def test_no_family_module_imports_interop():
    """The families sit below interop/: interop finds them through the registry, never the other way round."""
    for path in FOLDER.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("tinyformer.interop"), f"{path} imports {node.module}"
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("tinyformer.interop") for a in node.names), path


def test_every_family_preset_is_a_preset():
    from tinyformer.presets import PRESETS, get_preset

    names = [n for f in families.FAMILIES for n in f.presets]
    assert len(names) == len(set(names)) and set(names) <= set(PRESETS)
    assert {"llama-7b", "llama2-70b", "llama3-8b", "gpt2-124m", "gpt2-350m", "bert-base", "bert-tiny"} <= set(names)
    for name in names:
        assert get_preset(name).to_dict() == ModelConfig(**families.family_presets()[name]).to_dict()


def reference_model_type(cfg: ModelConfig) -> str:
    """The Llama-layout export decision as one table (the rule before families had folders)."""
    original = cfg.extra.get("hf_config") if isinstance(cfg.extra, dict) else None
    wanted = original.get("model_type") if isinstance(original, dict) else None
    if cfg.ffn == "moe":
        return "qwen3_moe" if cfg.qk_norm else "mixtral"
    if wanted == "phi3" and not (cfg.qk_norm or cfg.attn_bias or cfg.attn_out_bias or cfg.mlp_bias
                                 or cfg.layer_types is not None):
        return "phi3"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.sliding_window is not None:
        return "qwen2" if cfg.attn_bias else "mistral"
    if wanted == "qwen2" and cfg.attn_bias and not cfg.attn_out_bias and not cfg.mlp_bias:
        return "qwen2"
    if wanted == "mistral" and not (cfg.attn_bias or cfg.attn_out_bias or cfg.mlp_bias):
        return "mistral"
    return "llama"


def test_the_family_that_writes_a_llama_layout_model_is_the_reference_decision():
    """Over every combination of the options that pick a model type, and every model type a model was imported
    from, the registry's family and its written type are the reference decision's."""
    checked = 0
    grid = itertools.product(["swiglu", "moe"], [False, True], [False, True], [False, True], [False, True],
                             [None, 8], [None, ["full", "sliding"]],
                             [None, "llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral"])
    for ffn, qk_norm, qkv_bias, out_bias, mlp_bias, window, layer_types, imported in grid:
        if (layer_types and window is None) or (mlp_bias and ffn == "moe"):  # not valid configs
            continue
        cfg = ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, d_ff=48, max_seq_len=32, ffn=ffn,
                          n_experts=4 if ffn == "moe" else 0, qk_norm=qk_norm, attn_bias=qkv_bias,
                          attn_out_bias=out_bias, mlp_bias=mlp_bias, sliding_window=window, layer_types=layer_types,
                          extra={"hf_config": {"model_type": imported}} if imported else {})
        if layout_problem(cfg) is not None:
            with pytest.raises(ConfigError):
                families.adapter_for_model(cfg)
            continue
        want = reference_model_type(cfg)
        assert families.config_to_hf(cfg)["model_type"] == want, (cfg.to_dict(), imported)
        assert families.adapter_for_model(cfg).name == MODEL_TYPES[want]
        checked += 1
    assert checked > 50


def test_the_gguf_rope_permutation_round_trips_and_is_llama_cpps():
    from test_interop_common import permute_for_gguf

    from tinyformer.interop.gguf import unpermute_rows
    from tinyformer.interop.gguf_export import permute_rows

    w = np.random.default_rng(0).standard_normal((4 * 8, 5)).astype(np.float32)  # 4 heads of d_head 8
    stored = permute_rows(w, 4)
    np.testing.assert_array_equal(stored, permute_for_gguf(w, 4))
    assert not np.array_equal(stored, w)
    torch.testing.assert_close(unpermute_rows(torch.from_numpy(stored), 4), torch.from_numpy(w), rtol=0, atol=0)
    assert families.GGUF_ARCHS["llama"].rope_interleaved
    assert not any(a.rope_interleaved for name, a in families.GGUF_ARCHS.items() if name != "llama")
