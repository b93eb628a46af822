"""Setting up a run: resolve the config, prepare the run folder, tokenizer and data, build the trainer.

    fresh run     the out folder must be new or empty (``force`` clears a previous run's files)
    resume        the run's own train.yaml is the config; only logging/hardware fields and
                  max_steps may change; training continues from the latest checkpoint in state/
    init_from     model config, weights and tokenizer come from another run folder (fine-tuning); with
                  lora_rank the run trains adapters on those frozen weights and its folder stores the
                  adapter and the base run's path (adapter.safetensors, adapter_config.json), not the weights

The run folder receives, before the first step: ``train.yaml`` (the resolved config),
``config.json`` (the model) and ``tokenizer.json``; checkpoints add ``model.safetensors`` and state/.

Crash safety (every state a ``kill -9`` can leave is either complete or resumable):

    creation      the first files are built in a hidden folder next to the run folder and renamed into
                  place in one step; a crash before that leaves no run folder (``--force`` into a folder
                  holding other files writes them one by one, train.yaml last)
    resume        validates everything first (configs, tokenizer, the checkpoint's files and checksums) and
                  writes nothing until then; it then republishes the run folder's files from the latest
                  checkpoint, which stores copies of them (train.yaml, config.json, tokenizer files, weights
                  and their manifest; loss.png and report.md are redrawn once the run is complete), so files
                  a crash left stale or a user deleted come back
    interrupted   with nothing trained yet (Ctrl-C before the first step), :func:`discard_untrained` removes
                  the files this run created
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinyformer.config import ModelConfig
from tinyformer.data.tokenizer import Tokenizer
from tinyformer.devices import autocast_dtype, resolve_device
from tinyformer.errors import CheckpointError, ConfigError
from tinyformer.sizing import check_buildable
from tinyformer.training.checkpoint import STATE_DIR, latest_checkpoint, remove_partial, run_file
from tinyformer.training.objectives import Objective, get_objective
from tinyformer.training.train_config import (
    RESUME_MUTABLE,
    TrainConfig,
    build_model_config,
    config_differences,
    read_run_file,
    to_yaml,
)
from tinyformer.training.trainer import Trainer
from tinyformer.utils.io import atomic_write_bytes, fsync_dir, remove_stale_temporaries, staging_folder

TRAIN_FILE = "train.yaml"
#: What a run folder holds; ``force`` deletes these and nothing else.
RUN_ENTRIES = ("config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
               "tokenizer_config.json", TRAIN_FILE, STATE_DIR, "metrics.jsonl", "samples.txt", "loss.png",
               "tensorboard", "report.md", "manifest.json", "adapter.safetensors", "adapter_config.json")
#: The run folder's small files stored with every checkpoint, so that a resume can put them back.
RUN_FILES = (TRAIN_FILE, "config.json", "tokenizer.json", "tokenizer_config.json")


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
    #: ``Trainer.builtin_task_scorer``: what adds the built-in task's accuracy to report.md (cli/train.py
    #: passes ``evaluation.tasks.add_builtin_accuracy``)
    builtin_task_scorer: Callable[..., object] | None = None


def default_run_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def _objective_schedule(spec: RunSpec, objective_cls: type[Objective], train: TrainConfig
                        ) -> tuple[TrainConfig, str | None]:
    """``train`` with the schedule fields the objective chooses for its own run length
    (:meth:`Objective.default_schedule`) in place of those the user did not give; and a phrase saying so."""
    given = {*spec.sections.get("train", {}), *spec.train_overrides}
    chosen = {k: v for k, v in objective_cls.default_schedule(train).items() if k not in given}
    if not chosen:
        return train, None
    return train.replace(**chosen), f"{train.objective}'s default for {train.max_steps} steps"


def _clear_run(run_dir: Path) -> None:
    for name in RUN_ENTRIES:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    for shard in run_dir.glob("model-*-of-*.safetensors"):
        shard.unlink()


def _check_resumable(run_dir: Path) -> Path | None:
    """The latest complete checkpoint of a run that can be resumed (None: not saved yet); reads only."""
    if not run_dir.is_dir():
        raise CheckpointError(f"--resume: run folder {run_dir} does not exist")
    state = run_dir / STATE_DIR
    if state.exists() and not state.is_dir():
        raise CheckpointError(f"--resume: {state} is not a folder (the run's checkpoints belong there); move it "
                              "away and resume again")
    return latest_checkpoint(run_dir)


def _saved_configs(run_dir: Path, latest: Path | None) -> tuple[ModelConfig, TrainConfig]:
    """The run's configs from its train.yaml, or from the copy in its latest checkpoint when it is gone."""
    path = run_dir / TRAIN_FILE
    if not path.is_file() and latest is not None and run_file(latest, TRAIN_FILE) is not None:
        path = latest / TRAIN_FILE
    if not path.is_file():
        raise CheckpointError(f"--resume: {run_dir} has no {TRAIN_FILE}; is it a tinyformer training run?")
    saved = read_run_file(path)
    try:
        return build_model_config(saved["model"]), TrainConfig.from_dict(saved["train"])
    except ConfigError as exc:
        raise CheckpointError(f"--resume: {path} is not a valid run config: {exc}") from None


def _resume_tokenizer(run_dir: Path, latest: Path | None) -> Tokenizer:
    """The run's tokenizer: the checkpoint's copy when it has one (the run folder's may be gone)."""
    if latest is not None and run_file(latest, "tokenizer.json") is not None:
        return Tokenizer.load(latest)
    if not (run_dir / "tokenizer.json").is_file():
        raise CheckpointError(f"--resume: {run_dir} has no tokenizer.json and its checkpoint no copy of it")
    return Tokenizer.load(run_dir)


def _resume_configs(spec: RunSpec, run_dir: Path, latest: Path | None) -> tuple[ModelConfig, TrainConfig]:
    """The saved configs, with the changes a resume may make; anything else that differs is an error."""
    model_cfg, train = _saved_configs(run_dir, latest)
    if spec.config_file is not None:  # the whole file is the request
        asked_train = TrainConfig.from_dict({**spec.sections.get("train", {}), **spec.train_overrides})
        asked_train = _objective_schedule(spec, get_objective(asked_train.objective), asked_train)[0]
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
        section, diff, saved, wanted = (("model", model_diff, model_cfg, asked_model) if model_diff
                                        else ("train", train_diff, train, asked_train))
        key = min(diff, key=lambda k: k not in asked)  # the first field the user changed, else the first that differs
        name, have, want = f"{section}.{key}", getattr(saved, key), getattr(wanted, key)
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
    created: bool = False  # this invocation made the run folder (it did not exist or was empty)
    fresh: bool = False  # this invocation wrote the run's first files (a new run, not a resume)
    schedule_source: str | None = None  # how the objective chose schedule fields the user left unset


def _run_file_bytes(model_cfg: ModelConfig, train: TrainConfig, tokenizer: Tokenizer) -> dict[str, bytes]:
    """train.yaml, config.json and the tokenizer files of a new run, as bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(tmp)
        files = {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir())}
    files["config.json"] = (model_cfg.to_json() + "\n").encode()
    files[TRAIN_FILE] = to_yaml(model_cfg, train).encode()
    return files


def _create_run(run_dir: Path, files: dict[str, bytes], force: bool) -> bool:
    """Write a new run's first files as the module docstring's "creation" says; returns True when the folder
    itself was created (or was empty)."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(run_dir, "", "creating-")  # staging folders of creations that were killed
    if run_dir.is_dir() and any(run_dir.iterdir()):
        _clear_run(run_dir)
        for name in sorted(files, key=lambda n: n == TRAIN_FILE):
            atomic_write_bytes(run_dir / name, files[name])
        return False
    staging = staging_folder(run_dir, infix="creating-")
    try:
        for name, data in files.items():
            atomic_write_bytes(staging / name, data)
        if run_dir.is_dir():  # empty: rename() replaces an empty folder on POSIX, not on Windows
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        os.rename(staging, run_dir)
        fsync_dir(run_dir.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return True


def discard_untrained(run_dir: Path, created: bool) -> None:
    """Remove the run files of a new run that was stopped before its first step (and the folder, when this
    run created it and nothing else is in it), so that no empty run is left behind."""
    _clear_run(run_dir)
    if created:
        with contextlib.suppress(OSError):
            run_dir.rmdir()


def publish_resumed(trainer: Trainer, latest: Path | None, files: dict[str, bytes]) -> None:
    """Bring the run folder of a resumed run up to its latest checkpoint (the module docstring's "resume"):
    a published file is rewritten if it differs or is missing; logs after the checkpoint's step are dropped."""
    run_dir = trainer.run_dir
    remove_partial(run_dir)
    if latest is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            data = run_file(latest, name)
            if data is not None:
                files[name] = data
    for name, data in files.items():
        path = run_dir / name
        if not path.is_file() or path.read_bytes() != data:
            atomic_write_bytes(path, data)
    trainer.run_files = {name: (run_dir / name).read_bytes() for name in RUN_FILES if (run_dir / name).is_file()}
    trainer.forget_after(trainer.step)
    if latest is not None:
        trainer.publish_weights(latest)
        if trainer.step >= trainer.cfg.max_steps:  # fit() will not run to draw or write them
            trainer.plot()
            trainer.write_report()


def prepare_run(spec: RunSpec, *, rank: int = 0, world_size: int = 1,
                log: Callable[[str], None] = print, make_trainer: Callable[..., Trainer] = Trainer) -> PreparedRun:
    """Resolve configs, set up the run folder, tokenizer and data; return a trainer ready to ``fit()``.

    ``make_trainer`` builds the trainer (called with Trainer's arguments) once the run folder is ready."""
    from tinyformer.training.prepare import (
        build_dataset,
        check_sample_prompt,
        check_windows,
        corpus_name,
        train_tokenizer,
    )

    run_dir = Path(spec.out) if spec.out else (None if spec.resume else default_run_dir())
    if run_dir is None:
        raise ConfigError("--resume needs the run folder: --resume RUN or --out RUN --resume")
    notes: list[str] = []
    is_main = rank == 0

    # ---- configs (all checks that need no data come first: they fail in a second, not a minute)
    latest = None
    if spec.resume:
        latest = _check_resumable(run_dir)
        model_cfg, train = _resume_configs(spec, run_dir, latest)
        init_from = None
    else:
        if run_dir.exists() and not run_dir.is_dir():
            raise ConfigError(f"--out {run_dir} is a file, not a folder")
        if run_dir.is_dir() and any(run_dir.iterdir()) and not spec.force:
            raise CheckpointError(
                f"run folder {run_dir} already exists and is not empty; use --resume to continue it, --force to "
                "start over (deleting its checkpoints), or another --out"
            )
        train = TrainConfig.from_dict({**spec.sections.get("train", {}), **spec.train_overrides})
        model_fields = {**spec.sections.get("model", {}), **spec.model_overrides}
        if train.init_from is not None and "preset" in model_fields:
            raise ConfigError("--init-from takes the model from that run; drop the model preset")
        model_cfg = build_model_config(model_fields) if train.init_from is None else None  # else init_from's, below
        init_from = Path(train.init_from) if train.init_from else None
        if init_from is not None:
            from tinyformer.run_folder import load_config

            model_cfg = load_config(init_from)
            if "quantization" in model_cfg.extra:
                raise ConfigError(f"--init-from {init_from}: a quantized run cannot be trained; start from the "
                                  "float run it was quantized from")
            changes = {k: v for k, v in model_fields.items() if k != "vocab_size"}
            model_cfg = model_cfg.replace(**changes) if changes else model_cfg
    if train.lora_rank is not None and not spec.resume and init_from is None:
        raise ConfigError("--lora-rank trains adapters on a trained model: give it with --init-from RUN")
    if train.lora_rank is not None and world_size > 1:
        raise ConfigError("LoRA runs train in one process; drop --nproc (the adapters are small enough)")
    objective_cls = get_objective(train.objective)
    schedule_source = None
    if not spec.resume:
        train, schedule_source = _objective_schedule(spec, objective_cls, train)
    autocast_dtype(train.dtype, resolve_device(train.device))  # an impossible device/dtype fails before any data work
    if objective_cls.uses_corpus or objective_cls.uses_block_size:  # batches of block_size tokens
        if train.block_size is None:
            train = train.replace(block_size=model_cfg.max_seq_len)
        elif train.block_size > model_cfg.max_seq_len:
            raise ConfigError(f"train.block_size {train.block_size} is above the model's max_seq_len "
                              f"{model_cfg.max_seq_len}; use --block-size <= {model_cfg.max_seq_len} or raise "
                              "--model.max_seq_len")
    check_buildable(model_cfg)  # an absurd size fails here, not in the allocator after the tokenizer is trained

    # ---- tokenizer and data
    if spec.resume:
        tokenizer = _resume_tokenizer(run_dir, latest)
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
    if not spec.resume:
        tokenizer = objective_cls.adapt_tokenizer(tokenizer)
    dataset = None
    if objective_cls.uses_corpus:
        check_sample_prompt(train, tokenizer)
        dataset = build_dataset(train, tokenizer)
        check_windows(dataset, train.block_size, world_size)
    objective: Objective = objective_cls(train, tokenizer, dataset)
    if not spec.resume and init_from is None:
        model_cfg = model_cfg.replace(vocab_size=tokenizer.vocab_size)
    vocab_before = model_cfg.vocab_size
    model_cfg = objective.model_config(model_cfg)
    if train.lora_rank is not None and not spec.resume and model_cfg.vocab_size != vocab_before:
        # the new rows would be trained by nothing (the base is frozen) and stored nowhere (the adapter holds A, B)
        raise ConfigError(f"--lora-rank keeps {init_from} frozen, but --objective {train.objective} adds the chat "
                          f"template's tokens to its tokenizer ({vocab_before} -> {model_cfg.vocab_size} ids): run "
                          "it once without --lora-rank, or start from a run that has a chat template")
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise CheckpointError(f"the tokenizer has {tokenizer.vocab_size} ids but the model only "
                              f"{model_cfg.vocab_size} embedding rows")

    # ---- run folder: a new run's files are written here; a resume writes only once the checkpoint loaded
    files = _run_file_bytes(model_cfg, train, tokenizer) if is_main else {}
    created = False
    if is_main and not spec.resume:
        created = _create_run(run_dir, files, spec.force)
        lora = train.lora_config()
        if lora is not None and init_from is not None:
            from tinyformer.run_folder import write_adapter_config

            write_adapter_config(run_dir, lora.to_dict(), init_from)

    try:
        trainer = make_trainer(model_cfg, train, objective, run_dir, rank=rank, world_size=world_size)
        trainer.run_files = files
        trainer.builtin_task_scorer = spec.builtin_task_scorer
        if spec.resume:
            if latest is not None:
                trainer.restore(latest)
            else:
                notes.append(f"{run_dir} has no checkpoint yet: starting it from step 0")
                if train.init_from:
                    trainer.load_pretrained(Path(train.init_from))
            if is_main:
                publish_resumed(trainer, latest, {k: v for k, v in files.items() if k in (TRAIN_FILE, "config.json")})
        elif init_from is not None:
            trainer.load_pretrained(init_from)
    except BaseException:  # Ctrl-C or an error before the first step: a new run leaves nothing behind
        if is_main and not spec.resume:
            discard_untrained(run_dir, created)
        raise
    if init_from is not None and not spec.resume:
        n_params = sum(p.numel() for p in trainer.model.parameters())
        notes.append(f"initialised from {init_from}: its weights ({n_params:,} parameters, {model_cfg.arch}, "
                     f"{model_cfg.n_layer} layers) and its {tokenizer.kind} tokenizer ({tokenizer.vocab_size} ids)")
    data_note = objective.describe_data() if is_main else None
    if data_note:
        notes.append(data_note)
    if dataset is not None and is_main:
        n_train, n_val = len(dataset.splits["train"]), len(dataset.splits["val"])
        notes.append(f"data: {len(dataset):,} tokens ({n_train:,} train / {n_val:,} val) from {corpus_name(train)}")
    return PreparedRun(trainer, run_dir, tokenizer, latest, notes, created=created, fresh=not spec.resume,
                       schedule_source=schedule_source)


def prepare_distributed_run(spec: RunSpec) -> PreparedRun:
    """:func:`prepare_run` for every rank of a job (or a single process; training/distributed.py).

    Rank 0 resolves the run folder and prepares it (tokenizer, token cache, train.yaml, config.json) while
    the others wait; they then open it as a resume does (or, for a resume, resolve the same request), so
    every rank trains the same resolved config with the same tokenizer, and nothing is written twice.
    """
    import torch.distributed as dist

    from tinyformer.training.distributed import barrier, init_distributed

    ctx = init_distributed()
    if ctx.world_size == 1:
        return prepare_run(spec)
    box = [str(spec.out or default_run_dir()) if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)  # rank 0's run folder, on every rank
    out = box[0]
    if ctx.is_main:
        def rank0_trainer(*args: Any, **kwargs: Any) -> Trainer:
            barrier()  # the run folder is ready: let the other ranks open it
            return Trainer(*args, **kwargs)

        return prepare_run(dataclasses.replace(spec, out=out), rank=0, world_size=ctx.world_size,
                           make_trainer=rank0_trainer)
    barrier()
    # A new run: open what rank 0 wrote. A resume: resolve the same request as rank 0 (which writes the
    # resolved train.yaml only once its checkpoint has loaded, after this barrier).
    own = dataclasses.replace(spec, out=out) if spec.resume else RunSpec(out=out, resume=True)
    return prepare_run(own, rank=ctx.rank, world_size=ctx.world_size)
