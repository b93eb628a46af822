"""Training checkpoints: everything a run needs to continue bit for bit, written atomically.

    RUN/state/step-000500/
        model.safetensors       the weights (a tied head stored once, as in the run folder); a LoRA run's
                                adapters only (its base is frozen: the base run holds it)
        optimizer.safetensors   optimizer moments, RNG states (torch, CUDA, numpy, python, data)
        trainer.json            step, tokens seen, running log windows, optimizer hyper-parameters, RNG scalars,
                                scaler, and the CRC-32 of every other file of the folder (checked on load)
        train.yaml, config.json, tokenizer.json, tokenizer_config.json
                                the run folder's files at that step, so that a resume can republish them

A checkpoint is written into ``state/.tmp-step-000500-<pid>/`` (every file fsynced), then the
folder is renamed to ``step-000500`` in one step: a crash, ``kill -9`` or full disk at any moment
leaves either the complete new checkpoint or none, and the previous ones untouched. Only the last
``keep_last`` are kept; an older one is pruned by renaming it to ``.old-step-*`` first, so an
interrupted pruning never leaves a half-deleted ``step-*`` folder. Nothing is pickled: tensors go to
safetensors, the rest to JSON.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tinyformer.errors import CheckpointError
from tinyformer.integrity import bytes_checksum, file_checksum
from tinyformer.run_folder import load_safetensors, state_dict_for_saving
from tinyformer.utils.io import fsync_dir, replace_folder

STATE_DIR = "state"
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
TRAINER_FILE = "trainer.json"
STATE_FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")


# ---------------------------------------------------------------------------- optimizer state


def optimizer_to_tensors(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into safetensors-able tensors and JSON-able values.

    ``state[i][key]`` tensors become ``optim.<i>.<key>``; non-tensor values and ``param_groups``
    go to the JSON part. The inverse is :func:`optimizer_from_tensors`.
    """
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, values in state_dict["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{pid}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in state_dict["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_from_tensors(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """Rebuild an optimizer ``state_dict`` from :func:`optimizer_to_tensors`' two parts."""
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if not name.startswith("optim."):
            continue
        _, pid, key = name.split(".", 2)
        state.setdefault(int(pid), {})[key] = value
    for pid, values in meta.get("scalars", {}).items():
        state.setdefault(int(pid), {}).update(values)
    groups = [
        {k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()}
        for g in meta["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------------------- RNG state


def capture_rng(data_generator: torch.Generator | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every random stream training draws from: torch (CPU and CUDA), numpy, python, the data sampler."""
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    if data_generator is not None:
        tensors["rng.data"] = data_generator.get_state()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    tensors["rng.numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    version, internal, gauss_next = random.getstate()
    tensors["rng.python"] = torch.tensor(internal, dtype=torch.int64)
    meta = {"numpy": [kind, int(pos), int(has_gauss), float(gauss)], "python": [version, gauss_next]}
    return tensors, meta


def restore_rng(tensors: dict[str, torch.Tensor], meta: dict[str, Any], data_generator: torch.Generator | None) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("rng.cuda.")),
                                       key=lambda k: int(k.rsplit(".", 1)[1]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    if data_generator is not None and "rng.data" in tensors:
        data_generator.set_state(tensors["rng.data"])
    kind, pos, has_gauss, gauss = meta["numpy"]
    np.random.set_state((kind, tensors["rng.numpy"].numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, gauss_next = meta["python"]
    random.setstate((version, tuple(int(x) for x in tensors["rng.python"].tolist()), gauss_next))


# ---------------------------------------------------------------------------- files


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    """safetensors bytes written through Python's file API, so a full disk raises OSError(ENOSPC); returns
    their CRC-32 (integrity.bytes_checksum)."""
    from safetensors.torch import save

    data = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})
    _write_file(path, data)
    return bytes_checksum(data)


def read_tensors(path: Path, checksum: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file, its CRC-32 compared with ``checksum`` first when one was recorded."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    if checksum is not None and file_checksum(path) != checksum:
        raise CheckpointError(f"{path} does not match the checksum recorded when it was written: the checkpoint "
                              f"is corrupt; {_older(path.parent)}")
    return load_safetensors(path)


def step_dirs(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as (step, folder), oldest first."""
    state = Path(run_dir) / STATE_DIR
    if not state.is_dir():
        return []
    found = []
    for child in state.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and (child / TRAINER_FILE).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    dirs = step_dirs(run_dir)
    return dirs[-1][1] if dirs else None


def _older(ckpt_dir: Path) -> str:
    """What a user can do about a corrupt checkpoint: resume from the one before, if there is one."""
    earlier = [d for _, d in step_dirs(ckpt_dir.parent.parent) if d.name < ckpt_dir.name]
    if earlier:
        return f"delete {ckpt_dir} to resume from {earlier[-1].name}"
    return "no earlier checkpoint exists"


def remove_partial(run_dir: str | Path) -> None:
    """Delete what a crash left behind in state/: temporary checkpoint folders, folders being pruned, and
    ``step-*`` folders without their trainer.json (an interrupted deletion); none of them is ever read."""
    state = Path(run_dir) / STATE_DIR
    if state.is_dir():
        for child in state.iterdir():
            partial = _STEP_DIR.match(child.name) and child.is_dir() and not (child / TRAINER_FILE).is_file()
            if child.name.startswith(".tmp-") or child.name.startswith(".old-") or partial:
                shutil.rmtree(child, ignore_errors=True)


def prune(run_dir: str | Path, keep_last: int) -> None:
    """Delete all but the last ``keep_last`` checkpoints: each is first renamed out of the ``step-*``
    names (one atomic step), so a crash mid-deletion leaves a hidden folder that remove_partial clears."""
    for _, old_dir in step_dirs(run_dir)[:-keep_last]:
        doomed = old_dir.parent / f".old-{old_dir.name}-{os.getpid()}"
        try:
            old_dir.rename(doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)


def disk_error(exc: OSError, what: str, previous: str) -> CheckpointError:
    """A one-line error for a failed write; ENOSPC is named as a full disk."""
    if exc.errno == errno.ENOSPC:
        return CheckpointError(f"no space left on device while writing {what}; {previous}; free disk space "
                               "and continue with --resume")
    return CheckpointError(f"cannot write {what}: {exc.strerror or exc}; {previous}")


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    data_generator: torch.Generator | None,
    keep_last: int,
    scaler: torch.amp.GradScaler | None = None,
    *,
    model_state: dict[str, torch.Tensor] | None = None,
    optimizer_state: dict[str, Any] | None = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
    run_files: dict[str, bytes] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically and prune to the last ``keep_last``; returns its folder.

    ``model_state`` / ``optimizer_state`` replace ``model``'s and ``optimizer``'s own state dicts when the
    caller has gathered them (a sharded model's consolidated weights); ``extra_tensors`` (e.g. every
    rank's random streams) are stored next to the optimizer state; ``run_files`` (name -> bytes: the run
    folder's train.yaml, config.json, tokenizer files) are stored with the checkpoint for a resume to republish.

    Raises :class:`CheckpointError` on a write failure (e.g. a full disk) after removing the partial
    folder: the earlier checkpoints are intact.
    """
    state_dir = Path(run_dir) / STATE_DIR
    final = state_dir / f"step-{step:06d}"
    tmp = state_dir / f".tmp-step-{step:06d}-{os.getpid()}"
    prev = latest_checkpoint(run_dir)
    previous = f"the previous checkpoint {prev} is intact" if prev else "no earlier checkpoint exists"
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        checksums = {MODEL_FILE: write_tensors(
            tmp / MODEL_FILE, state_dict_for_saving(model) if model_state is None else model_state)}
        optim_tensors, optim_meta = optimizer_to_tensors(
            optimizer.state_dict() if optimizer_state is None else optimizer_state)
        rng_tensors, rng_meta = capture_rng(data_generator)
        checksums[OPTIM_FILE] = write_tensors(tmp / OPTIM_FILE, {**optim_tensors, **rng_tensors,
                                                                 **(extra_tensors or {})})
        for name, data in (run_files or {}).items():
            _write_file(tmp / name, data)
            checksums[name] = bytes_checksum(data)
        meta = {
            "format_version": STATE_FORMAT_VERSION,
            "step": step,
            "trainer": trainer_state,
            "optimizer": optim_meta,
            "rng": rng_meta,
            "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
            "checksums": checksums,
        }
        _write_file(tmp / TRAINER_FILE, (json.dumps(meta, indent=1) + "\n").encode())
        fsync_dir(tmp)
        # the same step saved again (e.g. the last step) is swapped out
        replace_folder(tmp, final, state_dir / f".old-step-{step:06d}-{os.getpid()}")
        fsync_dir(state_dir)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise disk_error(exc, f"the checkpoint of step {step} to {state_dir}", previous) from None
    prune(run_dir, keep_last)
    return final


def load_weights(model: nn.Module, tensors: dict[str, torch.Tensor], source: str, *,
                 assign: Callable[[dict[str, torch.Tensor]], None] | None = None,
                 own: dict[str, torch.Tensor] | None = None) -> None:
    """Copy ``tensors`` into ``model``'s parameters in place, strictly (names and shapes must match).

    Copying (not re-assigning) keeps the parameter objects, so an optimizer built on them stays valid.
    ``assign`` replaces the copy, once the tensors are checked (e.g. to shard them into a distributed model).
    ``own`` (default: the whole state dict) is the part of the model's state the tensors fill, e.g. a LoRA
    model's adapters only, or its base weights only.
    """
    own = model.state_dict() if own is None else own
    cfg = getattr(model, "cfg", None)
    tied = bool(getattr(cfg, "tie_embeddings", False)) and "lm_head.weight" in own and "tok_emb.weight" in own
    expected = set(own) - ({"lm_head.weight"} if tied else set())
    unknown = sorted(set(tensors) - expected)
    missing = sorted(expected - set(tensors))
    if unknown or missing:
        what = f"unexpected tensor(s) {', '.join(unknown[:3])}" if unknown else f"missing {', '.join(missing[:3])}"
        raise CheckpointError(f"{source} does not match this model's config: {what}")
    for key, value in tensors.items():
        if tuple(value.shape) != tuple(own[key].shape):
            raise CheckpointError(
                f"{source} does not match this model's config: {key} has shape {tuple(value.shape)}, "
                f"the config needs {tuple(own[key].shape)}"
            )
    if assign is not None:
        assign(tensors)
        return
    with torch.no_grad():
        for key, value in tensors.items():
            own[key].copy_(value)


def load_checkpoint(
    ckpt_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data_generator: torch.Generator | None,
    scaler: torch.amp.GradScaler | None = None,
    *,
    assign_weights: Callable[[dict[str, torch.Tensor]], None] | None = None,
    assign_optimizer: Callable[[dict[str, Any]], None] | None = None,
    own_weights: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Restore weights, optimizer, RNG streams and scaler from ``ckpt_dir``; returns the trainer state.

    ``assign_weights`` / ``assign_optimizer`` put the checked state into the model and optimizer instead
    of ``load_state_dict`` (a sharded model re-shards the consolidated state there); ``own_weights`` is the
    part of the model's state the checkpoint holds (a LoRA run's adapters; default all of it)."""
    meta = read_meta(ckpt_dir)
    sums = meta.get("checksums") or {}
    load_weights(model, read_tensors(ckpt_dir / MODEL_FILE, sums.get(MODEL_FILE)), str(ckpt_dir / MODEL_FILE),
                 assign=assign_weights, own=own_weights)
    tensors = read_tensors(ckpt_dir / OPTIM_FILE, sums.get(OPTIM_FILE))
    state = optimizer_from_tensors(tensors, meta["optimizer"])
    saved_sizes = [len(g["params"]) for g in state["param_groups"]]
    own_sizes = [len(g["params"]) for g in optimizer.param_groups]
    if saved_sizes != own_sizes:
        raise CheckpointError(f"{ckpt_dir}: optimizer groups hold {saved_sizes} tensors, this model needs "
                              f"{own_sizes}: the checkpoint is from another config")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for pid, values in state["state"].items():
        if values and not 0 <= pid < len(params):
            raise CheckpointError(f"optimizer state names tensor {pid}, the model has {len(params)}")
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[pid].shape:
                raise CheckpointError(f"{ckpt_dir}: optimizer state {key} of tensor {pid} has shape "
                                      f"{tuple(value.shape)}, this model needs {tuple(params[pid].shape)}")
    (assign_optimizer or optimizer.load_state_dict)(state)
    restore_rng(tensors, meta["rng"], data_generator)
    if scaler is not None and meta.get("scaler"):
        scaler.load_state_dict(meta["scaler"])
    return {"step": int(meta["step"]), **meta["trainer"]}


def read_meta(ckpt_dir: Path) -> dict[str, Any]:
    """A checkpoint's trainer.json, checked to be readable and of this format."""
    try:
        meta = json.loads((ckpt_dir / TRAINER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {ckpt_dir / TRAINER_FILE}: {exc}; {_older(ckpt_dir)}") from None
    if not isinstance(meta, dict) or meta.get("format_version") != STATE_FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise CheckpointError(f"{ckpt_dir} has state format {version!r}, expected {STATE_FORMAT_VERSION}")
    for key in ("step", "optimizer", "rng", "trainer"):  # every field a resume reads; name the first one missing
        if key not in meta:
            raise CheckpointError(f"{ckpt_dir / TRAINER_FILE} has no {key!r} field: the checkpoint is damaged; "
                                  "remove that step's folder to resume from an earlier one")
    return meta


def run_file(ckpt_dir: Path, name: str) -> bytes | None:
    """A run-folder file stored with the checkpoint (checked against its CRC-32), or None when the
    checkpoint has none (checkpoints written before run files were stored)."""
    path = ckpt_dir / name
    if not path.is_file():
        return None
    data = path.read_bytes()
    expected = (read_meta(ckpt_dir).get("checksums") or {}).get(name)
    if expected is not None and bytes_checksum(data) != expected:
        raise CheckpointError(f"{path} does not match the checksum recorded when it was written: the checkpoint "
                              f"is corrupt; {_older(ckpt_dir)}")
    return data
