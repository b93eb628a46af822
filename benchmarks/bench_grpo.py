"""GRPO step: tinyformer (`train --objective grpo`) vs TRL's GRPOTrainer, same model, prompts, G, lengths, LoRA.

Both sides start from one tinyformer decoder run that has a chat template (e.g. SmolLM2-135M-Instruct imported
with `tinyformer convert --from-gguf`), TRL from its Hugging Face export (`convert --to-hf`), so the weights are
the same. Prompts: the built-in set's import-statement questions (training split), as chat messages, rendered
by each side with the same chat template. Same G (completions per prompt), P (prompts per step), longest
completion, temperature 1 with no top-k / top-p, beta (KL to the adapter-free reference on both sides), the
loss averaged over all completion tokens (TRL's default ``loss_type="dapo"``; tinyformer's ``--grpo-loss token``),
scale by the group's std, one optimizer step per batch, AdamW, fp32, the same thread count, LoRA rank 8
(alpha 8) on q, k, v, o, gate, up and down. The reward is the same Python function on both sides
(1 if the completion, backticks stripped, equals the expected import statement).

Each implementation runs in a fresh subprocess for ``--steps`` steps; the first ``--warmup`` are dropped (the
first step of a tinyformer run also scores the held-out prompts once for report.md's "before"). A step's time
is split into sampling (the completions), scoring (the rewards), the reference pass, and the rest (the
policy's forward and backward and the optimizer step): tinyformer from metrics.jsonl (``sample_s``,
``reward_s``, ``reference_s``, ``time``), TRL by timing ``GRPOTrainer._generate``, ``_calculate_rewards``,
``_get_per_token_logps_and_entropies`` under ``no_grad`` (the reference) and ``training_step``. Peak RSS is
the child's VmHWM.

    python benchmarks/bench_grpo.py --model runs/smol --threads 2
    python benchmarks/bench_grpo.py --model runs/smol --steps 2 --warmup 1 --prompts 2 --group 4   # quick
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

from bench_model import load_hf_causal_lm, peak_rss_mib, run_json_child

RANK = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
REWARD_FILE = '''
def import_exact(prompt, completion, row):
    return float(completion.strip().strip("`").strip() == row["answer"].strip("`"))
'''


def write_prompts(n: int, out: Path) -> str:
    from tinyformer.data.chat_data import is_heldout
    from tinyformer.data.instructions import builtin_prompts

    rows = [r for r in builtin_prompts() if r["kind"] == "import" and not is_heldout(r["messages"][0]["content"], 0.1)]
    path = out / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:n]), encoding="utf-8")
    (out / "rewards.py").write_text(REWARD_FILE, encoding="utf-8")
    return str(path)


def child_ours(args: argparse.Namespace) -> dict:
    from tinyformer.cli.main import main

    out = Path(args.work) / f"ours_{os.getpid()}"
    argv = ["train", "--init-from", args.model, "--objective", "grpo", "--data", args.data, "--train.val_fraction", "0",
            "--reward", f"{Path(args.work) / 'rewards.py'}:import_exact", "--out", str(out),
            "--steps", str(args.steps), "--batch-size", str(args.prompts), "--group-size", str(args.group),
            "--max-new-tokens", str(args.new_tokens), "--temperature", "1", "--kl-beta", str(args.beta),
            "--lr", str(args.lr), "--log-interval", "1", "--eval-interval", str(args.steps + 1), "--eval-iters", "1",
            "--threads", str(args.threads), "--no-progress", "--warmup-steps", "0", "--lora-rank", str(RANK),
            "--lora-alpha", str(RANK)]
    with open(os.devnull, "w") as devnull:
        stdout, sys.stdout = sys.stdout, devnull
        try:
            rc = main(argv)
        finally:
            sys.stdout = stdout
    assert rc == 0, rc
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    times = [r["time"] for r in train]
    steps = [b - a for a, b in zip([0.0, *times], times)]
    return {"step_s": steps, "sample_s": [r["sample_s"] for r in train], "reward_s": [r["reward_s"] for r in train],
            "reference_s": [r["reference_s"] for r in train],
            "completion_length": [r["completion_length"] for r in train], "peak_mib": peak_rss_mib()}


def child_trl(args: argparse.Namespace) -> dict:
    import datasets
    import peft
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    model, tok = load_hf_causal_lm(args.hf, args.threads)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    data = datasets.Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])

    def import_exact(prompts, completions, answer, **_):  # noqa: ANN001, ANN003
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(t.strip().strip("`").strip() == a.strip("`")) for t, a in zip(texts, answer)]

    config = GRPOConfig(output_dir=str(Path(args.work) / f"trl_{os.getpid()}"), beta=args.beta,
                        per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
                        max_completion_length=args.new_tokens, temperature=1.0, top_p=1.0, top_k=0,
                        loss_type="dapo", max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
                        warmup_steps=0, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0,
                        logging_steps=10**6, save_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False,
                        dataloader_num_workers=0, disable_tqdm=True, seed=0, shuffle_dataset=False)
    peft_config = peft.LoraConfig(r=RANK, lora_alpha=RANK, lora_dropout=0.0, task_type="CAUSAL_LM",
                                  target_modules=TARGETS)
    parts: dict[str, float] = {"sample": 0.0, "reward": 0.0, "reference": 0.0}
    marks: list[dict[str, float]] = []
    steps: list[float] = []
    lengths: list[float] = []

    def timed(name: str, fn):  # noqa: ANN001, ANN202
        def wrapper(*a, **k):  # noqa: ANN002, ANN003
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if name != "reference" or not torch.is_grad_enabled():
                    parts[name] += time.perf_counter() - t0
        return wrapper

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):  # noqa: ANN002, ANN003
            self.t0 = time.perf_counter()
            parts.update(sample=0.0, reward=0.0, reference=0.0)

        def on_step_end(self, *a, **k):  # noqa: ANN002, ANN003
            steps.append(time.perf_counter() - self.t0)
            marks.append(dict(parts))
            lengths.append(trainer._metrics["train"]["completions/mean_length"][-1])

    trainer = GRPOTrainer(model=model, args=config, train_dataset=data, processing_class=tok,
                          reward_funcs=import_exact, peft_config=peft_config, callbacks=[Timer()])
    trainer._generate = timed("sample", trainer._generate)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed("reference", trainer._get_per_token_logps_and_entropies)
    trainer.train()
    return {"step_s": steps, "sample_s": [m["sample"] for m in marks], "reward_s": [m["reward"] for m in marks],
            "reference_s": [m["reference"] for m in marks], "completion_length": lengths,
            "peak_mib": peak_rss_mib()}


def run_child(kind: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--_child", kind, "--model", args.model, "--hf", args.hf, "--data", args.data,
           "--work", args.work, "--steps", str(args.steps), "--prompts", str(args.prompts), "--group",
           str(args.group), "--new-tokens", str(args.new_tokens), "--beta", str(args.beta), "--lr", str(args.lr),
           "--threads", str(args.threads)]
    return run_json_child(kind, cmd, args.threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a tinyformer decoder run with a chat template")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step (P)")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    ap.add_argument("--new-tokens", type=int, default=32, help="longest completion")
    ap.add_argument("--steps", type=int, default=3, help="steps per child process")
    ap.add_argument("--warmup", type=int, default=1, help="first steps of each child not counted")
    ap.add_argument("--rounds", type=int, default=1, help="child processes per implementation")
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--hf", default=None, help="the HF export of --model (default: written into --work)")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        print(json.dumps((child_ours if args._child == "ours" else child_trl)(args)))
        return
    from tinyformer.cli.main import main as tinyformer

    work = Path(args.work or tempfile.mkdtemp(prefix="bench_grpo_"))
    work.mkdir(parents=True, exist_ok=True)
    args.work = str(work)
    if args.hf is None:
        args.hf = str(work / "hf")
        if not (work / "hf" / "config.json").exists():
            assert tinyformer(["convert", "--model", args.model, "--to-hf", args.hf]) == 0
    args.data = write_prompts(args.prompts * args.steps, work)
    load = os.getloadavg()
    print(f"{args.model}: P {args.prompts} prompts x G {args.group} completions per step, up to {args.new_tokens} "
          f"new tokens, beta {args.beta}, LoRA r={RANK}, {args.threads} threads, {args.steps} steps per child "
          f"({args.warmup} dropped), {args.rounds} round(s); load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
          "at the start", flush=True)
    results: dict[str, list[dict]] = {"ours": [], "trl": []}
    for r in range(args.rounds):
        for kind in (("ours", "trl") if r % 2 == 0 else ("trl", "ours")):
            res = run_child(kind, args)
            results[kind].append(res)
            print(f"  round {r + 1} {kind:4s}: steps {[round(s, 2) for s in res['step_s']]} s, peak RSS "
                  f"{res['peak_mib']:.0f} MiB, load {os.getloadavg()[0]:.2f}", flush=True)
    summary = {}
    for kind, runs in results.items():
        w = args.warmup
        step = statistics.median([s for run in runs for s in run["step_s"][w:]])
        parts = {p: statistics.median([s for run in runs for s in run[f"{p}_s"][w:]])
                 for p in ("sample", "reward", "reference")}
        parts["policy forward + backward + AdamW"] = step - sum(parts.values())
        lengths = [x for run in runs for x in run["completion_length"][w:]]
        summary[kind] = {"step_s": step, "completions_per_s": args.prompts * args.group / step, "parts": parts,
                         "peak_mib": max(run["peak_mib"] for run in runs),
                         "completion_length": statistics.mean(lengths) if lengths else None}
    o, t = summary["ours"], summary["trl"]
    print(f"completions/s: tinyformer {o['completions_per_s']:.2f}, TRL {t['completions_per_s']:.2f}, ratio "
          f"{o['completions_per_s'] / t['completions_per_s']:.2f}x; peak RSS tinyformer {o['peak_mib']:.0f} MiB, "
          f"TRL {t['peak_mib']:.0f} MiB ({o['peak_mib'] / t['peak_mib']:.2f})")
    for kind in ("ours", "trl"):
        s = summary[kind]
        parts = ", ".join(f"{p} {v:.2f} s" for p, v in s["parts"].items())
        length = f"{s['completion_length']:.1f}" if s["completion_length"] is not None else "?"
        print(f"  {'tinyformer' if kind == 'ours' else 'TRL'}: step {s['step_s']:.2f} s = {parts}; mean completion "
              f"length {length} tokens")
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end")
    print("JSON " + json.dumps(summary))


if __name__ == "__main__":
    main()
