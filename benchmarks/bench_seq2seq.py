"""Train the 2017-style encoder-decoder on the synthetic tasks until held-out exact match reaches a target.

For each task (data/synthetic_tasks.py) a fresh ``transformer-tiny`` (Post-Norm, sinusoidal positions,
embeddings * sqrt(d), ReLU FFN, shared embeddings) is trained with AdamW on freshly generated examples;
every ``--eval-every`` steps greedy decoding is scored on the 1000 held-out examples (never trained
on). A task stops when exact match >= ``--target`` or when its share of the time budget is spent (the
budget left is split equally among the tasks still to run). At the end beam search (4 beams) is scored
too, on the first ``--beam-examples`` held-out examples. Optimiser: AdamW (0.9, 0.98), linear warm-up
then a cosine decay (to 5%) over the task's time budget, gradient clipping at 1. One line per
evaluation is printed, then a markdown table.

    python benchmarks/bench_seq2seq.py                         # sort, reverse, add within 15 minutes
    python benchmarks/bench_seq2seq.py --tasks add --budget-min 15
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch

from tinyformer.data.synthetic_tasks import TASKS, TaskData, task_tokenizer
from tinyformer.models.seq2seq import Seq2SeqModel
from tinyformer.presets import get_preset
from tinyformer.training.objectives.seq2seq import decode_examples, exact_match, make_batch


def train_task(name: str, args: argparse.Namespace, budget: float, clock: Callable[[], float]) -> dict:
    torch.manual_seed(args.seed)
    task = TASKS[name]
    tok = task_tokenizer()
    data = TaskData(task, n_heldout=1000)
    cfg = get_preset(args.preset, vocab_size=tok.vocab_size, pad_token_id=tok.pad_id)
    model = Seq2SeqModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed + 1)
    t0 = clock()
    step, score, history = 0, 0.0, []
    while True:
        step += 1
        # linear warm-up, then a cosine decay over the *time* budget (the number of steps a budget buys depends
        # on the machine); annealing to a small rate is what turns a low loss into exact outputs
        progress = min(1.0, (clock() - t0) / (budget * 0.95))
        for group in opt.param_groups:
            decay = 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))
            group["lr"] = args.lr * min(1.0, step / args.warmup) * decay
        batch = make_batch(data.train_examples(args.batch, g), tok)
        loss = model.loss(batch["src_ids"], batch["tgt_in"], batch["tgt_out"], batch["src_mask"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        elapsed = clock() - t0
        if step % args.eval_every == 0 or elapsed > budget * 0.95:  # 5% is kept for the beam-search score
            score = exact_match(model, tok, data.heldout)
            history.append((step, round(elapsed), score))
            print(f"  {name:<8} step {step:>6}  loss {loss.item():.4f}  held-out exact match {score:.1%}  "
                  f"{elapsed:.0f}s", flush=True)
            if score >= args.target or elapsed > budget * 0.95:
                break
    seconds = clock() - t0
    outputs = decode_examples(model, tok, data.heldout)
    wrong = [src for (src, tgt), out in zip(data.heldout, outputs) if out != tgt]
    by_length: dict[int, int] = {}
    for src in wrong:
        by_length[len(src)] = by_length.get(len(src), 0) + 1
    if wrong:
        print(f"  {name}: {len(wrong)} held-out errors by source length: {dict(sorted(by_length.items()))}; "
              f"e.g. {', '.join(wrong[:5])}", flush=True)
    beam = exact_match(model, tok, data.heldout[: args.beam_examples], num_beams=4, batch_size=100)
    return {"task": name, "description": task.description, "steps": step, "examples": step * args.batch,
            "seconds": seconds, "greedy": score, "beam4": beam, "reached": score >= args.target,
            "params": sum(p.numel() for p in model.parameters()), "history": history}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", nargs="+", default=["sort", "reverse", "add"], choices=sorted(TASKS))
    p.add_argument("--preset", default="transformer-tiny")
    p.add_argument("--budget-min", type=float, default=15.0,
                   help="time budget of the whole run, minutes, shared by the tasks (evaluation included)")
    p.add_argument("--target", type=float, default=0.99, help="held-out greedy exact match to stop at")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1 is fastest for these small matrices)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="what the budget counts: this process's CPU time (default; on an idle machine with one "
                        "thread it equals wall time, and other jobs on a shared machine do not eat into it) or "
                        "wall-clock time")
    p.add_argument("--beam-examples", type=int, default=300, help="held-out examples scored with beam search")
    args = p.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    wall0 = time.perf_counter()
    results = []
    t0 = clock()
    for i, name in enumerate(args.tasks):
        # the time left is shared equally by the tasks still to run: one that finishes early leaves its rest
        budget = (args.budget_min * 60 - (clock() - t0)) / (len(args.tasks) - i)
        print(f"{name}: {TASKS[name].description} (time budget {budget / 60:.1f} min)", flush=True)
        results.append(train_task(name, args, budget, clock))
    total = clock() - t0
    wall = time.perf_counter() - wall0
    print(f"\n{args.preset}, batch {args.batch}, AdamW peak lr {args.lr:g} (warm-up {args.warmup}, cosine over the "
          f"budget), {torch.get_num_threads()} CPU thread(s); total {total / 60:.1f} min of {args.clock} time "
          f"({wall / 60:.1f} min wall clock)\n")
    print(f"| task | parameters | steps | examples seen | time | held-out exact match (greedy, 1000) "
          f"| beam 4 ({args.beam_examples}) | target {args.target:.0%} |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        print(f"| {r['task']}: {r['description']} | {r['params']:,} | {r['steps']:,} | {r['examples']:,} | "
              f"{r['seconds'] / 60:.1f} min | {r['greedy']:.1%} | {r['beam4']:.1%} | "
              f"{'reached' if r['reached'] else 'NOT reached'} |")


if __name__ == "__main__":
    main()
