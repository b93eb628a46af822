"""`tinyformer train`: train a language model (or another objective) and write a run folder.

With no arguments it trains the default model on the built-in corpus (CPython's docs), offline.
Config precedence, lowest first: built-in defaults < --config FILE < --set section.field=value <
--model.FIELD / --train.FIELD VALUE < the named flags (--lr, --steps, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from typing import Any

from tinyformer.cli.common import format_count
from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError
from tinyformer.training.train_config import TrainConfig, apply_override, coerce_field, parse_value, read_run_file
from tinyformer.utils.threads import configured_threads

# flag -> (TrainConfig field, type, help); all default to None = "not given"
TRAIN_FLAGS: list[tuple[tuple[str, ...], str, Any, str]] = [
    (("--data",), "data", str, "corpus: a text file, a folder of .txt/.md, a glob, a .jsonl file or hf:NAME "
                               "(default: the built-in corpus); for sft/dpo a chat or preference .jsonl file, for "
                               "grpo a prompts .jsonl file (default: the built-in instruction / preference set)"),
    (("--text-field",), "text_field", str, "JSONL field holding the text (default: text)"),
    (("--tokenizer",), "tokenizer", str, "char, bpe (trained on the corpus) or a tokenizer.json path (default bpe)"),
    (("--vocab-size",), "vocab_size", int, "BPE vocabulary size (default 4096)"),
    (("--init-from",), "init_from", str, "start from another run's weights and tokenizer (fine-tuning)"),
    (("--lora-rank",), "lora_rank", int, "train LoRA adapters of rank R on the frozen --init-from model "
                                         "(the run folder stores the adapter only)"),
    (("--lora-alpha",), "lora_alpha", float, "LoRA scale numerator: updates enter as alpha/R B A x (default R)"),
    (("--lora-dropout",), "lora_dropout", float, "dropout on the LoRA adapters' input (default 0)"),
    (("--lora-targets",), "lora_targets", str, "projections to adapt, comma-separated among q,k,v,o,gate,up,down "
                                               "(default all)"),
    (("--objective",), "objective", str, "training objective: clm (default, causal language modelling), sft, "
                                         "dpo, grpo, mlm, seq2seq"),
    (("--task",), "task", str, "synthetic task name, for objectives that have tasks"),
    (("--dpo-beta",), "dpo_beta", float, "objective dpo: beta of the DPO loss (default 0.1)"),
    (("--reward-timeout",), "reward_timeout", float, "objective grpo: seconds one reward call may take (default 10)"),
    (("--group-size",), "group_size", int, "objective grpo: completions sampled per prompt (default 8; at least 2)"),
    (("--max-new-tokens",), "max_new_tokens", int, "objective grpo: longest completion in tokens (default 32)"),
    (("--temperature",), "temperature", float, "objective grpo: sampling temperature (default 1)"),
    (("--kl-beta",), "kl_beta", float, "objective grpo: weight of the KL to the reference (default 0.04; 0 = none)"),
    (("--clip-eps",), "clip_eps", float, "objective grpo: clip the probability ratio to [1-E, 1+E] (default 0.2)"),
    (("--ppo-epochs",), "ppo_epochs", int, "objective grpo: optimizer steps on each sampled batch (default 1)"),
    (("--grpo-loss",), "grpo_loss", str, "objective grpo: token (mean over all completion tokens, TRL's default) "
                                         "or sequence (mean per completion, then over completions)"),
    (("--eval-data",), "eval_data", str, "objective grpo: held-out prompts (default: 10%% of --data)"),
    (("--steps", "--max-steps"), "max_steps", int, "optimizer steps"),
    (("--batch-size",), "batch_size", int, "sequences per micro-batch (per device)"),
    (("--grad-accum",), "grad_accum", int, "micro-batches per optimizer step"),
    (("--block-size",), "block_size", int, "tokens per sequence (default: the model's max_seq_len)"),
    (("--lr",), "lr", float, "peak learning rate"),
    (("--min-lr",), "min_lr", float, "learning-rate floor of the decay (default lr/10)"),
    (("--warmup-steps",), "warmup_steps", int, "linear warm-up steps"),
    (("--weight-decay",), "weight_decay", float, "AdamW weight decay (matrices only)"),
    (("--grad-clip",), "grad_clip", float, "max gradient norm (0 = off)"),
    (("--device",), "device", str, "auto, cpu, cuda, cuda:N or mps"),
    (("--dtype",), "dtype", str, "auto, float32, bfloat16 or float16 (autocast)"),
    (("--threads",), "threads", int, "CPU threads (default: the cores not busy at start)"),
    (("--seed",), "seed", int, "random seed"),
    (("--eval-interval",), "eval_interval", int, "evaluate (val loss, sample) every N steps"),
    (("--eval-iters",), "eval_iters", int, "validation batches per evaluation (0 = the whole split)"),
    (("--log-interval",), "log_interval", int, "log metrics every N steps"),
    (("--checkpoint-interval",), "checkpoint_interval", int, "checkpoint every N steps (default: eval interval)"),
    (("--keep-last",), "keep_last", int, "checkpoints to keep"),
    (("--sample-tokens",), "sample_tokens", int, "tokens in the sample written at each evaluation"),
    (("--peak-flops",), "peak_flops", float, "peak FLOP/s of the hardware, for MFU (e.g. 989e12)"),
    (("--parallel",), "parallel", str, "with several processes: ddp (each holds the weights) or fsdp (sharded)"),
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a model (default: a small LM on the built-in corpus)",
        description="Train a model and write a run folder (config.json, model.safetensors, tokenizer.json, "
                    "train.yaml, state/, metrics.jsonl, samples.txt, loss.png). Any config field can be set with "
                    "--model.FIELD VALUE / --train.FIELD VALUE or --set model.FIELD=VALUE.")
    p.add_argument("--config", help="run config (YAML/TOML/JSON) with model: and train: sections")
    p.add_argument("--preset", help="model preset (default: tiny)")
    p.add_argument("--out", help="run folder (default: runs/<timestamp>)")
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="RUN",
                   help="continue a run from its latest checkpoint (RUN, or the --out folder)")
    p.add_argument("--force", action="store_true", help="start over in an existing run folder (deletes its run files)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override any config field, e.g. --set train.lr=3e-4 --set model.n_layer=2 (repeatable)")
    for flags, dest, typ, help_text in TRAIN_FLAGS:
        p.add_argument(*flags, dest=f"flag_{dest}", type=typ, default=None, metavar=dest.upper(), help=help_text)
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="train with N processes on this machine, as `torchrun --nproc_per_node N` does "
                        "(multi-node: see docs/distributed.md)")
    p.add_argument("--reward", dest="flag_rewards", action="append", default=None, metavar="SPEC",
                   help="objective grpo: a reward, builtin:exact|contains|json-schema|python-import or "
                        "path/file.py:function, optionally =WEIGHT (repeatable: the rewards add)")
    p.add_argument("--no-std-scale", dest="flag_std_scale", action="store_const", const=False, default=None,
                   help="objective grpo: advantages r - mean(group), not divided by the group's std")
    p.add_argument("--compile", dest="flag_compile", action="store_const", const=True, default=None,
                   help="torch.compile the model")
    p.add_argument("--no-progress", dest="flag_progress", action="store_const", const=False, default=None,
                   help="no progress bar")
    # every field of both configs as --model.FIELD / --train.FIELD (kept out of --help: there are many)
    for section, cls in (("model", ModelConfig), ("train", TrainConfig)):
        for f in dataclasses.fields(cls):
            p.add_argument(f"--{section}.{f.name}", dest=f"field__{section}__{f.name}", default=None,
                           help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def build_spec(args: argparse.Namespace):  # -> RunSpec
    from tinyformer.training.runner import RunSpec

    sections = read_run_file(args.config) if args.config else {"model": {}, "train": {}}
    overrides: dict[str, dict[str, Any]] = {"model": {}, "train": {}}
    for item in args.set:
        apply_override(overrides, item)
    for key, raw in vars(args).items():
        if key.startswith("field__") and raw is not None:
            _, section, name = key.split("__", 2)
            cls = ModelConfig if section == "model" else TrainConfig
            overrides[section][name] = coerce_field(cls, name, parse_value(raw), raw)
    for key, value in vars(args).items():
        if key.startswith("flag_") and value is not None:
            overrides["train"][key[len("flag_"):]] = value
    if args.preset:
        overrides["model"]["preset"] = args.preset
    out, resume = args.out, bool(args.resume)
    if isinstance(args.resume, str):
        if out is not None and out != args.resume:
            raise ConfigError(f"--resume {args.resume} and --out {out} name different run folders")
        out = args.resume
    if resume and args.force:
        raise ConfigError("--resume and --force contradict each other: continue the run, or start it over")
    if resume and args.preset:
        raise ConfigError("--preset cannot change the model of a run being resumed")
    from tinyformer.evaluation.tasks import add_builtin_accuracy

    return RunSpec(sections=sections, config_file=args.config, model_overrides=overrides["model"],
                   train_overrides=overrides["train"], out=out, resume=resume, force=args.force,
                   builtin_task_scorer=add_builtin_accuracy)


def schedule_text(cfg: TrainConfig, chosen: str | None = None) -> str:
    """'lr 0.002, cosine to 0.0002 at step 400, warm-up 40 steps': the learning-rate schedule the run uses (and
    ``chosen``, how the objective chose its warm-up when the user did not, see training/runner.py)."""
    warmup = f"warm-up {cfg.warmup_steps} step{'' if cfg.warmup_steps == 1 else 's'}"
    warmup += f" ({chosen}; --warmup-steps to change)" if chosen else ""
    if cfg.lr_schedule == "constant":
        return f"lr {cfg.lr:g}, constant after {warmup}"
    return f"lr {cfg.lr:g}, {cfg.lr_schedule} to {cfg.lr_floor:g} at step {cfg.total_decay_steps}, {warmup}"


def _fit(prepared: Any):  # -> TrainSummary | None
    """``trainer.fit()``, stopping cleanly on Ctrl-C / SIGTERM (training/interrupt.py): the current step is
    checkpointed and the way to resume printed; a new run stopped before its first step is removed.
    Returns None when stopped before any step; a summary with ``interrupted`` set when stopped later."""
    from tinyformer.training.interrupt import stop_on_signals
    from tinyformer.training.runner import discard_untrained

    trainer, run_dir = prepared.trainer, prepared.run_dir
    start = trainer.step
    try:
        with stop_on_signals(enabled=trainer.world_size == 1) as stop:
            trainer.stop_request = stop
            summary = trainer.fit()
    except KeyboardInterrupt:  # a signal the handler did not catch (e.g. outside the main thread)
        summary = None
    if summary is not None and not summary.interrupted:
        return summary
    signal_name = summary.interrupted if summary is not None else "interrupted"
    if trainer.step == 0 and prepared.fresh and trainer.is_main:
        discard_untrained(run_dir, prepared.created)
        print(f"{signal_name}: stopped before the first step; nothing was trained, the run's files were removed",
              file=sys.stderr)
        return None
    if summary is None:
        raise KeyboardInterrupt
    saved = trainer.last_checkpoint
    what = f"checkpoint {saved} holds it" if saved is not None else "no checkpoint was written"
    print(f"{signal_name}: stopped at step {trainer.step} of {trainer.cfg.max_steps} ({trainer.step - start} steps "
          f"this time); {what}. Continue with: tinyformer train --resume {run_dir}", file=sys.stderr)
    return summary


def run(args: argparse.Namespace) -> int:
    from tinyformer.training.distributed import launch, launched_by_torchrun
    from tinyformer.training.runner import discard_untrained, prepare_distributed_run
    from tinyformer.utils.io import folder_lock

    spec = build_spec(args)
    # one writer per run folder (the launcher holds it for its ranks; runs/<time> needs none)
    with folder_lock(spec.out) if spec.out and not launched_by_torchrun() else contextlib.nullcontext():
        if args.nproc is not None and args.nproc != 1 and not launched_by_torchrun():
            # a bad value must be one line here, not an error in each of N worker processes
            TrainConfig.from_dict({**spec.sections.get("train", {}), **spec.train_overrides})
            return launch(args.nproc, args)  # each process runs this function again, as a rank
        prepared = prepare_distributed_run(spec)
        try:
            return _train(prepared)
        except KeyboardInterrupt:  # before the loop took over the signals: a new run leaves nothing behind
            if prepared.fresh and prepared.trainer.step == 0 and prepared.trainer.is_main:
                discard_untrained(prepared.run_dir, prepared.created)
            raise


def _train(prepared: Any) -> int:
    trainer, cfg, mcfg = prepared.trainer, prepared.trainer.cfg, prepared.trainer.model_cfg
    tok = prepared.tokenizer
    n_params = sum(p.numel() for p in trainer.model.parameters())
    global_batch = cfg.batch_size * cfg.grad_accum * trainer.world_size
    print(f"run folder: {prepared.run_dir}")
    print(f"model: {format_count(n_params)} parameters ({mcfg.arch}, d_model {mcfg.d_model}, {mcfg.n_layer} layers, "
          f"{mcfg.n_head} heads, {mcfg.norm}, {mcfg.pos}, {mcfg.ffn}); tokenizer: {tok.kind}, "
          f"{tok.vocab_size} ids")
    if trainer.lora is not None:
        from tinyformer.components.lora import trainable_share

        trainable, total = trainable_share(trainer.model)
        print(f"LoRA rank {trainer.lora.rank} (alpha {trainer.lora.scale * trainer.lora.rank:g}) on "
              f"{','.join(trainer.lora.targets)}: {format_count(trainable)} trainable parameters of "
              f"{format_count(total)} ({100 * trainable / total:.2f}%); the base weights are frozen")
    for note in prepared.notes:
        print(note)
    per_step = trainer.objective.tokens_per_step(global_batch)
    if per_step is None:
        per_step = f"{global_batch} sequences" + (f" x {cfg.block_size} = {global_batch * cfg.block_size:,} tokens"
                                                  if cfg.block_size else "")
    amp = str(trainer.amp_dtype).replace("torch.", "") if trainer.amp_dtype else "float32"
    threads = f", {configured_threads()}" if trainer.device.type == "cpu" else ""
    schedule = schedule_text(cfg, prepared.schedule_source)
    print(f"objective {cfg.objective}; {cfg.max_steps} steps of {per_step}; {schedule}; device {trainer.device.type}, "
          f"{amp}{threads}")
    if cfg.warmup_steps >= cfg.max_steps:
        from tinyformer.training.optim import lr_at

        print(f"note: the warm-up ({cfg.warmup_steps} steps) is not shorter than the run ({cfg.max_steps} steps): "
              f"the learning rate rises for the whole run, to {lr_at(cfg.max_steps - 1, cfg):g} at the last step "
              f"(of the peak {cfg.lr:g}), and never decays; lower --warmup-steps or raise --steps")
    if trainer.world_size > 1:
        print(f"{trainer.world_size} processes ({cfg.parallel}), each on its own shard of the data")
    if prepared.resumed_from is not None:
        print(f"resuming from {prepared.resumed_from} (step {trainer.step})")
    if trainer.step >= cfg.max_steps:
        print(f"the run is already at step {trainer.step} of {cfg.max_steps}; nothing to train (its files are up "
              "to date with that checkpoint; raise --steps to train further)")
        return 0
    if cfg.compile and trainer.is_main:
        from tinyformer.cli.common import compile_notice

        print(f"tinyformer: {trainer.compile_skipped}" if trainer.compile_skipped
              else compile_notice("the training loss, forward and backward"), file=sys.stderr)
    sys.stdout.flush()
    summary = _fit(prepared)
    if summary is None or summary.interrupted:
        return 130
    rate = summary.tokens / summary.train_seconds if summary.train_seconds else 0.0
    kind = trainer.objective.token_kind
    print(f"done: {summary.steps} steps, {summary.tokens:,} {kind} trained on in {summary.train_seconds:.1f} s of "
          f"training ({rate:,.0f} {kind}/s)")
    for line in trainer.final_figures():  # as report.md words them, from the same metrics.jsonl record
        print(line)
    if summary.plot_note:
        print(summary.plot_note)
    if summary.sample:
        print("sample:\n" + summary.sample.strip())
    print(f"run folder: {prepared.run_dir}  (tinyformer eval --model {prepared.run_dir} --data FILE)")
    return 0
