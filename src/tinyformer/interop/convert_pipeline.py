"""The conversion pipeline shared by every import and export: check, plan, write, in a staging folder.

A conversion runs in three steps, so that a bad checkpoint fails before anything is written:

1. check: the source's tensor names and shapes against those the config implies (computed by running
   the adapter on a meta-device model): missing, unknown and mis-shaped tensors are reported by name;
2. plan: run the adapter on meta tensors to learn the output names, shapes and dtypes, hence the
   safetensors headers and shard boundaries;
3. write: run the adapter on real tensors, each read from disk when the adapter asks for it and
   written as soon as it is produced (``safetensors_io.write_planned``).

Peak memory is a few tensors (one layer's q/k/v when they are concatenated), not the checkpoint. The
output is built in a hidden staging folder next to the target and renamed into place at the end, so a
failed or interrupted conversion never leaves a half-written folder; a non-empty target is refused
unless ``force`` is given.

The sources are ``interop/tensor_sources.py``; the Hugging Face folder entry points ``interop/hf_folder.py``,
GGUF ``interop/gguf.py``, sentence-transformers ``interop/hf_folder.py``; the adapters come from ``families/``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tinyformer.config import ModelConfig
from tinyformer.errors import CheckpointError, ConfigError, DataError
from tinyformer.families import adapter_for_hf
from tinyformer.integrity import write_manifest
from tinyformer.interop.tensor_sources import DictSource, MetaStateDict, TensorSource, TensorView, name_list, read_json
from tinyformer.run_folder import cast_floats
from tinyformer.safetensors_io import DEFAULT_SHARD_BYTES, INDEX, TensorSpec, write_planned
from tinyformer.sizing import check_buildable
from tinyformer.utils.io import atomic_write_bytes, atomic_write_text, replace_folder, staging_folder


def check_tensors(source: TensorSource, expected: TensorSource, ignorable: Callable[[str], bool],
                  implied_by: str) -> None:
    """Compare a source's names and shapes with what ``expected`` says; CheckpointError listing
    mis-shaped, missing and unknown tensors by name."""
    have = set(source.names())
    want = set(expected.names())
    bad = []
    for name in sorted(have & want):
        got, need = tuple(source.meta(name).shape), tuple(expected.meta(name).shape)
        if got != need:
            bad.append(f"{name} has shape {list(got)}, {implied_by} implies {list(need)}")
    if bad:
        raise CheckpointError(f"{source.description}: shape mismatch: " + "; ".join(bad[:4])
                              + (f" (and {len(bad) - 4} more)" if len(bad) > 4 else ""))
    missing = sorted(want - have)
    if missing:
        raise CheckpointError(f"{source.description}: missing tensor(s) {name_list(missing)}")
    unknown = sorted(n for n in have - want if not ignorable(n))
    if unknown:
        raise CheckpointError(f"{source.description}: unknown tensor(s) {name_list(unknown)} "
                              f"(not part of the model that {implied_by} describes)")


def plan_and_stream(produce: Callable[[Mapping[str, torch.Tensor]], Iterator[tuple[str, torch.Tensor]]],
                    source: TensorSource, dtype: torch.dtype | None
                    ) -> tuple[list[TensorSpec], Callable[[], Iterator[tuple[str, torch.Tensor]]]]:
    """Run ``produce`` on meta tensors to get the output specs, and return them with a function that
    runs it on real tensors."""
    specs: list[TensorSpec] = []
    seen: set[str] = set()
    try:
        for name, t in cast_floats(produce(TensorView(source, meta=True)), dtype):
            if name in seen:
                raise CheckpointError(f"conversion produced tensor {name!r} twice")
            seen.add(name)
            specs.append(TensorSpec(name, tuple(t.shape), t.dtype))
    except (ConfigError, KeyError, RuntimeError) as exc:  # a missing or mis-shaped input the check let through
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise CheckpointError(f"{source.description}: {msg}") from None
    return specs, lambda: cast_floats(produce(TensorView(source, meta=False)), dtype)


#: What a conversion writes (an HF export or a run folder import): ``--force`` replaces a folder holding
#: only these, and refuses one holding anything else (it would be deleted with the folder).
CONVERT_OUTPUTS = frozenset({
    "config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
    "generation_config.json", "manifest.json", "report.md",
})


@contextlib.contextmanager
def staged_output(out: str | Path, force: bool = False, inputs: tuple[Path, ...] = (),
                  also_written: frozenset[str] = frozenset()) -> Iterator[Path]:
    """Yield an empty hidden folder next to ``out``; on success it replaces ``out`` by a rename.

    Refuses a non-empty ``out`` unless ``force``, an ``out`` holding files a conversion does not write
    (even with ``force``: the swap would delete them; ``also_written`` names the files this one writes besides
    ``CONVERT_OUTPUTS``, such as the side files quantize copies), and an ``out`` that is (or contains) one of
    ``inputs``. Staging folders of the same ``out`` left by a killed conversion are removed first."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"output {out} exists and is not a folder")
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise CheckpointError(f"output {out} cannot be created: {blocker} is a file, not a folder")
    for src in inputs:
        src_r, out_r = Path(src).resolve(), out.resolve()
        if src_r == out_r or out_r in src_r.parents:
            raise CheckpointError(f"output folder {out} would overwrite the input {src}")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise CheckpointError(f"output folder {out} is not empty; pass --force to replace it")
        ours = CONVERT_OUTPUTS | also_written  # and the shards, model-*.safetensors
        foreign = sorted(p.name for p in out.iterdir() if not p.is_file() or not (
            p.name in ours or (p.name.startswith("model-") and p.name.endswith(".safetensors"))))
        if foreign:
            raise CheckpointError(f"output folder {out} holds {name_list(foreign, 3)}, which convert did not write; "
                                  "--force only replaces a previous conversion's output: move those away or "
                                  "choose another folder")
    staging = staging_folder(out, ".partial")
    try:
        yield staging
        replace_folder(staging, out, out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


@dataclass
class ConvertReport:
    """What a conversion wrote."""

    out: Path
    cfg: ModelConfig
    dtype: torch.dtype
    n_params: int
    files: list[str]
    notes: list[str] = field(default_factory=list)


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def import_checkpoint(hf_config: Mapping[str, Any], source: TensorSource, out: str | Path, *,
                      write_tokenizer: Callable[[Path], list[str]], dtype: torch.dtype | None = None,
                      max_shard_bytes: int = DEFAULT_SHARD_BYTES, force: bool = False,
                      inputs: tuple[Path, ...] = (), extra: Mapping[str, Any] | None = None) -> ConvertReport:
    """Write a run folder from a Hugging Face config dict and the HF-named tensors of ``source``.

    ``write_tokenizer(folder)`` writes the tokenizer files and returns notes for the user."""
    adapter = adapter_for_hf(hf_config)
    hf_config = adapter.align_config(hf_config, source.names())
    cfg = adapter.config_from_hf(hf_config)
    if extra:
        cfg = cfg.replace(extra={**cfg.extra, **extra})
    # the check `generate` makes before it builds the model, made before even the meta-device plan: a
    # config.json declaring 10^6 layers or 10^12 positions is refused here, not built for minutes
    n_tensors = len(source.names())
    if cfg.n_layer > n_tensors:  # every layer has a tensor of its own: 10^6 small layers may fit the memory
        raise CheckpointError(f"{source.description}: the config declares {cfg.n_layer:,} layers, but the "
                              f"checkpoint holds only {n_tensors:,} tensors; check num_hidden_layers")
    check_buildable(cfg, torch.empty(0, dtype=dtype).element_size() if dtype is not None else 2)
    expected = MetaStateDict(cfg)
    implied = DictSource(adapter.tinyformer_to_hf(cfg, expected.sd))
    check_tensors(source, implied, lambda n: adapter.ignorable_hf_tensor(cfg, n), "config.json")
    dtype = dtype or source.main_float_dtype()
    specs, stream = plan_and_stream(lambda m: adapter.hf_to_tinyformer(cfg, m), source, dtype)
    want = {n: tuple(t.shape) for n, t in expected.sd.items()}
    got = {s.name: s.shape for s in specs}
    if got != want:  # the adapter disagrees with the model code: a bug, not a user error
        raise RuntimeError(f"adapter {adapter.name} produced {sorted(set(got) ^ set(want)) or 'other shapes'}")
    with staged_output(out, force, inputs) as staging:
        weights = write_planned(staging, specs, stream(), max_shard_bytes)
        cfg.save(staging / "config.json")
        notes = write_tokenizer(staging)
        write_manifest(staging, [*weights, INDEX] if len(weights) > 1 else weights)
        files = sorted(p.name for p in staging.iterdir())
    n_params = sum(torch.Size(s.shape).numel() for s in specs)
    return ConvertReport(Path(out), cfg, dtype, n_params, files, notes)


def copy_hf_tokenizer(src: Path, dst: Path) -> list[str]:
    """tokenizer.json (checked to load), tokenizer_config.json (with special tokens from
    special_tokens_map.json and the chat template from chat_template.jinja folded in), generation_config.json."""
    notes: list[str] = []
    tok_json = src / "tokenizer.json"
    if tok_json.is_file():
        import tokenizers

        try:
            tokenizers.Tokenizer.from_file(str(tok_json))
        except Exception as exc:  # tokenizers raises plain Exceptions for malformed files
            raise DataError(f"{tok_json} is not a valid tokenizer.json: {exc}") from None
        atomic_write_bytes(dst / "tokenizer.json", tok_json.read_bytes())
        config = read_json(src / "tokenizer_config.json", "tokenizer config") \
            if (src / "tokenizer_config.json").is_file() else {}
        if (src / "special_tokens_map.json").is_file():
            for key, value in read_json(src / "special_tokens_map.json", "special tokens").items():
                config.setdefault(key, value)
        jinja = src / "chat_template.jinja"
        if "chat_template" not in config and jinja.is_file():
            config["chat_template"] = jinja.read_text(encoding="utf-8")
        config.pop("auto_map", None)  # names remote code, which is never run
        write_json(dst / "tokenizer_config.json", config)
    else:
        notes.append(f"{src} has no tokenizer.json (the fast-tokenizer format): the output has no tokenizer; "
                     "generate and chat need one")
    if (src / "generation_config.json").is_file():
        write_json(dst / "generation_config.json", read_json(src / "generation_config.json", "generation config"))
    return notes
