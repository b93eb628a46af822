"""Hugging Face model folders <-> tinyformer run folders, one tensor at a time.

    HF folder                                   run folder
      config.json                  <->            config.json  (ModelConfig; the HF config kept in extra)
      model.safetensors | model-0000i-of-0000n.safetensors + model.safetensors.index.json
      (import also: pytorch_model.bin[.index.json], read with torch.load(weights_only=True))
                                   <->            model.safetensors | shards + index
      tokenizer.json               <->            tokenizer.json
      tokenizer_config.json (+ chat_template.jinja, special_tokens_map.json)
                                   <->            tokenizer_config.json (chat template inline)
      generation_config.json       <->            generation_config.json

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

The adapter registry (``ADAPTERS``, ``register_adapter``, ``Adapter``) lives in ``interop/adapter.py``
and is re-exported here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tinyformer.config import ModelConfig
from tinyformer.devices import DTYPE_NAMES, parse_dtype
from tinyformer.errors import CheckpointError, ConfigError, DataError
from tinyformer.integrity import checked_shard_names, write_manifest
from tinyformer.interop.adapter import (  # noqa: F401 - re-exported: the registry's public home
    ADAPTERS,
    Adapter,
    adapter_for_hf,
    adapter_for_model,
    adapters,
    register_adapter,
)
from tinyformer.interop.safetensors_io import SafetensorsFile, TensorSpec, write_planned
from tinyformer.utils.io import atomic_write_bytes, atomic_write_text

DEFAULT_SHARD_BYTES = 2 * 2**30


# --------------------------------------------------------------------------------------------- sources


class TensorSource:
    """Named tensors of a checkpoint on disk, read one at a time when asked for."""

    description = "checkpoint"

    def names(self) -> list[str]:
        raise NotImplementedError

    def meta(self, name: str) -> torch.Tensor:
        """A meta-device tensor with the shape and dtype ``read`` will return."""
        raise NotImplementedError

    def read(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def main_float_dtype(self) -> torch.dtype:
        """The floating dtype holding most of the parameters (the default output dtype)."""
        counts: dict[torch.dtype, int] = {}
        for name in self.names():
            t = self.meta(name)
            if t.is_floating_point():
                counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
        best = max(counts, key=counts.__getitem__) if counts else torch.float32
        return best if best in DTYPE_NAMES else torch.float32


class SafetensorsSource(TensorSource):
    """One or several safetensors files (shards) seen as one set of names."""

    def __init__(self, files: list[Path], description: str) -> None:
        self.description = description
        self._where: dict[str, SafetensorsFile] = {}
        for path in files:
            st = SafetensorsFile(path)
            for name in st.keys():
                if name in self._where:
                    raise CheckpointError(f"{description}: tensor {name!r} is stored twice "
                                          f"({self._where[name].path.name} and {path.name})")
                self._where[name] = st

    def names(self) -> list[str]:
        return list(self._where)

    def meta(self, name: str) -> torch.Tensor:
        return self._where[name].meta(name)

    def read(self, name: str) -> torch.Tensor:
        return self._where[name].read(name)


class TorchBinSource(TensorSource):
    """``pytorch_model.bin`` files, loaded with ``torch.load(weights_only=True)`` (no arbitrary unpickling),
    memory-mapped when the file is in the zip format."""

    def __init__(self, files: list[Path], description: str) -> None:
        self.description = description
        self._tensors: dict[str, torch.Tensor] = {}
        for path in files:
            if not path.is_file():
                raise CheckpointError(f"{description}: weight file {path} is missing")
            try:
                try:
                    sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError as exc:
                    if "mmap" not in str(exc):
                        raise
                    sd = torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
            except Exception as exc:  # UnpicklingError, zip errors, EOFError for truncated files
                raise CheckpointError(f"{path} cannot be loaded with torch.load(weights_only=True): "
                                      f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
            if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
                raise CheckpointError(f"{path} does not hold a state dict of tensors")
            for name, tensor in sd.items():
                if name in self._tensors:
                    raise CheckpointError(f"{description}: tensor {name!r} is stored twice")
                self._tensors[name] = tensor

    def names(self) -> list[str]:
        return list(self._tensors)

    def meta(self, name: str) -> torch.Tensor:
        t = self._tensors[name]
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    def read(self, name: str) -> torch.Tensor:
        return self._tensors[name]


class _View(Mapping[str, torch.Tensor]):
    """A source seen as a mapping, with meta tensors (planning) or real ones (writing)."""

    def __init__(self, source: TensorSource, meta: bool) -> None:
        self.source, self.is_meta = source, meta
        self._names = set(source.names())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self.source.meta(name) if self.is_meta else self.source.read(name)

    def __contains__(self, name: object) -> bool:  # without reading the tensor
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self.source.names())

    def __len__(self) -> int:
        return len(self._names)


class _MetaStateDict(TensorSource):
    """The state dict a config implies, on the meta device (what a checkpoint must contain)."""

    def __init__(self, cfg: ModelConfig) -> None:
        from tinyformer.models import build_model

        with torch.device("meta"):
            model = build_model(cfg)
        sd = model.state_dict()
        if cfg.tie_embeddings and "lm_head.weight" in sd and "tok_emb.weight" in sd:
            sd.pop("lm_head.weight")  # stored once, as the run folder does
        self.sd = sd

    def names(self) -> list[str]:
        return list(self.sd)

    def meta(self, name: str) -> torch.Tensor:
        return self.sd[name]


def read_json(path: Path, what: str, kind: type = dict) -> Any:
    """A JSON object (or, with ``kind=list``, an array) from ``path``, or CheckpointError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist ({what})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({what}): {exc}") from None
    if not isinstance(data, kind):
        raise CheckpointError(f"{path} must hold a JSON {'object' if kind is dict else 'array'} ({what})")
    return data


def open_hf_weights(folder: str | Path) -> TensorSource:
    """The weights of a Hugging Face model folder: safetensors (single or sharded) preferred, else
    ``pytorch_model.bin`` (single or sharded)."""
    folder = Path(folder)
    for stem, cls in (("model.safetensors", SafetensorsSource), ("pytorch_model.bin", TorchBinSource)):
        index = folder / f"{stem}.index.json"
        if index.is_file():
            data = read_json(index, "sharded checkpoint index")
            weight_map = data.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index} has no weight_map")
            files = checked_shard_names(index, weight_map.values())
            missing = [f for f in files if not (folder / f).is_file()]
            if missing:
                raise CheckpointError(f"{index} lists shard(s) that are missing: {', '.join(missing)}")
            source = cls([folder / f for f in files], str(folder))
            absent = sorted(set(weight_map) - set(source.names()))
            if absent:
                raise CheckpointError(f"{index} lists tensor(s) its shards do not contain: {_names(absent)}")
            return source
        if (folder / stem).is_file():
            return cls([folder / stem], str(folder))
    raise CheckpointError(f"no model.safetensors, model.safetensors.index.json or pytorch_model.bin in {folder}")


def _names(names: list[str], limit: int = 6) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


# --------------------------------------------------------------------------------------------- conversion


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
        raise CheckpointError(f"{source.description}: missing tensor(s) {_names(missing)}")
    unknown = sorted(n for n in have - want if not ignorable(n))
    if unknown:
        raise CheckpointError(f"{source.description}: unknown tensor(s) {_names(unknown)} "
                              f"(not part of the model that {implied_by} describes)")


class _Planned(TensorSource):
    def __init__(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        self.sd = dict(pairs)

    def names(self) -> list[str]:
        return list(self.sd)

    def meta(self, name: str) -> torch.Tensor:
        return self.sd[name]


def _cast(stream: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype | None
          ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in stream:
        yield name, (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()


def plan_and_stream(produce: Callable[[Mapping[str, torch.Tensor]], Iterator[tuple[str, torch.Tensor]]],
                    source: TensorSource, dtype: torch.dtype | None
                    ) -> tuple[list[TensorSpec], Callable[[], Iterator[tuple[str, torch.Tensor]]]]:
    """Run ``produce`` on meta tensors to get the output specs, and return them with a function that
    runs it on real tensors."""
    specs: list[TensorSpec] = []
    seen: set[str] = set()
    try:
        for name, t in _cast(produce(_View(source, meta=True)), dtype):
            if name in seen:
                raise CheckpointError(f"conversion produced tensor {name!r} twice")
            seen.add(name)
            specs.append(TensorSpec(name, tuple(t.shape), t.dtype))
    except (ConfigError, KeyError, RuntimeError) as exc:  # a missing or mis-shaped input the check let through
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise CheckpointError(f"{source.description}: {msg}") from None
    return specs, lambda: _cast(produce(_View(source, meta=False)), dtype)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


#: What a conversion writes (an HF export or a run folder import): ``--force`` replaces a folder holding
#: only these, and refuses one holding anything else (it would be deleted with the folder).
CONVERT_OUTPUTS = frozenset({
    "config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
    "generation_config.json", "manifest.json",
})


def _written_by_convert(name: str) -> bool:
    return name in CONVERT_OUTPUTS or (name.startswith("model-") and name.endswith(".safetensors"))


@contextlib.contextmanager
def staged_output(out: str | Path, force: bool = False, inputs: tuple[Path, ...] = ()) -> Iterator[Path]:
    """Yield an empty hidden folder next to ``out``; on success it replaces ``out`` by a rename.

    Refuses a non-empty ``out`` unless ``force``, an ``out`` holding files a conversion does not write
    (even with ``force``: the swap would delete them), and an ``out`` that is (or contains) one of ``inputs``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"output {out} exists and is not a folder")
    for src in inputs:
        src_r, out_r = Path(src).resolve(), out.resolve()
        if src_r == out_r or out_r in src_r.parents:
            raise CheckpointError(f"output folder {out} would overwrite the input {src}")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise CheckpointError(f"output folder {out} is not empty; pass --force to replace it")
        foreign = sorted(p.name for p in out.iterdir() if not _written_by_convert(p.name) or not p.is_file())
        if foreign:
            raise CheckpointError(f"output folder {out} holds {_names(foreign, 3)}, which convert did not write; "
                                  "--force only replaces a previous conversion's output: move those away or "
                                  "choose another folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        os.chmod(staging, 0o777 & ~_umask())
        yield staging
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            out.rename(old)
            staging.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            staging.rename(out)
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


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
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
    expected = _MetaStateDict(cfg)
    implied = _Planned(list(adapter.tinyformer_to_hf(cfg, expected.sd)))
    check_tensors(source, implied, lambda n: adapter.ignorable_hf_tensor(cfg, n), "config.json")
    dtype = dtype or source.main_float_dtype()
    specs, stream = plan_and_stream(lambda m: adapter.hf_to_tinyformer(cfg, m), source, dtype)
    want = {n: tuple(t.shape) for n, t in expected.sd.items()}
    got = {s.name: s.shape for s in specs}
    if got != want:  # the adapter disagrees with the model code: a bug, not a user error
        raise RuntimeError(f"adapter {adapter.name} produced {sorted(set(got) ^ set(want)) or 'other shapes'}")
    with staged_output(out, force, inputs) as staging:
        write_planned(staging, specs, stream(), max_shard_bytes)
        cfg.save(staging / "config.json")
        notes = write_tokenizer(staging)
        weights = [p.name for p in staging.iterdir() if p.name.endswith(".safetensors")]
        index = ["model.safetensors.index.json"] if (staging / "model.safetensors.index.json").is_file() else []
        write_manifest(staging, [*weights, *index])
        files = sorted(p.name for p in staging.iterdir())
    n_params = sum(torch.Size(s.shape).numel() for s in specs)
    return ConvertReport(Path(out), cfg, dtype, n_params, files, notes)


# --------------------------------------------------------------------------------------------- tokenizers

_SPECIAL_FIELDS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _copy_hf_tokenizer(src: Path, dst: Path) -> list[str]:
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
        _write_json(dst / "tokenizer_config.json", config)
    else:
        notes.append(f"{src} has no tokenizer.json (the fast-tokenizer format): the output has no tokenizer; "
                     "generate and chat need one")
    if (src / "generation_config.json").is_file():
        _write_json(dst / "generation_config.json", read_json(src / "generation_config.json", "generation config"))
    return notes


def _export_tokenizer(run: Path, dst: Path, cfg: ModelConfig, hf: dict[str, Any]) -> list[str]:
    """tokenizer.json + tokenizer_config.json (tokenizer_class, special tokens, chat template) +
    generation_config.json, for ``AutoTokenizer`` / ``generate`` of transformers. Fills the special-token
    ids of ``hf`` (the config.json) when it lacks them."""
    from tinyformer.data.tokenizer import Tokenizer

    notes: list[str] = []
    has_gen = (run / "generation_config.json").is_file()  # an imported model's own: kept as it is
    gen = read_json(run / "generation_config.json", "generation config") if has_gen else {}
    if (run / "tokenizer.json").is_file():
        tok = Tokenizer.load(run / "tokenizer.json")
        config = read_json(run / "tokenizer_config.json", "tokenizer config") \
            if (run / "tokenizer_config.json").is_file() else {}
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        for key in ("bos_token", "eos_token", "pad_token"):
            if config.get(key) is None and getattr(tok, key) is not None:
                config[key] = getattr(tok, key)
        if tok.chat_template and not config.get("chat_template"):
            config["chat_template"] = tok.chat_template
        config.setdefault("model_max_length", cfg.max_seq_len)
        config.setdefault("clean_up_tokenization_spaces", False)
        atomic_write_bytes(dst / "tokenizer.json", (run / "tokenizer.json").read_bytes())
        _write_json(dst / "tokenizer_config.json", config)
        for key, value in (("bos_token_id", tok.bos_id), ("eos_token_id", tok.eos_id), ("pad_token_id", tok.pad_id)):
            if value is not None:
                if hf.get(key) is None:
                    hf[key] = value
                if not has_gen:
                    gen[key] = value
    else:
        notes.append(f"{run} has no tokenizer.json: the exported folder has weights and config only")
    if gen:
        _write_json(dst / "generation_config.json", gen)
    return notes


# --------------------------------------------------------------------------------------------- entry points


def import_hf(src: str | Path, out: str | Path, *, dtype: str | torch.dtype | None = None,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, force: bool = False) -> ConvertReport:
    """Hugging Face model folder -> tinyformer run folder (see the module docstring). A
    sentence-transformers folder (one with ``modules.json``) keeps its pooling and normalisation too."""
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a folder (expected a Hugging Face model folder)")
    if (src / "modules.json").is_file():
        from tinyformer.interop.bert import import_sentence_transformers

        return import_sentence_transformers(src, out, dtype=dtype, max_shard_bytes=max_shard_bytes, force=force)
    hf_config = read_json(src / "config.json", "model config")
    adapter_for_hf(hf_config)  # unsupported architectures fail before the weights are opened
    source = open_hf_weights(src)
    dt = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    return import_checkpoint(hf_config, source, out, write_tokenizer=lambda dst: _copy_hf_tokenizer(src, dst),
                             dtype=dt, max_shard_bytes=max_shard_bytes, force=force, inputs=(src,))


def export_hf(run: str | Path, out: str | Path, *, dtype: str | torch.dtype | None = None,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, force: bool = False, verify: bool = True) -> ConvertReport:
    """tinyformer run folder -> Hugging Face model folder that ``transformers`` loads offline (the run's
    weights checked against its manifest first unless ``verify`` is False)."""
    from tinyformer import run_folder

    run = Path(run)
    if (run / "config.json").is_file() and "model_type" in read_json(run / "config.json", "model config"):
        raise CheckpointError(f"{run} is a Hugging Face model folder, not a tinyformer run folder; "
                              "import it with --from-hf")
    if run_folder.is_adapter_run(run):
        raise CheckpointError(f"{run} is a LoRA run (an adapter on {run_folder.read_adapter_config(run)[1]}): "
                              "export it with --merge-lora --out RUN first, or as a PEFT adapter with --to-peft DIR")
    cfg = run_folder.load_config(run)
    if "quantization" in cfg.extra:
        raise CheckpointError(f"{run} is a quantized run (int8/int4): export its float run to Hugging Face, or this "
                              "one with --to-gguf")
    adapter = adapter_for_model(cfg)
    source: TensorSource = SafetensorsSource(run_folder.checked_weight_files(run, verify), str(run))
    expected = _MetaStateDict(cfg)
    check_tensors(source, expected, lambda n: False, "config.json")
    dt = (parse_dtype(dtype) if isinstance(dtype, str) else dtype) or source.main_float_dtype()
    hf = adapter.config_to_hf(cfg)
    for key in ("torch_dtype", "dtype"):
        hf[key] = DTYPE_NAMES[dt]
    specs, stream = plan_and_stream(lambda m: adapter.tinyformer_to_hf(cfg, m), source, dt)
    with staged_output(out, force, (run,)) as staging:
        write_planned(staging, specs, stream(), max_shard_bytes)
        notes = _export_tokenizer(run, staging, cfg, hf)
        _write_json(staging / "config.json", hf)
        files = sorted(p.name for p in staging.iterdir())
    n_params = sum(torch.Size(s.shape).numel() for s in specs)
    return ConvertReport(Path(out), cfg, dt, n_params, files, notes)
