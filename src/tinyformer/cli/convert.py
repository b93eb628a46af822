"""`tinyformer convert`: Hugging Face folders and GGUF files in, Hugging Face folders out.

    tinyformer convert --from-hf DIR   --out RUN     HF folder (safetensors or pytorch_model.bin) -> run folder
    tinyformer convert --from-gguf FILE --out RUN    llama.cpp GGUF (float or quantized)          -> run folder
    tinyformer convert --model RUN --to-hf DIR       run folder -> HF folder for transformers
    tinyformer convert --model LORA_RUN --merge-lora --out RUN   LoRA run -> plain run (adapter merged)
    tinyformer convert --model LORA_RUN --to-peft DIR            LoRA run -> PEFT adapter folder
    tinyformer convert --model RUN --to-gguf FILE [--type f32|f16|bf16|q8_0|q4_0]   run folder -> GGUF (llama.cpp)
    tinyformer convert --from-gguf FILE --out RUN --keep-quant   Q8_0 / Q4_0 / Q4_1 kept as int8 / int4

A run folder is what ``generate``, ``chat``, ``eval`` and ``train --init-from`` read.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from tinyformer.errors import ConfigError


def parse_size(text: str) -> int:
    """'2GB', '500MB', '1GiB', '123' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ConfigError(f"--max-shard-size {text!r} is not a size like 2GB or 500MB")
    unit = (m.group(2) or "").upper().rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit.rstrip("I")]
    size = int(float(m.group(1)) * base**power)
    if size <= 0:
        raise ConfigError("--max-shard-size must be positive")
    return size


def model_summary(cfg) -> str:
    """The model as the summary line and the report card say it, its positions last: 'rope (llama3 scaling)',
    'learned positions', ..."""
    if cfg.pos == "rope":
        positions = "rope" if cfg.rope_type == "default" else f"rope ({cfg.rope_type} scaling)"
    else:
        positions = {"learned": "learned positions", "sinusoidal": "sinusoidal positions"}.get(cfg.pos, "no positions")
    return (f"{cfg.arch}, {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads ({cfg.n_kv_head} kv), "
            f"vocab {cfg.vocab_size}, context {cfg.max_seq_len}, {positions}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert", help="import Hugging Face / GGUF checkpoints, export to Hugging Face",
        description="Convert checkpoints, streaming one tensor at a time. Import: --from-hf DIR or --from-gguf "
                    "FILE with --out RUN (a tinyformer run folder). Export: --model RUN --to-hf DIR (a folder "
                    "transformers.AutoModelForCausalLM.from_pretrained loads). Supported: Llama 1/2/3, Mistral, "
                    "Qwen2, GPT-2, BERT and sentence-transformers folders (and any adapter registered in "
                    "tinyformer.interop).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="DIR", help="Hugging Face model folder to import")
    src.add_argument("--from-gguf", metavar="FILE", help="GGUF file (llama.cpp) to import")
    src.add_argument("--model", metavar="RUN", help="tinyformer run folder to export (with --to-hf)")
    p.add_argument("--out", metavar="RUN", help="run folder to write (imports)")
    p.add_argument("--to-hf", metavar="DIR", help="Hugging Face folder to write (exports)")
    p.add_argument("--to-peft", metavar="DIR", help="with --model LORA_RUN: write a PEFT adapter folder for the "
                   "--to-hf export of its base run")
    p.add_argument("--merge-lora", action="store_true", help="with --model LORA_RUN --out RUN: write a plain run "
                   "with the adapter merged into the weights")
    p.add_argument("--to-gguf", metavar="FILE", help="GGUF file to write (exports; llama.cpp / Ollama load it)")
    p.add_argument("--type", choices=("f32", "f16", "bf16", "q8_0", "q4_0"), default="f32",
                   help="--to-gguf: how the weight matrices are stored (default f32)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="stored precision (default: the source's; float32 for quantized GGUF)")
    p.add_argument("--max-shard-size", default="2GiB", help="split weights into files of at most this size "
                   "(default 2GiB)")
    p.add_argument("--force", action="store_true", help="replace an output folder holding a previous conversion "
                   "(a folder holding other files is refused)")
    p.add_argument("--no-verify", action="store_true", help="export the run's weights without checking them "
                   "against its manifest.json checksums")
    p.add_argument("--keep-quant", action="store_true",
                   help="--from-gguf: keep Q8_0 / Q4_0 / Q4_1 matrices as int8 / int4 (groups of 32) instead of "
                        "dequantizing them; K-quants are rounded into the nearest of those (reported)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    shard = parse_size(args.max_shard_size)
    if args.keep_quant and not args.from_gguf:
        raise ConfigError("--keep-quant applies to --from-gguf imports only")
    kwargs = dict(dtype=args.dtype, max_shard_bytes=shard, force=args.force)
    started = time.perf_counter()
    if args.model and args.to_gguf:
        if args.to_hf or args.out:
            raise ConfigError("--to-gguf FILE is the only output of a GGUF export (not --to-hf / --out)")
        from tinyformer.interop.gguf_export import export_gguf

        notes = export_gguf(args.model, args.to_gguf, args.type, force=args.force)
        size = Path(args.to_gguf).stat().st_size
        print(f"wrote {args.to_gguf}  ({args.type}, {size / 2**20:.2f} MiB, {time.perf_counter() - started:.1f}s)")
        for note in notes:
            print(f"  note: {note}")
        return 0
    if args.model and (args.merge_lora or args.to_peft):
        from tinyformer.interop.peft import export_peft, merge_run

        if args.merge_lora and (not args.out or args.to_hf or args.to_peft):
            raise ConfigError("--merge-lora writes a run folder: --model LORA_RUN --merge-lora --out RUN")
        if args.to_peft and (args.out or args.to_hf):
            raise ConfigError("--to-peft writes only the adapter folder: --model LORA_RUN --to-peft DIR")
        report = (merge_run(args.model, args.out, **kwargs) if args.merge_lora
                  else export_peft(args.model, args.to_peft, dtype=args.dtype, force=args.force))
    elif args.model:
        if not args.to_hf or args.out:
            raise ConfigError("--model RUN exports and needs --to-hf DIR or --to-gguf FILE (not --out)")
        from tinyformer.interop.hf_folder import export_hf

        report = export_hf(args.model, args.to_hf, verify=not args.no_verify, **kwargs)
    else:
        if args.merge_lora or args.to_peft:
            raise ConfigError("--merge-lora and --to-peft read a LoRA run: --model LORA_RUN")
        if not args.out or args.to_hf:
            raise ConfigError("--from-hf/--from-gguf import and need --out RUN (not --to-hf)")
        if args.from_hf:
            from tinyformer.interop.hf_folder import import_hf

            report = import_hf(args.from_hf, args.out, **kwargs)
        elif args.keep_quant:
            if args.dtype:
                raise ConfigError("--keep-quant keeps the file's int8/int4 bits; --dtype does not apply")
            from tinyformer.interop.gguf import import_gguf_keep_quant

            report = import_gguf_keep_quant(args.from_gguf, args.out, max_shard_bytes=shard, force=args.force)
        else:
            from tinyformer.interop.gguf import import_gguf

            report = import_gguf(args.from_gguf, args.out, **kwargs)
    dtype = str(report.dtype).removeprefix("torch.")
    if args.merge_lora or args.from_hf or args.from_gguf:  # a run folder: it gets its own report card
        write_card(args, report, dtype)
    print(f"wrote {report.out}  ({report.n_params / 1e6:.2f}M parameters, {dtype}, "
          f"{time.perf_counter() - started:.1f}s)")
    print(f"  model: {model_summary(report.cfg)}")
    print(f"  files: {', '.join(report.files)}")
    for note in report.notes:
        print(f"  note: {note}")
    return 0


def write_card(args: argparse.Namespace, report, dtype: str) -> None:
    """The written run folder's own report.md (report_card.py): what it is, from what, with which
    settings, and where the parent's card is (a LoRA run's; an HF folder or a GGUF file has none)."""
    from tinyformer.report_card import write_derived_card

    if args.merge_lora:
        what, parent = "a LoRA run with its adapter merged into the base weights (a plain run)", args.model
    elif args.from_hf:
        what, parent = "a Hugging Face model folder imported into a run folder (no training here)", args.from_hf
    else:
        kept = "its Q8_0 / Q4_0 / Q4_1 matrices kept as int8 / int4" if args.keep_quant else "dequantized"
        what, parent = f"a GGUF file imported into a run folder ({kept}; no training here)", args.from_gguf
    settings = [("model", model_summary(report.cfg)), ("parameters", f"{report.n_params:,}"),
                ("stored as", f"`{dtype}`"), ("command", f"`tinyformer convert {' '.join(_given_flags(args))}`")]
    write_derived_card(report.out, what, parent, settings, [f"- note: {n}" for n in report.notes])


def _given_flags(args: argparse.Namespace) -> list[str]:
    """The flags of this conversion as typed (those that differ from their defaults), for its report card."""
    flags = []
    for name in ("from_hf", "from_gguf", "model", "out", "dtype", "max_shard_size", "keep_quant", "merge_lora"):
        value = getattr(args, name)
        if value in (None, False) or (name == "max_shard_size" and value == "2GiB"):
            continue
        flag = "--" + name.replace("_", "-")
        flags.append(flag if value is True else f"{flag} {value}")
    return flags
