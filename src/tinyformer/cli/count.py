"""`tinyformer count`: parameters per component, training FLOPs, KV-cache and attention memory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tinyformer.cli.common import format_count, load_model_config
from tinyformer.errors import ConfigError
from tinyformer.presets import get_preset, preset_names
from tinyformer.sizing import sizing_report


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("count", help="parameters, FLOPs and memory of a model shape",
                       description="Count parameters (exact), training FLOPs per token, KV-cache bytes and "
                                   "attention memory for a preset or a config file.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help=f"one of: {', '.join(preset_names())}")
    src.add_argument("--config", help="a run folder, config.json, or YAML/TOML model config")
    p.add_argument("--seq-len", type=int, default=None, help="context length T (default: max_seq_len)")
    p.add_argument("--batch", type=int, default=1, help="batch size B for the memory figures")
    p.add_argument("--dtype", default="bfloat16", help="element type for memory figures (default bfloat16)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-verify", action="store_true",
                   help="skip building the model on the meta device to check the total")
    p.set_defaults(func=run)


def _bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def run(args: argparse.Namespace) -> int:
    cfg = get_preset(args.preset) if args.preset else load_model_config(args.config)
    if args.seq_len is not None and args.seq_len <= 0:
        raise ConfigError("--seq-len must be positive")
    report = sizing_report(cfg, seq_len=args.seq_len, batch=args.batch, dtype=args.dtype)
    if not args.no_verify:  # the real model built on the meta device (shapes only, no memory)
        from tinyformer.models import meta_model

        actual = sum(p.numel() for p in meta_model(cfg).parameters())
        if actual != report["total_params"]:  # a bug in the formulas, not a user error
            raise AssertionError(f"formula gives {report['total_params']} but the model has {actual} parameters")
        report["verified_on_meta_device"] = True
    report["name"] = args.preset or str(args.config)
    from tinyformer.run_folder import load_config, quant_spec, tensor_bytes

    spec = quant_spec(load_config(args.config)) if args.config and Path(args.config).is_dir() else None
    if spec is not None:  # a quantized run: what its files and memory really hold
        report["quantization"], report["stored_weights_bytes"] = spec.to_dict(), tensor_bytes(args.config)
    if args.json:
        print(json.dumps(report))
        return 0
    p, kv, att = report["params"], report["kv_cache"], report["attention_memory"]
    # the parameter rows in this order, then any other count of the report under its own name
    labels = {"embedding": "embedding", "positions": "positions", "attention_per_layer": "attention / layer",
              "ffn_per_layer": "ffn / layer", "norms_per_layer": "norms / layer",
              "all_layers": f"all {p['n_layer']:>3} layers", "final_norm": "final_norm", "head": "head"}
    rows = [*labels, *(key for key in p if key not in labels and key not in ("per_layer", "n_layer"))]
    lines = [
        f"model: {report['name']}  (d_model {cfg.d_model}, {cfg.n_layer} layers, {cfg.n_head} heads, "
        f"{cfg.n_kv_head} kv heads, d_ff {cfg.d_ff}, vocab {cfg.vocab_size})",
        "",
        "parameters",
        *(f"  {labels.get(key, key):<20} {p[key]:>18,}" for key in rows),
        f"  total                {report['total_params']:>18,}  ({format_count(report['total_params'])})",
        f"  without embeddings   {report['non_embedding_params']:>18,}",
        *([f"  active per token     {report['active_params']:>18,}  ({format_count(report['active_params'])}; "
           f"{cfg.experts_per_token} of {cfg.n_experts} experts)"]
          if report["active_params"] != report["total_params"] else []),
        f"  attention : ffn      1 : {1 / report['attention_to_ffn_ratio']:.2f}",
        "",
        f"compute (T={report['seq_len']})",
        f"  training FLOPs/token {report['training_flops_per_token']:>18,}  "
        f"(6N alone: {report['training_flops_per_token_6n']:,})",
        "",
        f"memory ({report['dtype']}, batch {report['batch']}, T={report['seq_len']})",
        f"  weights              {_bytes(report['weights_bytes']):>18}",
        f"  KV cache / token     {_bytes(kv['bytes_per_token']):>18}  (MHA would need "
        f"{_bytes(kv['bytes_per_token_if_mha'])})",
        f"  KV cache total       {_bytes(kv['bytes_total']):>18}",
        f"  naive T x T scores   {_bytes(att['naive_scores_bytes_per_layer']):>18} per layer, "
        f"{_bytes(att['naive_scores_bytes_all_layers'])} kept for backward over all layers",
        f"  SDPA (flash) extra   {_bytes(att['sdpa_bytes_per_layer']):>18} per layer",
    ]
    if spec is not None:
        lines.append(f"  stored weights       {_bytes(report['stored_weights_bytes']):>18}  ({spec.type}, group_size "
                     f"{spec.group_size}: the quantized run's tensors)")
    if not args.no_verify:
        lines += ["", "total checked against the model built on the meta device: equal"]
    print("\n".join(lines))
    return 0
