"""Peak memory of `tinyformer convert` on a ~500M-parameter Llama checkpoint, next to a naive converter.

1. Writes a random-weight Hugging Face Llama folder (config.json + sharded model-0000i-of-0000n.safetensors
   + index), one tensor at a time, so building it needs no more than one tensor in memory. Values are
   N(0, 0.02) in --dtype (float32 by default: 500M parameters = 2.0 GB).
2. Runs, each in a fresh subprocess whose peak resident set size (ru_maxrss from os.wait4: the
   high-water mark of that one process) and wall time are recorded:
     floor    python -c "import torch, tinyformer.cli.main"    (interpreter + torch, the fixed cost)
     import   tinyformer convert --from-hf SRC --out RUN
     export   tinyformer convert --model RUN --to-hf OUT
     naive    safetensors.torch.load_file of every shard into one dict, then save_file
              (what a converter that materialises the state dict does)
3. Checks that OUT holds the same bytes as SRC for every tensor, and prints each peak as a ratio of
   the checkpoint size (the target: below 1.5x for import and export).

    python benchmarks/bench_convert.py                      # ~500M parameters, float32, in a temp folder
    python benchmarks/bench_convert.py --layers 4           # quicker, ~120M parameters
    python benchmarks/bench_convert.py --dtype bfloat16 --keep /tmp/convert-bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "bfloat16", "float16")


def llama_config(layers: int) -> dict:
    # ~495M parameters at 24 layers: vocab 32000, d 1280, 20 heads (4 kv), SwiGLU 3456, untied head
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 1280,
            "intermediate_size": 3456, "num_hidden_layers": layers, "num_attention_heads": 20,
            "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
            "hidden_act": "silu", "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def hf_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    out = [("model.embed_tokens.weight", (v, d))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (d,)), (p + "self_attn.q_proj.weight", (q, d)),
                (p + "self_attn.k_proj.weight", (kv, d)), (p + "self_attn.v_proj.weight", (kv, d)),
                (p + "self_attn.o_proj.weight", (d, q)), (p + "post_attention_layernorm.weight", (d,)),
                (p + "mlp.gate_proj.weight", (f, d)), (p + "mlp.up_proj.weight", (f, d)),
                (p + "mlp.down_proj.weight", (d, f))]
    return out + [("model.norm.weight", (d,)), ("lm_head.weight", (v, d))]


def build_checkpoint(folder: Path, layers: int, dtype_name: str, shard_bytes: int) -> tuple[int, int]:
    """Write the random checkpoint tensor by tensor; returns (parameters, bytes)."""
    import torch

    from tinyformer.safetensors_io import TensorSpec, write_planned

    dtype = getattr(torch, dtype_name)
    config = llama_config(layers)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    shapes = hf_shapes(config)
    specs = [TensorSpec(n, s, dtype) for n, s in shapes]
    gen = torch.Generator().manual_seed(0)

    def tensors():
        for name, shape in shapes:
            if name.endswith("norm.weight"):
                yield name, torch.ones(shape, dtype=dtype)
            else:
                yield name, (torch.randn(shape, generator=gen) * 0.02).to(dtype)

    folder.mkdir(parents=True, exist_ok=True)
    write_planned(folder, specs, tensors(), shard_bytes)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return sum(torch.Size(s).numel() for _, s in shapes), sum(s.nbytes for s in specs)


def measure(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(peak RSS in bytes, wall seconds) of one subprocess, from os.wait4's rusage of that process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"command failed: {' '.join(cmd)}\n{err}")
    return usage.ru_maxrss * 1024, wall  # ru_maxrss is in KiB on Linux


NAIVE = """
import sys, glob
from safetensors.torch import load_file, save_file
sd = {}
for f in sorted(glob.glob(sys.argv[1] + '/*.safetensors')):
    sd.update(load_file(f))
save_file(sd, sys.argv[2])
"""


def same_bytes(a: Path, b: Path) -> bool:
    import torch

    from tinyformer.interop.tensor_sources import open_hf_weights

    sa, sb = open_hf_weights(a), open_hf_weights(b)
    if set(sa.names()) != set(sb.names()):
        return False
    return all(torch.equal(sa.read(n).view(torch.uint8), sb.read(n).view(torch.uint8)) for n in sa.names())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24, help="decoder layers (24: ~495M parameters)")
    ap.add_argument("--dtype", choices=DTYPES, default="float32", help="checkpoint dtype (default float32)")
    ap.add_argument("--shard-size", type=int, default=600, help="source shard size in MB (default 600)")
    ap.add_argument("--keep", type=Path, default=None, help="work in this folder and keep it")
    ap.add_argument("--skip-naive", action="store_true", help="do not run the naive converter")
    ap.add_argument("--build-only", type=Path, default=None, help=argparse.SUPPRESS)  # the builder subprocess
    args = ap.parse_args()
    if args.build_only:
        n_params, n_bytes = build_checkpoint(args.build_only, args.layers, args.dtype, args.shard_size * 10**6)
        print(json.dumps([n_params, n_bytes]))
        return

    # This process stays small (no torch): a child's peak RSS counts the parent's pages it shares between
    # fork and exec, so a large parent would inflate every measurement.
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-convert-"))
    if work.exists():
        shutil.rmtree(work)
    src, run, out = work / "hf", work / "run", work / "hf-out"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    py = sys.executable
    try:
        t0 = time.perf_counter()
        built = subprocess.run([py, __file__, "--build-only", str(src), "--layers", str(args.layers), "--dtype",
                                args.dtype, "--shard-size", str(args.shard_size)], env=env, check=True,
                               capture_output=True, text=True)
        n_params, n_bytes = json.loads(built.stdout.strip().splitlines()[-1])
        print(f"checkpoint: {n_params / 1e6:.1f}M parameters, {args.dtype}, {n_bytes / 2**30:.2f} GiB "
              f"in {len(list(src.glob('*.safetensors')))} shards (built in {time.perf_counter() - t0:.0f}s)")
        runs = {
            "floor": [py, "-c", "import torch, tinyformer.cli.main"],
            "import": [py, "-m", "tinyformer", "convert", "--from-hf", str(src), "--out", str(run)],
            "export": [py, "-m", "tinyformer", "convert", "--model", str(run), "--to-hf", str(out)],
        }
        if not args.skip_naive:
            runs["naive"] = [py, "-c", NAIVE, str(src), str(work / "naive.safetensors")]
        results = {name: measure(cmd, env) for name, cmd in runs.items()}
        print(f"round trip HF -> run -> HF bit-identical: {same_bytes(src, out)}")
        print(f"{'run':8} {'peak RSS':>10} {'x checkpoint':>13} {'above floor':>12} {'wall':>8}")
        floor = results["floor"][0]
        for name, (rss, wall) in results.items():
            print(f"{name:8} {rss / 2**20:6.0f} MiB {rss / n_bytes:12.2f}x {(rss - floor) / 2**20:8.0f} MiB "
                  f"{wall:7.1f}s")
        worst = max(results["import"][0], results["export"][0])
        print(f"target: peak below 1.5x the checkpoint ({1.5 * n_bytes / 2**20:.0f} MiB): "
              f"{'met' if worst < 1.5 * n_bytes else 'NOT met'} ({worst / n_bytes:.2f}x)")
        if "naive" in results:
            print(f"naive / streaming peak: import {results['naive'][0] / results['import'][0]:.1f}x, "
                  f"export {results['naive'][0] / results['export'][0]:.1f}x")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
