"""`tinyformer quantize`: a float run folder -> an int8 / int4 weight-only quantized run folder.

    tinyformer quantize --model RUN --out QRUN --type int8
    tinyformer quantize --model RUN --out QRUN --type int4 --group-size 32 --report

Every command that loads a run (generate, chat, serve, eval, inspect, embed) loads the result. The formats
and kernels are described in ``tinyformer.components.quantized``; the folder layout in ``tinyformer.quantization``.
"""

from __future__ import annotations

import argparse
import json
import time

from tinyformer.components.quantized import KERNELS, QUANT_TYPES, QuantSpec

DEFAULT_INT4_GROUP = 32


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="int8 / int4 weight-only quantization of a run folder",
                       description="Write a quantized copy of a run folder: every linear layer's weight as int8 or "
                                   "int4 values with float32 scales per group (weight-only, no calibration data).")
    p.add_argument("--model", required=True, metavar="RUN", help="float run folder to quantize")
    p.add_argument("--out", required=True, metavar="QRUN", help="run folder to write")
    p.add_argument("--type", required=True, choices=QUANT_TYPES, help="int8 or int4")
    p.add_argument("--group-size", type=int, default=None, metavar="G",
                   help=f"input values per scale (int8 default: 0 = one scale per output row; int4 default: "
                        f"{DEFAULT_INT4_GROUP})")
    p.add_argument("--kernel", choices=KERNELS, default="auto",
                   help="matmul used when the run is loaded (default auto; see docs/benchmarks/quantized.md)")
    p.add_argument("--report", action="store_true", help="print each layer's quantization error")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tinyformer.quantization import quantize_run

    group = args.group_size if args.group_size is not None else (DEFAULT_INT4_GROUP if args.type == "int4" else 0)
    spec = QuantSpec(args.type, group, args.kernel)
    started = time.perf_counter()
    report = quantize_run(args.model, args.out, spec, force=args.force, layer_errors=args.report)
    seconds = time.perf_counter() - started
    write_card(args, spec, report)
    if args.json:
        out = {"out": str(report.out), "quantization": spec.to_dict(), "float_bytes": report.float_bytes,
               "quantized_bytes": report.quantized_bytes, "seconds": round(seconds, 3)}
        if args.report:
            out["layers"] = [{"name": e.name, "shape": list(e.shape), "max_abs_error": e.max_abs,
                              "relative_error": e.relative} for e in report.layers]
        print(json.dumps(out))
        return 0
    g = "per output channel" if spec.group_size == 0 else f"groups of {spec.group_size}"
    print(f"wrote {report.out}  ({spec.type}, {g}; weights {report.float_bytes / 2**20:.2f} MiB -> "
          f"{report.quantized_bytes / 2**20:.2f} MiB, {seconds:.1f}s)")
    print(f"  files: {', '.join(report.files)}")
    if args.report:
        print(f"  {'layer':<32} {'shape':>14} {'max |error|':>12} {'rel. error':>11}")
        for e in report.layers:
            print(f"  {e.name:<32} {str(tuple(e.shape)):>14} {e.max_abs:12.3e} {e.relative:11.3e}")
    return 0


def write_card(args: argparse.Namespace, spec: QuantSpec, report) -> None:
    """The quantized run's own report.md (report_card.py): what it is, from which run, the settings,
    the weight sizes and, with --report, each layer's error; the float run's card stays in the float run."""
    from tinyformer.report_card import write_derived_card

    g = "one scale per output row" if spec.group_size == 0 else f"groups of {spec.group_size} input values per scale"
    settings = [("type", f"`{spec.type}`, weight-only, float32 scales ({g})"), ("kernel", f"`{spec.kernel}`"),
                ("weights", f"{report.float_bytes / 2**20:.2f} MiB -> {report.quantized_bytes / 2**20:.2f} MiB")]
    extra: list[str] = []
    if args.report:
        extra = ["## Quantization error per layer", "", "the error of each dequantized weight W' against the "
                 "float weight W: max |W' - W| and ||W' - W|| / ||W||", "",
                 "| layer | shape | max abs error | relative error |", "|---|---|---|---|"]
        extra += [f"| {e.name} | {tuple(e.shape)} | {e.max_abs:.3e} | {e.relative:.3e} |" for e in report.layers]
    write_derived_card(report.out, f"{spec.type} weight-only quantization of a float run", args.model, settings,
                       extra)
