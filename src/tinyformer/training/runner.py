"""Setting up a run: resolve the config, prepare the run folder, tokenizer and data, build the trainer.

    fresh run     the out folder must be new or empty (``force`` clears a previous run's files)
    resume        the run's own train.yaml is the config; only logging/hardware fields and
                  max_steps may change; training continues from the latest checkpoint in state/
    init_from     model config, weights and tokenizer come from another run folder (fine-tuning)

The run folder receives, before the first step: ``train.yaml`` (the resolved config),
``config.json`` (the model) and ``tokenizer.json``; checkpoints add ``model.safetensors`` and state/.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinyformer.config import ModelConfig
from tinyformer.data.tokenizer import Tokenizer
from tinyformer.errors import CheckpointError, ConfigError
from tinyformer.training.checkpoint import STATE_DIR, latest_checkpoint, remove_partial
from tinyformer.training.config import (
    RESUME_MUTABLE,
    TrainConfig,
    build_model_config,
    config_differences,
    read_run_file,
    to_yaml,
)
from tinyformer.training.objectives import Objective, get_objective
from tinyformer.training.trainer import Trainer, autocast_dtype, resolve_device
from tinyformer.utils.io import atomic_write_text

TRAIN_FILE = "train.yaml"
#: What a run folder holds; ``force`` deletes these and nothing else.
RUN_ENTRIES = ("config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
               "tokenizer_config.json", TRAIN_FILE, STATE_DIR, "metrics.jsonl", "samples.txt", "loss.png",
               "tensorboard")


@dataclass
class RunSpec:
    """What the user asked for: config-file sections plus overrides, and how to treat the run folder."""

    sections: dict[str, dict[str, Any]] = field(default_factory=lambda: {"model": {}, "train": {}})
    config_file: str | None = None
    model_overrides: dict[str, Any] = field(default_factory=dict)
    train_overrides: dict[str, Any] = field(default_factory=dict)
    out: str | None = None
    resume: bool = False
    force: bool = False


def default_run_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def _fresh_configs(spec: RunSpec) -> tuple[ModelConfig | None, dict[str, Any], TrainConfig]:
    """(model config or None when it comes from init_from, model fields asked for, train config)."""
    train = TrainConfig.from_dict({**spec.sections.get("train", {}), **spec.train_overrides})
    model_fields = {**spec.sections.get("model", {}), **spec.model_overrides}
    if train.init_from is not None:
        if "preset" in model_fields:
            raise ConfigError("--init-from takes the model from that run; drop the model preset")
        return None, model_fields, train
    return build_model_config(model_fields), model_fields, train


def _check_block_size(model_cfg: ModelConfig, train: TrainConfig) -> TrainConfig:
    if train.block_size is None:
        return train.replace(block_size=model_cfg.max_seq_len)
    if train.block_size > model_cfg.max_seq_len:
        raise ConfigError(
            f"train.block_size {train.block_size} is above the model's max_seq_len {model_cfg.max_seq_len}; "
            f"use --block-size <= {model_cfg.max_seq_len} or raise --model.max_seq_len"
        )
    return train


def _clear_run(run_dir: Path) -> None:
    for name in RUN_ENTRIES:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    for shard in run_dir.glob("model-*-of-*.safetensors"):
        shard.unlink()


def _saved_configs(run_dir: Path) -> tuple[ModelConfig, TrainConfig]:
    if not run_dir.is_dir():
        raise CheckpointError(f"--resume: run folder {run_dir} does not exist")
    if not (run_dir / TRAIN_FILE).is_file():
        raise CheckpointError(f"--resume: {run_dir} has no {TRAIN_FILE}; is it a tinyformer training run?")
    saved = read_run_file(run_dir / TRAIN_FILE)
    try:
        return build_model_config(saved["model"]), TrainConfig.from_dict(saved["train"])
    except ConfigError as exc:
        raise CheckpointError(f"--resume: {run_dir / TRAIN_FILE} is not a valid run config: {exc}") from None


def _resume_configs(spec: RunSpec, run_dir: Path) -> tuple[ModelConfig, TrainConfig]:
    """The saved configs, with the changes a resume may make; anything else that differs is an error."""
    model_cfg, train = _saved_configs(run_dir)
    if spec.config_file is not None:  # the whole file is the request
        asked_train = TrainConfig.from_dict({**spec.sections.get("train", {}), **spec.train_overrides})
        model_fields = {**spec.sections.get("model", {}), **spec.model_overrides}
        asked_model = model_cfg if asked_train.init_from is not None else build_model_config(model_fields)
    else:  # only what was given on the command line
        asked_train = train.replace(**spec.train_overrides)
        asked_model = model_cfg.replace(**spec.model_overrides) if spec.model_overrides else model_cfg
    if asked_train.block_size is None:
        asked_train = asked_train.replace(block_size=train.block_size)
    model_diff = config_differences(model_cfg.to_dict(), asked_model.to_dict(), frozenset({"vocab_size"}))
    train_diff = config_differences(train.to_dict(), asked_train.to_dict(), RESUME_MUTABLE)
    if model_diff or train_diff:
        asked = {*spec.model_overrides, *spec.train_overrides}  # name what the user changed, not a knock-on
        model_diff.sort(key=lambda k: k not in asked)
        train_diff.sort(key=lambda k: k not in asked)
        name = f"model.{model_diff[0]}" if model_diff else f"train.{train_diff[0]}"
        section, key = name.split(".", 1)
        have = getattr(model_cfg if section == "model" else train, key)
        want = getattr(asked_model if section == "model" else asked_train, key)
        raise CheckpointError(
            f"--resume: {run_dir} was trained with {name}={have!r} but this run asks for {want!r}; its checkpoint "
            "is from another config. Resume without that change, or start a new run with another --out"
        )
    changes = {k: getattr(asked_train, k) for k in RESUME_MUTABLE if getattr(asked_train, k) != getattr(train, k)}
    return model_cfg, (train.replace(**changes) if changes else train)


@dataclass
class PreparedRun:
    trainer: Trainer
    run_dir: Path
    tokenizer: Tokenizer
    resumed_from: Path | None
    notes: list[str]


def prepare_run(spec: RunSpec, *, rank: int = 0, world_size: int = 1,
                log: Callable[[str], None] = print, make_trainer: Callable[..., Trainer] = Trainer) -> PreparedRun:
    """Resolve configs, set up the run folder, tokenizer and data; return a trainer ready to ``fit()``.

    ``make_trainer`` builds the trainer (called with Trainer's arguments) once the run folder is ready;
    training/distributed.py passes its DistributedTrainer."""
    from tinyformer.training.prepare import build_dataset, check_windows, corpus_name, train_tokenizer

    run_dir = Path(spec.out) if spec.out else (None if spec.resume else default_run_dir())
    if run_dir is None:
        raise ConfigError("--resume needs the run folder: --resume RUN or --out RUN --resume")
    notes: list[str] = []
    is_main = rank == 0

    # ---- configs (all checks that need no data come first: they fail in a second, not a minute)
    if spec.resume:
        model_cfg, train = _resume_configs(spec, run_dir)
        init_from = None
    else:
        if run_dir.exists() and not run_dir.is_dir():
            raise ConfigError(f"--out {run_dir} is a file, not a folder")
        if run_dir.is_dir() and any(run_dir.iterdir()) and not spec.force:
            raise CheckpointError(
                f"run folder {run_dir} already exists and is not empty; use --resume to continue it, --force to "
                "start over (deleting its checkpoints), or another --out"
            )
        model_cfg, model_fields, train = _fresh_configs(spec)
        init_from = Path(train.init_from) if train.init_from else None
        if init_from is not None:
            from tinyformer.run_folder import load_config

            model_cfg = load_config(init_from)
            if "quantization" in model_cfg.extra:
                raise ConfigError(f"--init-from {init_from}: a quantized run cannot be trained; start from the "
                                  "float run it was quantized from")
            changes = {k: v for k, v in model_fields.items() if k != "vocab_size"}
            model_cfg = model_cfg.replace(**changes) if changes else model_cfg
    objective_cls = get_objective(train.objective)
    autocast_dtype(train.dtype, resolve_device(train.device))  # an impossible device/dtype fails before any data work
    train = _check_block_size(model_cfg, train) if objective_cls.uses_corpus else train

    # ---- tokenizer and data
    if spec.resume:
        tokenizer = Tokenizer.load(run_dir)
    elif init_from is not None:
        from tinyformer.run_folder import load_tokenizer

        tokenizer = load_tokenizer(init_from)
    elif objective_cls.uses_corpus:
        if is_main:
            log(f"training a {train.tokenizer} tokenizer on {corpus_name(train)} ..."
                if train.tokenizer in ("char", "bpe") else f"loading tokenizer {train.tokenizer} ...")
        tokenizer = train_tokenizer(train)
    else:
        tokenizer = objective_cls.make_tokenizer(train)
    dataset = None
    if objective_cls.uses_corpus:
        dataset = build_dataset(train, tokenizer)
        check_windows(dataset, train.block_size, world_size)
    objective: Objective = objective_cls(train, tokenizer, dataset)
    if not spec.resume and init_from is None:
        model_cfg = model_cfg.replace(vocab_size=tokenizer.vocab_size)
    elif tokenizer.vocab_size > model_cfg.vocab_size:
        raise CheckpointError(f"the tokenizer has {tokenizer.vocab_size} ids but the model only "
                              f"{model_cfg.vocab_size} embedding rows")
    model_cfg = objective.model_config(model_cfg)

    # ---- run folder
    if is_main:
        if not spec.resume:
            run_dir.mkdir(parents=True, exist_ok=True)
            if spec.force:
                _clear_run(run_dir)
            model_cfg.save(run_dir / "config.json")
            tokenizer.save(run_dir)
        remove_partial(run_dir)
        atomic_write_text(run_dir / TRAIN_FILE, to_yaml(model_cfg, train))

    trainer = make_trainer(model_cfg, train, objective, run_dir, rank=rank, world_size=world_size)
    resumed_from = None
    if spec.resume:
        resumed_from = latest_checkpoint(run_dir)
        if resumed_from is not None:
            trainer.restore(resumed_from)
        else:
            notes.append(f"{run_dir} has no checkpoint yet: starting it from step 0")
            trainer.forget_after(0)
            if train.init_from:
                trainer.load_pretrained(Path(train.init_from))
    elif init_from is not None:
        trainer.load_pretrained(init_from)
    if dataset is not None and is_main:
        n_train, n_val = len(dataset.splits["train"]), len(dataset.splits["val"])
        notes.append(f"data: {len(dataset):,} tokens ({n_train:,} train / {n_val:,} val) from {corpus_name(train)}")
    return PreparedRun(trainer, run_dir, tokenizer, resumed_from, notes)
