"""Training step and single-token decode for the Qwen3 and mixture-of-experts shapes: tinyformer vs transformers.

Same method as bench_model.py (whose step builders and interleaved timing it reuses): both implementations hold
identical weights (written by ``export_hf`` and loaded with transformers' ``from_pretrained``, so its own checkpoint
conversions apply), their losses are checked to agree first, and timings alternate between the two so that load
from other processes hits both alike; medians are reported. The MoE shape is also timed against a dense tinyformer
model with the same active parameters per token (a SwiGLU of width k * d_ff), the cost of routing.

    python benchmarks/bench_breadth.py
    python benchmarks/bench_breadth.py --shapes qwen3 --steps 4 --decode-steps 30
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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import decode_step_fn, interleaved, train_step_fn  # noqa: E402

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--steps", type=int, default=6, help="timed training steps per implementation")
    ap.add_argument("--decode-steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--two-norms", action="store_true", help="also decode with the q/k norms as two calls")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, fp32 CPU, load average {os.getloadavg()}")
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
        ours.train()
        train = interleaved(fns, warmup=2, reps=args.steps)
        dec = interleaved(dec_fns, warmup=5, reps=args.decode_steps)
        row = {"shape": shape, "params": sum(p.numel() for p in ours.parameters()),
               "train_ms": {k: 1000 * statistics.median(v) for k, v in train.items()},
               "decode_ms": {k: 1000 * statistics.median(v) for k, v in dec.items()},
               "load_average_after": os.getloadavg()}
        rows.append(row)
        tr, de = row["train_ms"], row["decode_ms"]
        print(f"\n{shape} ({row['params'] / 1e6:.1f}M params, batch {spec['batch']} x seq {spec['seq']})")
        print(f"  train step (fwd+bwd+AdamW)  tinyformer {tr['ours']:8.1f} ms   HF {tr['hf']:8.1f} ms   "
              f"HF / tinyformer {tr['hf'] / tr['ours']:.2f}x")
        print(f"  decode 1 token (ctx 64)     tinyformer {de['ours']:8.2f} ms   HF {de['hf']:8.2f} ms   "
              f"HF / tinyformer {de['hf'] / de['ours']:.2f}x")
        if "dense" in tr:
            print(f"  dense model, same active params: train {tr['dense']:8.1f} ms (MoE / dense "
                  f"{tr['ours'] / tr['dense']:.2f}x), decode {de['dense']:8.2f} ms (MoE / dense "
                  f"{de['ours'] / de['dense']:.2f}x)")
        if "two-norms" in de:
            print(f"  decode with q/k norms as two calls {de['two-norms']:8.2f} ms (two calls / one call "
                  f"{de['two-norms'] / de['ours']:.2f}x)")
        print(f"  load average after: {row['load_average_after']}")
    print("\nJSON " + json.dumps(rows))


if __name__ == "__main__":
    main()
