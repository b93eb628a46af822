"""Training step and single-token decode for the Qwen3 and mixture-of-experts shapes: tinyformer vs transformers.

Same method as bench_model.py (whose step builders and interleaved timing it reuses): both implementations hold
identical weights (written by ``export_hf`` and loaded with transformers' ``from_pretrained``, so its own checkpoint
conversions apply), their losses are checked to agree first, and timings alternate between the two so that load
from other processes hits both alike. The MoE shape is also timed against a dense tinyformer model with the same
active parameters per token (a SwiGLU of width k * d_ff), the cost of routing.

On a shared, loaded machine one median moves from run to run, so each thread count in ``--threads`` (both sides
always run with the same count) is timed in rounds: every round times each implementation once (a training step,
or ``--decode-batch`` decode steps), the order reversed every other round (A B, B A, A B, ...) so that neither
side always runs first. Printed per implementation: the median over rounds of the wall time, its spread
(min-max over rounds) and the median process CPU time (all threads; other jobs inflate it much less than the wall
time); per pair: the median of the per-round ratios and their min-max. The load average is printed before and
after each thread count.

    python benchmarks/bench_breadth.py
    python benchmarks/bench_breadth.py --shapes qwen3-moe --threads 1 2 --steps 6 --decode-steps 40
    python benchmarks/bench_breadth.py --two-norms   # also decode with q and k normalised by two separate calls

``--two-norms`` adds a decode entry for the same model with the q/k norms applied as two RMSNorm calls and a
concatenation (the computation before ``SelfAttention._norm_qk`` did both in one), to measure that change in the
same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import decode_step_fn, train_step_fn  # noqa: E402

COMMON = dict(vocab_size=8192, d_model=512, n_layer=6, n_head=8, n_kv_head=4, head_dim=64, max_seq_len=4352,
              norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=True, tie_embeddings=False)
SHAPES = {
    # a Qwen3-style dense decoder (q/k norms, GQA, explicit head_dim)
    "qwen3": dict(model=dict(COMMON, d_ff=1536), batch=4, seq=128),
    # Qwen3-MoE style: 8 experts of width 512, 2 per token (same attention as above)
    "qwen3-moe": dict(model=dict(COMMON, ffn="moe", n_experts=8, experts_per_token=2, d_ff=512,
                                 router_norm_topk=True), batch=4, seq=128),
}


def build_pair(fields: dict):
    import transformers

    from tinyformer.config import ModelConfig
    from tinyformer.interop.hf_folder import export_hf
    from tinyformer.models.decoder import DecoderLM
    from tinyformer.run_folder import save_model

    cfg = ModelConfig(**fields)
    torch.manual_seed(0)
    ours = DecoderLM(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp) / "run", ours)
        export_hf(Path(tmp) / "run", Path(tmp) / "hf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", local_files_only=True,
                                                               dtype=torch.float32, attn_implementation="sdpa")
    return cfg, ours, hf


def dense_twin(cfg):
    """A dense tinyformer model with the MoE's active parameters: SwiGLU of width k * d_ff (router aside)."""
    from tinyformer.models.decoder import DecoderLM

    torch.manual_seed(0)
    return DecoderLM(cfg.replace(ffn="swiglu", n_experts=0, d_ff=cfg.experts_per_token * cfg.d_ff))


def two_norms_twin(model):
    """A copy of ``model`` whose attention layers normalise q and k with two norm calls and a concatenation."""
    import copy
    import types

    twin = copy.deepcopy(model)

    def two_norms(self, qk):
        q, k = qk.split((self.n_head, self.n_kv_head), dim=1)
        return torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)

    for block in twin.blocks:
        block.attn._norm_qk = types.MethodType(two_norms, block.attn)
    return twin


def rounds(fns: dict, warmup: int, n_rounds: int, inner: int = 1) -> dict[str, dict[str, list[float]]]:
    """Per implementation, the wall and process-CPU seconds per call of each of ``n_rounds`` rounds; a round
    calls each implementation ``inner`` times in a row, in an order reversed every other round."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    out = {k: {"wall": [], "cpu": []} for k in fns}
    names = list(fns)
    for r in range(n_rounds):
        for k in names if r % 2 == 0 else names[::-1]:
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(inner):
                fns[k]()
            out[k]["wall"].append((time.perf_counter() - t0) / inner)
            out[k]["cpu"].append((time.process_time() - c0) / inner)
    return out


def summary(times: dict[str, dict[str, list[float]]]) -> dict:
    """Median, min and max over rounds (ms) of each implementation's wall and CPU time."""
    return {k: {kind: {"median": 1000 * statistics.median(v), "min": 1000 * min(v), "max": 1000 * max(v)}
                for kind, v in t.items()} for k, t in times.items()}


def ratio(times: dict, num: str, den: str) -> dict:
    """num / den per round (wall time): median, min, max; and the ratio of the medians."""
    per_round = [a / b for a, b in zip(times[num]["wall"], times[den]["wall"])]
    return {"median": statistics.median(per_round), "min": min(per_round), "max": max(per_round),
            "of_medians": statistics.median(times[num]["wall"]) / statistics.median(times[den]["wall"])}


def print_times(label: str, times: dict, unit_digits: int) -> None:
    s = summary(times)
    for k, v in s.items():
        w, c = v["wall"], v["cpu"]
        print(f"  {label:7s} {k:10s} wall median {w['median']:9.{unit_digits}f} ms "
              f"[{w['min']:.{unit_digits}f}-{w['max']:.{unit_digits}f}]   cpu median {c['median']:9.{unit_digits}f} ms")


def print_ratio(label: str, r: dict) -> None:
    print(f"  {label:44s} per-round median {r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}], "
          f"of medians {r['of_medians']:.2f}x")


def load() -> str:
    return " / ".join(f"{v:.1f}" for v in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--steps", type=int, default=6, help="rounds of one training step per implementation")
    ap.add_argument("--decode-steps", type=int, default=40, help="rounds of decode steps per implementation")
    ap.add_argument("--decode-batch", type=int, default=5, help="decode steps timed together in one round")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts, each timed in turn")
    ap.add_argument("--two-norms", action="store_true", help="also decode with the q/k norms as two calls")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, fp32 CPU, threads {args.threads}, load average {load()}")
    rows = []
    for shape in args.shapes:
        spec = SHAPES[shape]
        cfg, ours, hf = build_pair(spec["model"])
        x = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq"]))
        y = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq"]))
        with torch.no_grad():  # same weights, same input: the losses must agree before any timing means anything
            l_ours = float(ours.eval().loss(x, y))
            logits = hf.eval()(input_ids=x).logits
            l_hf = float(torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)))
        assert abs(l_ours - l_hf) < 1e-4, (l_ours, l_hf)
        ours.train(), hf.train()
        fns = {"ours": train_step_fn(ours, "ours", x, y), "hf": train_step_fn(hf, "hf", x, y)}
        dec_fns = {"ours": decode_step_fn(ours.eval(), "ours", cfg), "hf": decode_step_fn(hf.eval(), "hf", cfg)}
        if args.two_norms:
            twin = two_norms_twin(ours).eval()
            with torch.no_grad():
                assert torch.allclose(twin(x[:1, :16]), ours.eval()(x[:1, :16]), atol=1e-5)
            dec_fns["two-norms"] = decode_step_fn(twin, "ours", cfg)
        if cfg.ffn == "moe":
            dense = dense_twin(cfg)
            fns["dense"] = train_step_fn(dense, "ours", x, y)
            dec_fns["dense"] = decode_step_fn(dense.eval(), "ours", cfg)
        models = [ours, hf] + ([dense] if cfg.ffn == "moe" else [])
        print(f"\n{shape} ({sum(p.numel() for p in ours.parameters()) / 1e6:.1f}M params, batch {spec['batch']} x "
              f"seq {spec['seq']}; transformers experts implementation: "
              f"{getattr(hf.config, '_experts_implementation', None)})")
        for threads in args.threads:
            torch.set_num_threads(threads)
            row = {"shape": shape, "threads": threads, "load_before": load()}
            print(f" {threads} thread(s), load average before {row['load_before']}")
            for model in models:  # training mode for the steps (the MoE's balancing loss), eval for decoding
                model.train()
            train = rounds(fns, warmup=2, n_rounds=args.steps)
            for model in models:
                model.eval()
            dec = rounds(dec_fns, warmup=5, n_rounds=args.decode_steps, inner=args.decode_batch)
            row.update(train=summary(train), decode=summary(dec), load_after=load())
            print_times("train", train, 1)
            print_times("decode", dec, 2)
            row["ratios"] = {}
            for label, times in (("train", train), ("decode", dec)):
                for a, b, name in [("hf", "ours", "HF / tinyformer")] + (
                        [("ours", "dense", "MoE / dense (same active params)")] if "dense" in times else []) + (
                        [("two-norms", "ours", "two norm calls / one")] if "two-norms" in times else []):
                    r = ratio(times, a, b)
                    row["ratios"][f"{label} {name}"] = r
                    print_ratio(f"{label} {name}", r)
            print(f"  load average after {row['load_after']}")
            rows.append(row)
    print("\nJSON " + json.dumps(rows))


if __name__ == "__main__":
    main()
