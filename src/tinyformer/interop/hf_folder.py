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

Both directions run the check / plan / write steps of ``interop/convert_pipeline.py`` on the tensor
sources of ``interop/tensor_sources.py``. The adapters come from the family registry (``families/__init__.py``:
``adapter_for_hf``, ``adapter_for_model``, ``register_adapter``). A sentence-transformers folder (``modules.json``)
is read with the bert family's ``read_sentence_transformers`` and imported here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tinyformer.config import ModelConfig
from tinyformer.devices import DTYPE_NAMES, parse_dtype
from tinyformer.errors import CheckpointError, ConfigError
from tinyformer.families import adapter_for_hf, adapter_for_model
from tinyformer.families.bert.sentence_transformers import read_sentence_transformers
from tinyformer.interop.convert_pipeline import (
    ConvertReport,
    check_tensors,
    copy_hf_tokenizer,
    import_checkpoint,
    plan_and_stream,
    staged_output,
    write_json,
)
from tinyformer.interop.tensor_sources import MetaStateDict, SafetensorsSource, TensorSource, open_hf_weights, read_json
from tinyformer.safetensors_io import DEFAULT_SHARD_BYTES, write_planned
from tinyformer.utils.io import atomic_write_bytes


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
        write_json(dst / "tokenizer_config.json", config)
        for key, value in (("bos_token_id", tok.bos_id), ("eos_token_id", tok.eos_id), ("pad_token_id", tok.pad_id)):
            if value is not None:
                if hf.get(key) is None:
                    hf[key] = value
                if not has_gen:
                    gen[key] = value
    else:
        notes.append(f"{run} has no tokenizer.json: the exported folder has weights and config only")
    if gen:
        write_json(dst / "generation_config.json", gen)
    return notes


def import_hf(src: str | Path, out: str | Path, *, dtype: str | torch.dtype | None = None,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, force: bool = False) -> ConvertReport:
    """Hugging Face model folder -> tinyformer run folder (see the module docstring). A
    sentence-transformers folder (one with ``modules.json``) keeps its pooling and normalisation too."""
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a folder (expected a Hugging Face model folder)")
    if (src / "modules.json").is_file():
        return import_sentence_transformers(src, out, dtype=dtype, max_shard_bytes=max_shard_bytes, force=force)
    hf_config = read_json(src / "config.json", "model config")
    adapter_for_hf(hf_config)  # unsupported architectures fail before the weights are opened
    return import_checkpoint(hf_config, open_hf_weights(src), out,
                             write_tokenizer=lambda dst: copy_hf_tokenizer(src, dst), dtype=parse_dtype(dtype),
                             max_shard_bytes=max_shard_bytes, force=force, inputs=(src,))


def import_sentence_transformers(src: str | Path, out: str | Path, *, dtype: str | torch.dtype | None = None,
                                 max_shard_bytes: int | None = None, force: bool = False) -> ConvertReport:
    """A sentence-transformers folder -> a tinyformer run folder (``families/bert/sentence_transformers.py``)."""
    src = Path(src)
    transformer_dir, info = read_sentence_transformers(src, read_json)
    hf_config = read_json(transformer_dir / "config.json", "model config")
    if hf_config.get("model_type") != "bert":
        raise ConfigError(f"{transformer_dir}: model_type {hf_config.get('model_type')!r} is not supported in a "
                          "sentence-transformers folder (supported: bert)")
    return import_checkpoint(
        hf_config, open_hf_weights(transformer_dir), out,
        write_tokenizer=lambda dst: copy_hf_tokenizer(transformer_dir, dst),
        dtype=parse_dtype(dtype), max_shard_bytes=max_shard_bytes or DEFAULT_SHARD_BYTES, force=force,
        inputs=(src,), extra={"sentence_transformers": info},
    )


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
    expected = MetaStateDict(cfg)
    check_tensors(source, expected, lambda n: False, "config.json")
    dt = parse_dtype(dtype) or source.main_float_dtype()
    hf = adapter.config_to_hf(cfg)
    for key in ("torch_dtype", "dtype"):  # transformers 4's and 5's name of the weights' dtype
        hf[key] = DTYPE_NAMES[dt]
    specs, stream = plan_and_stream(lambda m: adapter.tinyformer_to_hf(cfg, m), source, dt)
    with staged_output(out, force, (run,)) as staging:
        write_planned(staging, specs, stream(), max_shard_bytes)
        notes = _export_tokenizer(run, staging, cfg, hf)
        write_json(staging / "config.json", hf)
        files = sorted(p.name for p in staging.iterdir())
    n_params = sum(torch.Size(s.shape).numel() for s in specs)
    return ConvertReport(Path(out), cfg, dt, n_params, files, notes)
