"""The training loop: micro-batches, gradient accumulation, clipping, AdamW, evaluation, checkpoints.

One optimizer step (update t) of a run on ``world_size`` ranks:

    lr_t = lr_at(t)                                         (optim.py: warm-up, then cosine to a floor)
    for each of the A = grad_accum micro-steps:
        batch = objective.get_batch("train", rank, world_size)   (B sequences of T tokens, per rank)
        L = objective.loss(model, batch) / A;  backward(L)       (gradients add up over micro-steps)
    g <- g * min(1, clip / ||g||_2)                         (global-norm clipping)
    AdamW step;  zero the gradients

so each update sees the *global* batch of B * A * world_size sequences. Only rank 0 logs and writes.

Under torchrun (a process group exists) the same loop runs on every rank with the model wrapped in DDP or
FSDP2 (training/distributed.py); the methods under "one process or many" are where the two cases differ.
The objective (training/objectives/) owns batches, loss and the model's config.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tinyformer.config import ModelConfig
from tinyformer.devices import autocast_dtype, resolve_device
from tinyformer.errors import CheckpointError, ConfigError, TinyformerError
from tinyformer.models import build_model
from tinyformer.run_folder import ADAPTER_WEIGHTS
from tinyformer.sizing import training_flops_per_token
from tinyformer.training.checkpoint import (
    MODEL_FILE,
    disk_error,
    load_checkpoint,
    load_weights,
    save_checkpoint,
)
from tinyformer.training.device import Timer, device_peak_flops, enable_tf32, synchronize
from tinyformer.training.metrics import MetricsLogger, RunningWindow, read_metrics
from tinyformer.training.objectives import Objective
from tinyformer.training.optim import build_optimizer, lr_at
from tinyformer.training.train_config import TrainConfig
from tinyformer.utils.io import atomic_path, atomic_write_text, read_utf8

SAMPLES_FILE = "samples.txt"


class TrainingError(TinyformerError):
    """Training cannot go on (e.g. the loss became NaN); the message says what was kept."""


#: the longest training window for which the compiled loss on a CPU uses SDPA's math backend: measured faster
#: than the flash kernel at 64 tokens, no faster at 256 (docs/benchmarks/training.md)
MATH_ATTENTION_MAX_LEN = 128

#: an objective's loss: (model, batch) -> scalar
LossFn = Callable[[nn.Module, dict[str, Any]], torch.Tensor]


def compiled_loss(loss: LossFn, *, math_attention: bool) -> LossFn:
    """``loss`` compiled whole by ``torch.compile`` (graphs are built at the first call and kept in
    inductor's cache on disk, which later processes reuse).

    ``math_attention``: scaled_dot_product_attention through its math backend, softmax(Q K^T / sqrt(d) + M) V
    written as two batched products and a softmax, which the compiler fuses with the mask and the scaling.
    On a CPU at training lengths that beat the fused flash kernel (docs/benchmarks/training.md), whose
    backward is a separate kernel the compiler cannot fuse into anything; it stores the (T, T) attention
    weights per head for backward, as the flash kernel does not."""
    if not math_attention:
        return torch.compile(loss)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def loss_with_math_attention(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH):
            return loss(model, batch)

    return torch.compile(loss_with_math_attention)


@dataclass
class TrainSummary:
    steps: int
    tokens: int
    train_seconds: float
    train_loss: float | None
    val_loss: float | None
    sample: str | None
    plot_note: str | None
    interrupted: str | None = None  # the signal that stopped training early (a checkpoint was saved), if any


class Trainer:
    """Trains ``objective``'s model with the settings of ``cfg``, writing into ``run_dir`` (rank 0).

    ``model`` is the plain module (what is saved); ``train_model`` is what the loop calls, the
    result of :meth:`wrap_model` (wrapped for distributed training, and compiled).
    """

    def __init__(self, model_cfg: ModelConfig, cfg: TrainConfig, objective: Objective, run_dir: Path,
                 *, rank: int = 0, world_size: int = 1) -> None:
        import torch.distributed as dist

        self.distributed = dist.is_available() and dist.is_initialized()  # under torchrun
        self._ddp: Any = None  # the DDP wrapper (training/distributed.py), under torchrun with parallel=ddp
        self.model_cfg, self.cfg, self.objective, self.run_dir = model_cfg, cfg, objective, Path(run_dir)
        self.rank, self.world_size, self.is_main = rank, world_size, rank == 0
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = resolve_device(cfg.device)
        self.amp_dtype = autocast_dtype(cfg.dtype, self.device)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        self.model = build_model(model_cfg).to(self.device)
        self.lora = cfg.lora_config()  # LoRA: adapters on a frozen model (components/lora.py)
        if self.lora is not None:
            from tinyformer.components.lora import apply_lora

            apply_lora(self.model, self.lora)  # before the optimizer: it takes the trainable tensors only
        self.train_model = self.wrap_model(self.model)
        #: why ``compile`` was not honoured (no C++ compiler for a CPU run), else None
        self.compile_skipped: str | None = None
        self.loss_fn = self.training_loss()
        self.optimizer = build_optimizer(self.model, cfg, self.device.type)
        use_scaler = self.amp_dtype == torch.float16 and self.device.type == "cuda"
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=use_scaler)
        # Batches come from their own stream so that anything else drawing random numbers
        # (dropout, a sample) cannot shift which windows training sees; ranks differ by their shard.
        self.data_generator = torch.Generator().manual_seed(cfg.seed)
        torch.manual_seed(cfg.seed + rank)  # dropout masks differ between ranks
        self.step = 0
        self.tokens_seen = 0
        self.train_seconds = 0.0
        self.last_checkpoint: Path | None = None
        self.window = RunningWindow()
        self.last_eval_batches = 0
        # the run folder's files (train.yaml, config.json, tokenizer files) stored with every checkpoint;
        # set by runner.prepare_run
        self.run_files: dict[str, bytes] = {}
        #: scores the built-in question task into report.md at the end of a run on the built-in corpus:
        #: ``scorer(run_dir, model, tokenizer)``; the command line passes evaluation's (training does not import
        #: evaluation/), None leaves the card without it
        self.builtin_task_scorer: Callable[[Path, Any, Any], object] | None = None
        # asked to stop (Ctrl-C / SIGTERM, interrupt.py): the loop saves and returns after the current step
        self.stop_request: Any = None
        self.flops_per_token = self._flops_per_token()
        # MFU's peak: a known GPU's dense bf16/fp16 figure (training/device.py); none on CPU or in float32
        self.peak_flops = cfg.peak_flops or (device_peak_flops(self.device) if self.amp_dtype is not None else None)
        self.metrics = MetricsLogger(self.run_dir, enabled=self.is_main, tensorboard=cfg.tensorboard)
        objective.attach(self.model)
        if self.device.type == "cuda":
            enable_tf32()
        if self.distributed and self.world_size != dist.get_world_size():
            raise ConfigError(f"world_size {self.world_size} does not match the process group's "
                              f"{dist.get_world_size()}")

    # ------------------------------------------------------------------ one process or many
    @property
    def sharded(self) -> bool:
        return self.distributed and self.cfg.parallel == "fsdp"

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """The module the training loop calls: under torchrun wrapped in DDP or sharded by FSDP2
        (``train.parallel``); on one process the model as it is, ``compile`` compiling the training loss
        instead (:meth:`training_loss`)."""
        if not self.distributed:
            return model
        from tinyformer.training.distributed import MethodDDP, fully_shard_model

        if self.cfg.parallel == "fsdp":
            return fully_shard_model(self, model)
        device_ids = [self.device.index if self.device.index is not None else torch.cuda.current_device()] \
            if self.device.type == "cuda" else None
        # a decoder LM's loss uses every parameter; others may not (BERT's pooler in masked-LM training),
        # and DDP must then look for the unused ones after each forward (a graph walk; off where unneeded)
        self._ddp = MethodDDP(model, device_ids=device_ids, find_unused_parameters=self.model_cfg.arch != "decoder")
        # compiling the DDP module lets the compiler split graphs at gradient-bucket boundaries
        return torch.compile(self._ddp) if self.cfg.compile else self._ddp

    def training_loss(self) -> LossFn:
        """What a micro-step calls: ``objective.loss(train_model, batch)``.

        With ``compile`` that whole function is compiled: embedding, every block, head and cross-entropy in
        one forward graph and one backward graph, so that the compiler fuses the elementwise passes between
        the matrix products (norms, RoPE, the SwiGLU gate, residual adds, the log-softmax) across layers.
        On a CPU with windows of at most ``MATH_ATTENTION_MAX_LEN`` tokens, attention inside it is SDPA's math
        backend (:func:`compiled_loss`). Evaluation stays eager. Under torchrun the wrapped module is what
        is compiled (:meth:`wrap_model`): the loss calls it as it is."""
        if not self.cfg.compile or self.distributed:
            return self.objective.loss
        from tinyformer.generation.engine import cpp_compiler

        if self.device.type == "cpu" and cpp_compiler() is None:  # inductor writes C++ for the CPU
            self.compile_skipped = ("train.compile: no C++ compiler found (g++ or clang++; set CXX to choose one): "
                                    "training eagerly")
            return self.objective.loss
        short = self.cfg.block_size <= MATH_ATTENTION_MAX_LEN
        return compiled_loss(self.objective.loss, math_attention=self.device.type == "cpu" and short)

    def sync_context(self, last_micro_step: bool) -> contextlib.AbstractContextManager:
        """Context of one micro-step's backward: DDP's ``no_sync()`` unless it is the last one."""
        if self._ddp is not None and not last_micro_step:
            return self._ddp.no_sync()  # accumulate locally; all-reduce once, on the last micro-step
        return contextlib.nullcontext()

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum of ``value`` over ranks (identity on one process)."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        total = value.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    def eval_batches(self, split: str) -> Iterator[dict[str, Any]]:
        """This rank's evaluation batches of ``split`` (a sharded model runs as many on every rank)."""
        batches = self.objective.eval_batches(split, self.cfg.eval_iters or None, self.rank, self.world_size)
        if not self.sharded:
            return batches
        from tinyformer.training.distributed import lockstep

        return lockstep(batches, self.device)

    def draw_sample(self) -> str | None:
        """The sample text written at an evaluation, on rank 0. With a sharded model every rank takes part in the
        forward passes (each gathers shards); the same seed gives every rank the same tokens, so they stop together."""
        if not (self.is_main or self.sharded):
            return None
        sample = self.objective.sample(self.model, self.device)
        return sample if self.is_main else None

    def checkpoint_states(self) -> dict[str, Any]:
        """Keyword arguments for ``save_checkpoint``, computed on every rank before rank 0 writes: under torchrun
        the consolidated weights and optimizer state plus every rank's random streams, gathered on rank 0 (a
        collective); for a model held whole, none (a LoRA model: its adapters)."""
        if self.distributed:
            from tinyformer.training.distributed import full_model_state, full_optimizer_state, gather_rank_rng

            return {"model_state": full_model_state(self.model), "optimizer_state": full_optimizer_state(self),
                    "extra_tensors": gather_rank_rng(self)}
        return {"model_state": self._adapters()} if self.lora is not None else {}

    def state_loaders(self) -> dict[str, Any]:
        """Keyword arguments for ``load_checkpoint``: under torchrun ``assign_weights`` / ``assign_optimizer``,
        which re-shard the consolidated state; for a model held whole, none (a LoRA model: ``own_weights``, its
        adapters are what a checkpoint holds)."""
        if self.distributed:
            from tinyformer.training.distributed import load_full_model_state, load_full_optimizer_state

            return {"assign_weights": functools.partial(load_full_model_state, self.model),
                    "assign_optimizer": functools.partial(load_full_optimizer_state, self)}
        return {"own_weights": self._adapters()} if self.lora is not None else {}

    def _adapters(self) -> dict[str, torch.Tensor]:
        from tinyformer.components.lora import adapter_state_dict

        return adapter_state_dict(self.model)

    # ------------------------------------------------------------------ helpers
    def _flops_per_token(self) -> int | None:
        if self.model_cfg.arch != "decoder" or self.cfg.block_size is None:
            return None
        return training_flops_per_token(self.model_cfg, self.cfg.block_size)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    def _to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {k: (v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                for k, v in batch.items()}

    # ------------------------------------------------------------------ loading
    def restore(self, ckpt_dir: Path) -> None:
        """Continue from a checkpoint: weights, optimizer, RNG streams, step, counters and log windows.
        Reads only: the run folder is brought up to the checkpoint afterwards (runner.publish_resumed). A LoRA
        checkpoint holds the adapters only: the frozen base comes from the base run that adapter_config.json
        names."""
        if self.lora is not None:
            from tinyformer.run_folder import read_adapter_config

            self.load_pretrained(read_adapter_config(self.run_dir)[1])
        state = load_checkpoint(ckpt_dir, self.model, self.optimizer, self.data_generator, self.scaler,
                                **self.state_loaders())
        self.step = state["step"]
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.train_seconds = float(state.get("train_seconds", 0.0))
        self.window = RunningWindow.from_dict(state.get("window"))
        self.objective.load_state(state.get("objective"))
        self.last_checkpoint = ckpt_dir
        if self.distributed:
            from tinyformer.training.distributed import restore_rank_rng

            restore_rank_rng(self, Path(ckpt_dir))

    def forget_after(self, step: int) -> None:
        """Drop metrics and samples logged after ``step`` by an interrupted run (they will be redone)."""
        if not self.is_main:
            return
        self.metrics.truncate_after(step)
        path = self.run_dir / SAMPLES_FILE
        if path.is_file():
            sections = re.split(r"(?m)^(?====== step \d+)", read_utf8(path, CheckpointError, "samples file"))
            heads = [(s, re.match(r"===== step (\d+)", s)) for s in sections if s]
            kept = [s for s, m in heads if m is None or int(m.group(1)) <= step]
            atomic_write_text(path, "".join(kept))

    def load_pretrained(self, run_dir: Path) -> None:
        """Start from another run's weights (fine-tuning); optimizer and step start fresh."""
        from tinyformer.components.lora import base_state_dict
        from tinyformer.run_folder import model_tensors

        tensors = self.objective.adapt_pretrained(dict(model_tensors(run_dir)))
        load_weights(self.model, tensors, f"--init-from {run_dir}",
                     assign=self.state_loaders().get("assign_weights"),
                     own=base_state_dict(self.model) if self.lora is not None else None)

    # ------------------------------------------------------------------ one update
    def train_step(self) -> tuple[float, float | None, int]:
        """One optimizer update (advancing ``step``, ``tokens_seen`` and ``train_seconds``); returns
        (mean loss, gradient norm before clipping, global tokens of the update)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        lr = lr_at(self.step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        tokens = 0
        for micro in range(cfg.grad_accum):
            batch = self._to_device(self.objective.get_batch("train", self.data_generator, self.rank,
                                                             self.world_size))
            tokens += self.objective.num_tokens(batch)
            with self.sync_context(micro == cfg.grad_accum - 1):
                with self.autocast():
                    loss = self.loss_fn(self.train_model, batch) / cfg.grad_accum
                self.scaler.scale(loss).backward()
            total += loss.detach()
        loss_value = float(self.reduce_sum(total)) / self.world_size
        if not math.isfinite(loss_value):
            self.optimizer.zero_grad(set_to_none=True)
            kept = (f"the last good checkpoint is {self.last_checkpoint}" if self.last_checkpoint
                    else "no checkpoint had been written yet")
            raise TrainingError(
                f"loss is {loss_value} at step {self.step + 1}; training stopped without applying that update; "
                f"{kept}. Lower train.lr, raise warmup_steps or check the data, then --resume"
            )
        grad_norm = None
        if cfg.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += tokens * self.world_size
        synchronize(self.device)  # GPU kernels run asynchronously: time them, not their queuing
        self.train_seconds += time.perf_counter() - t0
        return loss_value, grad_norm, tokens * self.world_size

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, split: str = "val") -> float | None:
        """Mean loss over the objective's fixed evaluation batches of ``split``, each batch weighted by
        ``objective.eval_weight`` (its target tokens; DPO: its pairs); ``last_eval_batches`` counts them."""
        if not self.objective.has_split(split):
            return None
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        self.last_eval_batches = 0
        for batch in self.eval_batches(split):
            batch = self._to_device(batch)
            n = self.objective.eval_weight(batch)
            self.last_eval_batches += 1
            with self.autocast():
                loss = self.objective.loss(self.model, batch)
            total += loss.double() * n
            count += n
        self.model.train()
        total, count = self.reduce_sum(total), self.reduce_sum(count)
        return float(total / count) if float(count) > 0 else None

    # ------------------------------------------------------------------ saving
    def trainer_state(self) -> dict[str, Any]:
        state = {"tokens_seen": self.tokens_seen, "train_seconds": self.train_seconds, "world_size": self.world_size,
                 "window": self.window.to_dict()}
        objective_state = self.objective.state()
        if objective_state is not None:
            state["objective"] = objective_state
        return state

    def save(self) -> None:
        """Checkpoint into state/ and refresh the run folder's model.safetensors (a LoRA run's
        adapter.safetensors) (rank 0 writes)."""
        states = self.checkpoint_states()
        if not self.is_main:
            return
        ckpt = save_checkpoint(self.run_dir, self.step, self.model, self.optimizer, self.trainer_state(),
                               self.data_generator, self.cfg.keep_last, self.scaler, run_files=self.run_files,
                               **states)
        self.last_checkpoint = ckpt
        self.publish_weights(ckpt)

    def publish_weights(self, ckpt: Path) -> None:
        """Copy checkpoint ``ckpt``'s weights (a LoRA run's adapters) into the run folder (atomically, so
        readers never see half a file) and record their checksum in its manifest (integrity.py)."""
        from tinyformer.integrity import write_manifest
        from tinyformer.training.checkpoint import read_meta

        known = (read_meta(ckpt).get("checksums") or {}).get(MODEL_FILE)
        target = self.run_dir / (ADAPTER_WEIGHTS if self.lora is not None else MODEL_FILE)
        try:
            with atomic_path(target) as tmp:
                shutil.copyfile(ckpt / MODEL_FILE, tmp)
            write_manifest(self.run_dir, [target.name], known={target.name: known} if known else None)
        except OSError as exc:
            raise disk_error(exc, f"{target}", f"checkpoint {ckpt} is complete") from None

    # ------------------------------------------------------------------ the loop
    def _log(self, pbar: Any, text: str) -> None:
        if self.is_main:
            (pbar.write if pbar is not None and not pbar.disable else print)(text)

    def fit(self) -> TrainSummary:
        """Train until ``max_steps``: log every ``log_interval``, evaluate (val loss, sample) every
        ``eval_interval``, checkpoint every ``checkpoint_interval`` and at the end. When ``stop_request`` is
        set (Ctrl-C, training/interrupt.py) it checkpoints the current step and returns early, the summary's
        ``interrupted`` naming the signal. With ``compile``, a warm-up step compiles first (:meth:`warm_up`)."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        if cfg.compile and not self.compile_skipped and self.step < cfg.max_steps:
            self._log(None, f"compiled in {self.warm_up():.1f} s (warm-up, not counted in the timings)")
        self.model.train()
        pbar = tqdm(total=cfg.max_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                    disable=not (self.is_main and cfg.progress))
        win = self.window
        val_loss = sample = None
        interrupted = None
        try:
            while self.step < cfg.max_steps:
                if self.stop_request:  # checkpoint the current step (unless it is step 0 or already saved)
                    saved = self.last_checkpoint is not None and self.last_checkpoint.name == f"step-{self.step:06d}"
                    if self.step > 0 and not saved:
                        self.save()
                    interrupted = self.stop_request.signal_name
                    break
                self.advance(pbar)
                last = self.step == cfg.max_steps
                if self.step % cfg.eval_interval == 0 or last:
                    self._resample_threads(pbar)
                    val_loss, sample = self._evaluate_and_log(pbar, win.eval_loss / win.eval_steps, win.eval_steps)
                    win.reset_eval()
                if self.step % cfg.save_every == 0 or last:
                    self.save()
        finally:
            pbar.close()
            self.metrics.close()
        plot_note = self.plot() if self.is_main and interrupted is None else None
        if self.is_main and interrupted is None:
            self.write_report()
        records = read_metrics(self.metrics.path) if self.is_main else []
        losses = [r["loss"] for r in records if r.get("kind") == "train"]
        return TrainSummary(self.step, self.tokens_seen, self.train_seconds, losses[-1] if losses else None, val_loss,
                            sample, plot_note, interrupted)

    def warm_up(self) -> float:
        """One forward and backward on a throw-away batch, so that compilation happens here and not in the
        first timed step. Random streams are forked and gradients discarded: training is unchanged."""
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with Timer(self.device) as timer, torch.random.fork_rng(devices=devices):
            batch = self._to_device(self.objective.get_batch("train", torch.Generator().manual_seed(0),
                                                             self.rank, self.world_size))
            with self.autocast():
                loss = self.loss_fn(self.train_model, batch)
            loss.backward()
            self.optimizer.zero_grad(set_to_none=True)
        return timer.seconds

    def advance(self, pbar: Any = None) -> None:
        """One step of :meth:`fit`'s loop without its evaluations and checkpoints: the update, the running
        window, and every ``log_interval`` steps (and at ``max_steps``) a train record in metrics.jsonl and
        the progress bar's figures (``pbar`` None: none)."""
        cfg, win = self.cfg, self.window
        t0 = time.perf_counter()
        loss, grad_norm, tokens = self.train_step()
        win.add(loss, tokens, time.perf_counter() - t0)
        if pbar is not None:
            pbar.update(1)
        if self.step % cfg.log_interval == 0 or self.step == cfg.max_steps:
            tps = win.tokens / win.seconds if win.seconds > 0 else 0.0
            flops = tps * self.flops_per_token if self.flops_per_token else None
            record = {"kind": "train", "step": self.step, "loss": win.loss / win.steps,
                      "lr": lr_at(self.step - 1, cfg), "grad_norm": grad_norm, "tokens": self.tokens_seen,
                      "tokens_per_s": tps, "flops_per_s": flops,
                      "mfu": flops / (self.peak_flops * self.world_size) if flops and self.peak_flops else None,
                      "time": self.train_seconds}
            # MoE auxiliary losses of the last micro-step (unweighted), when the model has any
            for name, value in getattr(self.model, "last_moe_losses", {}).items():
                record[name] = float(value)
            record.update(self.objective.train_metrics())
            self.metrics.log(record)
            if pbar is not None:
                postfix = {"loss": f"{record['loss']:.3f}", "tok/s": f"{tps:,.0f}"}
                if record["mfu"] is not None:
                    postfix["mfu"] = f"{100 * record['mfu']:.1f}%"
                pbar.set_postfix(postfix, refresh=False)
            win.reset_log()

    def write_report(self) -> None:
        """Write report.md (:mod:`tinyformer.report_card`) for the model as it is now."""
        from tinyformer.report_card import write_training_card

        write_training_card(self.run_dir, read_metrics(self.metrics.path), self.objective,
                            self.objective.report(self.model, self.device))
        scorer = self.builtin_task_scorer
        if scorer is not None and self.objective.scores_builtin_task and self.objective.cfg.data is None:
            # a model of the built-in corpus: its report card gains the built-in task's accuracy
            try:
                scorer(self.run_dir, self.model, self.objective.tokenizer)
            except TinyformerError as exc:  # e.g. a context too short for the questions: the run still stands
                print(f"report.md: the built-in question task was not scored: {exc}", file=sys.stderr)

    def _resample_threads(self, pbar: Any) -> None:
        """On the CPU, with the thread count chosen from the busy cores (not --threads), choose it again
        (utils/threads.py): a run started on a busy machine takes the cores that have freed up since."""
        from tinyformer.utils.threads import describe_threads, resample_threads

        if self.device.type != "cpu" or self.cfg.threads or self.world_size > 1:
            return
        changed = resample_threads()
        if changed is not None:
            self._log(pbar, f"threads: {changed[0]} -> {describe_threads(changed[1], 'load')}")

    def _evaluate_and_log(self, pbar: Any, train_loss: float, train_steps: int) -> tuple[float | None, str | None]:
        """Evaluate, log the eval record and print it: the figures as report.md words them
        (:mod:`tinyformer.report_card`), from the same record."""
        from tinyformer.report_card import heldout_line, train_loss_line

        val_loss = self.evaluate("val")
        record: dict[str, Any] = {"kind": "eval", "step": self.step, "train_loss": train_loss,
                                  "train_loss_steps": train_steps}
        if val_loss is not None:
            record.update(val_loss=val_loss, val_batches=self.last_eval_batches)
            if self.objective.loss_is_nll:  # not so for DPO: no perplexity
                record["val_ppl"] = math.exp(min(val_loss, 700.0))
        extra: dict[str, float] = {}
        if self.is_main:
            extra = self.objective.eval_metrics(self.model, self.device)
            record.update(extra)
        figures = [train_loss_line(record), heldout_line(record, self.objective)]
        figures += [f"{k} {v:.4f}" for k, v in extra.items() if k != self.objective.val_loss_key]
        self.metrics.log(record)
        self._log(pbar, f"step {self.step}: " + "; ".join(f for f in figures if f))
        sample = self.draw_sample()
        if sample is not None:
            loss = f", val loss {val_loss:.4f}" if val_loss is not None else ""
            with open(self.run_dir / SAMPLES_FILE, "a", encoding="utf-8") as f:
                f.write(f"===== step {self.step}{loss} =====\n{sample}\n\n")
        return val_loss, sample

    def final_figures(self) -> list[str]:
        """The figures of the last evaluation as report.md words them (console lines at the end of a run)."""
        from tinyformer.report_card import heldout_line, train_loss_line

        evals = [r for r in read_metrics(self.metrics.path) if r.get("kind") == "eval"] if self.is_main else []
        if not evals:
            return []
        return [line for line in (train_loss_line(evals[-1]), heldout_line(evals[-1], self.objective)) if line]

    def plot(self) -> str | None:
        from tinyformer.training.plot import plot_loss_curve

        return plot_loss_curve(self.metrics.path, self.run_dir / "loss.png", title=self.run_dir.name)

