"""Training checkpoints: everything a run needs to continue bit for bit, written atomically.

    RUN/state/step-000500/
        model.safetensors       the weights (a tied head stored once, as in the run folder); a LoRA run's
                                adapters only (its base is frozen: the base run holds it)
        optimizer.safetensors   optimizer moments, RNG states (torch, CUDA, numpy, python, data)
        trainer.json            step, tokens seen, optimizer hyper-parameters, RNG scalars, scaler

A checkpoint is written into ``state/.tmp-step-000500-<pid>/`` (every file fsynced), then the
folder is renamed to ``step-000500`` in one step: a crash, ``kill -9`` or full disk at any moment
leaves either the complete new checkpoint or none, and the previous ones untouched. Only the last
``keep_last`` are kept. Nothing is pickled: tensors go to safetensors, the rest to JSON.
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
from tinyformer.run_folder import state_dict_for_saving
from tinyformer.utils.io import fsync_dir

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


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """safetensors bytes written through Python's file API, so a full disk raises OSError(ENOSPC)."""
    from safetensors.torch import save

    _write_file(path, save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}))


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        return load_file(str(path))
    except SafetensorError as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from None


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


def remove_partial(run_dir: str | Path) -> None:
    """Delete temporary checkpoint folders a crash left behind (they are never read)."""
    state = Path(run_dir) / STATE_DIR
    if state.is_dir():
        for child in state.iterdir():
            if child.name.startswith(".tmp-") or child.name.startswith(".old-"):
                shutil.rmtree(child, ignore_errors=True)


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
) -> Path:
    """Write checkpoint ``step`` atomically and prune to the last ``keep_last``; returns its folder.

    ``model_state`` / ``optimizer_state`` replace ``model``'s and ``optimizer``'s own state dicts when the
    caller has gathered them (a sharded model's consolidated weights); ``extra_tensors`` (e.g. every
    rank's random streams) are stored next to the optimizer state.

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
        write_tensors(tmp / MODEL_FILE, state_dict_for_saving(model) if model_state is None else model_state)
        optim_tensors, optim_meta = optimizer_to_tensors(
            optimizer.state_dict() if optimizer_state is None else optimizer_state)
        rng_tensors, rng_meta = capture_rng(data_generator)
        write_tensors(tmp / OPTIM_FILE, {**optim_tensors, **rng_tensors, **(extra_tensors or {})})
        meta = {
            "format_version": STATE_FORMAT_VERSION,
            "step": step,
            "trainer": trainer_state,
            "optimizer": optim_meta,
            "rng": rng_meta,
            "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
        }
        _write_file(tmp / TRAINER_FILE, (json.dumps(meta, indent=1) + "\n").encode())
        fsync_dir(tmp)
        if final.exists():  # the same step saved again (e.g. the last step): swap it out
            old = state_dir / f".old-step-{step:06d}-{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        fsync_dir(state_dir)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise disk_error(exc, f"the checkpoint of step {step} to {state_dir}", previous) from None
    for _, old_dir in step_dirs(run_dir)[:-keep_last]:
        shutil.rmtree(old_dir, ignore_errors=True)
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
    try:
        meta = json.loads((ckpt_dir / TRAINER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {ckpt_dir / TRAINER_FILE}: {exc}") from None
    if meta.get("format_version") != STATE_FORMAT_VERSION:
        raise CheckpointError(f"{ckpt_dir} has state format {meta.get('format_version')!r}, expected "
                              f"{STATE_FORMAT_VERSION}")
    load_weights(model, read_tensors(ckpt_dir / MODEL_FILE), str(ckpt_dir / MODEL_FILE), assign=assign_weights,
                 own=own_weights)
    tensors = read_tensors(ckpt_dir / OPTIM_FILE)
    state = optimizer_from_tensors(tensors, meta["optimizer"])
    saved_sizes = [len(g["params"]) for g in state["param_groups"]]
    own_sizes = [len(g["params"]) for g in optimizer.param_groups]
    if saved_sizes != own_sizes:
        raise CheckpointError(f"{ckpt_dir}: optimizer groups hold {saved_sizes} tensors, this model needs "
                              f"{own_sizes}: the checkpoint is from another config")
    for pid, values in state["state"].items():
        for key, value in values.items():
            param = _param_by_index(optimizer, pid)
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise CheckpointError(f"{ckpt_dir}: optimizer state {key} of tensor {pid} has shape "
                                      f"{tuple(value.shape)}, this model needs {tuple(param.shape)}")
    (assign_optimizer or optimizer.load_state_dict)(state)
    restore_rng(tensors, meta["rng"], data_generator)
    if scaler is not None and meta.get("scaler"):
        scaler.load_state_dict(meta["scaler"])
    return {"step": int(meta["step"]), **meta["trainer"]}


def _param_by_index(optimizer: torch.optim.Optimizer, index: int) -> torch.Tensor:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not 0 <= index < len(params):
        raise CheckpointError(f"optimizer state names tensor {index}, the model has {len(params)}")
    return params[index]
