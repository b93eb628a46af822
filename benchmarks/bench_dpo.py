"""DPO training step: tinyformer (`train --objective dpo`) vs TRL's DPOTrainer, same model, pairs, batch and beta.

Both sides start from one tinyformer decoder run that has a chat template (an SFT run, e.g. the README
recipe's), TRL from its Hugging Face export (`tinyformer convert --to-hf`, a LlamaForCausalLM folder), so
the weights are the same. The pairs are the first ``--pairs`` training pairs of the built-in preference
set; tinyformer renders each prompt with the run's template, and TRL gets the same rendered prompt text
and the replies followed by the template's end-of-turn token, so both score the same tokens. Same beta,
batch (pairs per step), learning rate, AdamW with the same weight decay and betas, gradient clipping 1.0,
fp32, the same thread count. LoRA: rank 8, alpha 8, on q, k, v, o, gate, up and down on both sides.

The reference log-probabilities are computed once before training on both sides (tinyformer always does;
TRL with ``precompute_ref_log_probs=True``), so a timed step is: forward of the 2B chosen + rejected
rows, the DPO loss, backward, clip, AdamW. Each implementation runs in a fresh subprocess that trains
``--steps`` steps and reports the wall time of each step (tinyformer: its metrics.jsonl with
``--log-interval 1``; TRL: a callback around each optimizer step) and the process's peak RSS (VmHWM, the
whole process: model, data, optimizer). The first ``--warmup`` steps are dropped. Rounds alternate the
order (ours, TRL, TRL, ours, ...) and the figure per implementation is the median step time over all
rounds; the spread is the min-max of the per-round ratios.

    python benchmarks/bench_dpo.py --model runs/sft                    # LoRA and full, 2 threads
    python benchmarks/bench_dpo.py --model runs/sft --rounds 1 --steps 4 --pairs 64   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench_model import load_hf_causal_lm, peak_rss_mib, run_json_child

RANK = 8


def write_pairs(run: Path, n: int, out: Path) -> dict:
    """The first ``n`` training pairs of the built-in preference set, as tinyformer reads them (prompt, chosen,
    rejected) and as TRL reads them (the prompt rendered with the run's template, replies + end-of-turn)."""
    from tinyformer.data.chat_data import is_heldout
    from tinyformer.data.chat_template import ChatTemplate
    from tinyformer.data.instructions import builtin_preferences
    from tinyformer.run_folder import load_tokenizer

    tok = load_tokenizer(run)
    if tok.chat_template is None:
        raise SystemExit(f"{run} has no chat template: give an SFT run (tinyformer train --objective sft)")
    render = ChatTemplate(tok).render
    end = render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], False)
    end_of_turn = end[end.rindex("y") + 1 :]  # what the template puts after a reply ("<|im_end|>\n" for ChatML)
    pairs = [p for p in builtin_preferences() if not is_heldout(p.prompt[0]["content"], 0.1)][:n]
    ours, trl = out / "pairs.jsonl", out / "pairs_trl.jsonl"
    with ours.open("w") as f:
        for p in pairs:
            f.write(json.dumps({"prompt": p.prompt[0]["content"], "chosen": p.chosen, "rejected": p.rejected}) + "\n")
    with trl.open("w") as f:
        for p in pairs:
            f.write(json.dumps({"prompt": render(p.prompt, True), "chosen": p.chosen + end_of_turn,
                                "rejected": p.rejected + end_of_turn}) + "\n")
    return {"ours": str(ours), "trl": str(trl)}


def child_ours(args: argparse.Namespace) -> dict:
    from tinyformer.cli.main import main

    out = Path(args.work) / f"ours_{args.mode}_{os.getpid()}"
    argv = ["train", "--init-from", args.model, "--objective", "dpo", "--data", args.data, "--out", str(out),
            "--steps", str(args.steps), "--batch-size", str(args.batch), "--lr", str(args.lr), "--dpo-beta",
            str(args.beta), "--log-interval", "1", "--eval-interval", str(args.steps + 1), "--eval-iters", "1",
            "--sample-tokens", "0", "--threads", str(args.threads), "--no-progress",
            "--warmup-steps", "0"]
    if args.mode == "lora":
        argv += ["--lora-rank", str(RANK), "--lora-alpha", str(RANK)]
    with open(os.devnull, "w") as devnull:
        stdout, sys.stdout = sys.stdout, devnull
        try:
            rc = main(argv)
        finally:
            sys.stdout = stdout
    assert rc == 0, rc
    times = [json.loads(line)["time"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    steps = [b - a for a, b in zip([0.0, *times], times)]
    return {"step_s": steps, "peak_mib": peak_rss_mib()}


def child_trl(args: argparse.Namespace) -> dict:
    import time

    import datasets
    import peft
    import transformers
    from trl import DPOConfig, DPOTrainer

    model, tok = load_hf_causal_lm(args.hf, args.threads)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    data = datasets.Dataset.from_list(rows)
    config = DPOConfig(output_dir=str(Path(args.work) / f"trl_{args.mode}_{os.getpid()}"), beta=args.beta,
                       per_device_train_batch_size=args.batch, max_steps=args.steps, learning_rate=args.lr,
                       lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.1, adam_beta1=0.9,
                       adam_beta2=0.95, max_grad_norm=1.0, max_length=args.block, precompute_ref_log_probs=True,
                       logging_steps=10**6, save_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False,
                       dataloader_num_workers=0, disable_tqdm=True, seed=0)
    peft_config = None
    if args.mode == "lora":
        peft_config = peft.LoraConfig(r=RANK, lora_alpha=RANK, lora_dropout=0.0, task_type="CAUSAL_LM",
                                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"])
    steps: list[float] = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):  # noqa: ANN002, ANN003
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):  # noqa: ANN002, ANN003
            steps.append(time.perf_counter() - self.t0)

    trainer = DPOTrainer(model=model, args=config, train_dataset=data, processing_class=tok,
                         peft_config=peft_config, callbacks=[Timer()])
    trainer.train()
    return {"step_s": steps, "peak_mib": peak_rss_mib()}


def run_child(kind: str, args: argparse.Namespace, data: str) -> dict:
    cmd = [sys.executable, __file__, "--_child", kind, "--mode", args.mode, "--model", args.model, "--hf", args.hf,
           "--data", data, "--work", args.work, "--steps", str(args.steps), "--batch", str(args.batch),
           "--beta", str(args.beta), "--lr", str(args.lr), "--threads", str(args.threads), "--block", str(args.block)]
    return run_json_child(kind, cmd, args.threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a tinyformer decoder run with a chat template (an SFT run)")
    ap.add_argument("--modes", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    ap.add_argument("--pairs", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="pairs per step")
    ap.add_argument("--steps", type=int, default=12, help="steps per child process")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each child not counted")
    ap.add_argument("--rounds", type=int, default=2, help="child processes per implementation and mode")
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="lora", help=argparse.SUPPRESS)
    ap.add_argument("--hf", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--block", type=int, default=256, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        print(json.dumps((child_ours if args._child == "ours" else child_trl)(args)))
        return
    from tinyformer.cli.main import main as tinyformer

    work = Path(args.work or tempfile.mkdtemp(prefix="bench_dpo_"))
    args.work = str(work)
    args.hf = str(work / "hf")
    if not (work / "hf" / "config.json").exists():
        assert tinyformer(["convert", "--model", args.model, "--to-hf", args.hf]) == 0
    args.block = json.loads((Path(args.model) / "config.json").read_text())["max_seq_len"]
    data = write_pairs(Path(args.model), args.pairs, work)
    load = os.getloadavg()
    print(f"{args.model}: {args.pairs} pairs, batch {args.batch} pairs, beta {args.beta}, lr {args.lr}, "
          f"{args.threads} threads, {args.steps} steps per child ({args.warmup} dropped), {args.rounds} rounds; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start", flush=True)
    rows = []
    for mode in args.modes:
        args.mode = mode
        runs: dict[str, list[list[float]]] = {"ours": [], "trl": []}
        peaks: dict[str, list[float]] = {"ours": [], "trl": []}
        for r in range(args.rounds):
            for kind in (("ours", "trl") if r % 2 == 0 else ("trl", "ours")):
                res = run_child(kind, args, data[kind])
                runs[kind].append(res["step_s"][args.warmup :])
                peaks[kind].append(res["peak_mib"])
                la = os.getloadavg()[0]
                print(f"  {mode} round {r + 1} {kind:4s}: median step {statistics.median(runs[kind][-1]):.3f} s, "
                      f"peak RSS {res['peak_mib']:.0f} MiB, load {la:.2f}", flush=True)
        med = {k: statistics.median([s for run in v for s in run]) for k, v in runs.items()}
        ratios = [statistics.median(t) / statistics.median(o) for o, t in zip(runs["ours"], runs["trl"])]
        pps = {k: args.batch / v for k, v in med.items()}
        peak = {k: max(v) for k, v in peaks.items()}
        rows.append({"mode": mode, "pairs_per_s": pps, "ratio": pps["ours"] / pps["trl"], "round_ratios": ratios,
                     "peak_mib": peak})
        name = "LoRA r=8" if mode == "lora" else "full"
        print(f"{name}: pairs/s tinyformer {pps['ours']:.2f}, TRL {pps['trl']:.2f}, "
              f"ratio {pps['ours'] / pps['trl']:.2f}x (per round {min(ratios):.2f}-{max(ratios):.2f}); peak RSS "
              f"tinyformer {peak['ours']:.0f} MiB, TRL {peak['trl']:.0f} MiB ({peak['ours'] / peak['trl']:.2f})",
              flush=True)
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end")
    print("JSON " + json.dumps(rows))


if __name__ == "__main__":
    main()
