"""Data-parallel training on PyTorch's distributed engine: DDP or FSDP2 wrapped around an unchanged model.

    torchrun --nproc_per_node N -m tinyformer train ...     N processes ("ranks"), one per device
    tinyformer train --nproc N ...                          the same; the command launches them itself

The model code knows nothing of this: parallelism wraps it from outside (:meth:`Trainer.wrap_model`).
With W ranks, each running A micro-steps of B sequences per update, rank r draws its micro-batches from its
own disjoint slice of the training data (``TokenDataset.get_batch(..., rank=r, world_size=W)``), and

    ddp   (DistributedDataParallel) every rank holds all weights and AdamW moments; backward all-reduces
          the gradients, g = (1/W) sum_r g_r, in buckets overlapped with the backward pass.
    fsdp  (FSDP2, ``fully_shard``) every rank holds 1/W of each weight, gradient and moment (DTensor shards);
          a block's weights are all-gathered just before its forward and backward and freed after, the
          gradients are reduce-scattered (averaged), and each rank's AdamW updates its own shard.
          Memory per rank ~ (weights + gradients + 2 moments) / W + one block's full weights.

Either way an update equals one process accumulating gradients over the A * W micro-batches of the global
batch (tests/training/test_distributed.py checks it to 1e-6), so the learning-rate schedule, batch and token counts
are stated in global terms. Only rank 0 logs, draws the progress bar and writes files.

Checkpoints hold consolidated weights (model.safetensors) and optimizer state: ``get_model_state_dict`` /
``get_optimizer_state_dict`` with ``full_state_dict=True, cpu_offload=True`` gather them on rank 0 and
``set_*`` re-shard them on load, so a run saved by N ranks resumes on M. Each rank's random streams (dropout
and the data sampler) are saved too, so a resume with the same number of ranks is exact; with another number
the sampler (identical on every rank by construction) is kept and dropout is reseeded from (seed, rank, step).

Process groups: gloo for CPU tensors, NCCL for CUDA tensors. A rank that fails takes the job down: the
launcher stops the other ranks, and a collective waits at most ``$TINYFORMER_DIST_TIMEOUT`` seconds
(default 600) for a peer that vanished.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tinyformer.errors import ConfigError, TinyformerError

if TYPE_CHECKING:
    from tinyformer.training.trainer import Trainer

#: Methods of a model that objectives call instead of ``forward`` (e.g. ``model.loss(x, y)``); the
#: wrappers treat them as forward passes so gradients still synchronise and shards still gather.
FORWARD_METHODS = ("loss", "hidden_states", "encode", "cross_kv", "decode")
TIMEOUT_ENV = "TINYFORMER_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0


# ---------------------------------------------------------------------------- process group


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in the job: its global ``rank`` of ``world_size`` and its ``local_rank``
    (index among the processes of its node, i.e. which GPU it drives)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """True in a worker started by torchrun / the elastic launcher (they set RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed() -> DistContext:
    """Join the job this process was launched into, or describe a plain single process.

    Under torchrun: binds the process to GPU ``LOCAL_RANK`` (when CUDA is present), creates the default
    process group (gloo for CPU tensors; plus NCCL for CUDA tensors on a GPU machine) and silences stdout
    on ranks other than 0 (their errors still reach stderr). Idempotent.
    """
    import torch.distributed as dist

    if not launched_by_torchrun():
        return DistContext()
    ctx = DistContext(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(ctx.local_rank % torch.cuda.device_count())
            backend = "cpu:gloo,cuda:nccl"
        else:
            backend = "gloo"
        raw = os.environ.get(TIMEOUT_ENV)
        try:
            seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
        except ValueError:
            raise ConfigError(f"${TIMEOUT_ENV}={raw!r} must be a number of seconds") from None
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=seconds))
        atexit.register(shutdown_distributed)
    if not ctx.is_main:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- lives as long as the process
    return ctx


def shutdown_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------------------- wrappers


class MethodDDP(nn.parallel.DistributedDataParallel):
    """DDP that also runs the module's :data:`FORWARD_METHODS` as forward passes.

    DDP synchronises gradients of what runs through its ``forward``; an objective that calls
    ``model.loss(...)`` gets that method run in place of the module's forward for the call.
    """

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in FORWARD_METHODS and hasattr(self.module, name):
                return functools.partial(self._as_forward, name)
            raise

    def _as_forward(self, name: str, *args: Any, **kwargs: Any) -> Any:
        module, method = self.module, getattr(self.module, name)

        def once(*a: Any, **k: Any) -> Any:
            del module.forward  # the class's forward again, for calls the method itself makes (self(...))
            return method(*a, **k)

        module.forward = once  # an instance attribute shadows the class method, for DDP's one call
        try:
            return self(*args, **kwargs)
        finally:
            module.__dict__.pop("forward", None)


def lockstep(batches: Iterable[Any], device: torch.device) -> Iterator[Any]:
    """Yield ``batches`` while every rank still has one, so that all ranks run the same number of
    forward passes (each forward of a sharded model is a collective; ranks' shards may hold one
    window more or less)."""
    import torch.distributed as dist

    iterator = iter(batches)
    while True:
        batch = next(iterator, None)
        more = torch.tensor([0 if batch is None else 1], device=device)
        dist.all_reduce(more, op=dist.ReduceOp.MIN)
        if not int(more.item()):
            return
        yield batch


# ---------------------------------------------------------------------------- what the trainer calls under torchrun


def fully_shard_model(trainer: Trainer, model: nn.Module) -> nn.Module:
    """FSDP2: each transformer ``Block`` of the model's layer stacks is one unit of all-gather /
    reduce-scatter; the root holds the rest (embeddings, final norm, head, and layers that are reached
    other than through their forward, such as a seq2seq decoder layer's cross-attention projections).
    Weights are sharded in place: ``model`` becomes the sharded module."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    if trainer.amp_dtype == torch.float16:
        raise ConfigError("train.dtype float16 needs a gradient scaler that FSDP shards do not share; "
                          "with train.parallel=fsdp use bfloat16 (or float32), or use parallel=ddp")
    mesh = init_device_mesh(trainer.device.type, (trainer.world_size,))
    policy = MixedPrecisionPolicy()
    if trainer.amp_dtype == torch.bfloat16 and trainer.device.type == "cuda":
        # gather and compute in bf16, average gradients in fp32; the fp32 shards stay the master weights
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    from tinyformer.components.block import Block

    layers = [layer for stack in model.children() if isinstance(stack, nn.ModuleList) for layer in stack
              if isinstance(layer, Block)]
    for block in layers:
        if trainer.cfg.compile:
            block.compile()  # per block, in place: state-dict names are unchanged
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for name in FORWARD_METHODS:
        if hasattr(model, name):
            register_fsdp_forward_method(model, name)
    return model


def gather_rank_rng(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every rank's random streams (dropout and the data sampler), gathered on rank 0 (a collective)."""
    import torch.distributed as dist

    states = {"torch": torch.get_rng_state(), "data": trainer.data_generator.get_state()}
    if trainer.device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(trainer.device)
    gathered: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(gathered, states)
    return {f"rng.rank.{rank}.{key}": value.cpu() for rank, states in enumerate(gathered)
            for key, value in states.items()}


def restore_rank_rng(trainer: Trainer, ckpt_dir: Path) -> None:
    """This rank's own streams when the checkpoint has them for this world size; else derived ones."""
    from safetensors import safe_open

    from tinyformer.training.checkpoint import OPTIM_FILE, read_meta

    saved_world = int(read_meta(ckpt_dir)["trainer"].get("world_size", 1))
    prefix = f"rng.rank.{trainer.rank}."
    with safe_open(str(ckpt_dir / OPTIM_FILE), framework="pt") as f:
        own = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    if saved_world == trainer.world_size and "torch" in own:
        torch.set_rng_state(own["torch"])
        trainer.data_generator.set_state(own["data"])
        if "cuda" in own and trainer.device.type == "cuda":
            torch.cuda.set_rng_state(own["cuda"], trainer.device)
        return
    # Another world size: the data sampler restored from rank 0 is what every rank holds (all
    # start from one seed and draw in lockstep); dropout gets a fresh stream per (rank, step).
    torch.manual_seed(trainer.cfg.seed + trainer.rank + 1_000_003 * trainer.step)


# ---------------------------------------------------------------------------- consolidated state


def _state_options(**kwargs: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def _tied_head(model: nn.Module) -> bool:
    cfg = getattr(model, "cfg", None)
    return bool(getattr(cfg, "tie_embeddings", False)) and hasattr(model, "lm_head") and hasattr(model, "tok_emb")


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights on rank 0's CPU (empty on other ranks); a tied head is stored once, as in
    the run folder. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_state_options(cpu_offload=True))
    if _tied_head(model):
        state.pop("lm_head.weight", None)
    return {k: v.detach().contiguous() for k, v in state.items()}


def load_full_model_state(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Put full (unsharded) ``tensors`` into ``model``, sharding them as the model is; every rank passes them."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    tensors = dict(tensors)
    if _tied_head(model) and "lm_head.weight" not in tensors and "tok_emb.weight" in tensors:
        tensors["lm_head.weight"] = tensors["tok_emb.weight"]
    set_model_state_dict(model, tensors, options=_state_options())


def _param_names(trainer: Trainer) -> list[str]:
    """Names of the optimizer's tensors in its own order (the order ``optimizer.state_dict()`` numbers)."""
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return [names[id(p)] for group in trainer.optimizer.param_groups for p in group["params"]]


def full_optimizer_state(trainer: Trainer) -> dict[str, Any]:
    """The unsharded AdamW state in ``optimizer.state_dict()``'s layout (tensors numbered 0, 1, ... in
    parameter-group order), on rank 0's CPU. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    full = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=_state_options(cpu_offload=True))
    if not full:
        return {"state": {}, "param_groups": []}
    index = {name: i for i, name in enumerate(_param_names(trainer))}
    groups = [{**group, "params": [index[name] for name in group["params"]]} for group in full["param_groups"]]
    return {"state": {index[name]: values for name, values in full["state"].items()}, "param_groups": groups}


def load_full_optimizer_state(trainer: Trainer, state: dict[str, Any]) -> None:
    """Inverse of :func:`full_optimizer_state`: numbered full state -> each rank's shard of it."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    names = _param_names(trainer)
    by_name = {"state": {names[int(i)]: values for i, values in state["state"].items()},
               "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(trainer.model, trainer.optimizer, by_name, options=_state_options())


# ---------------------------------------------------------------------------- runs and launching


def _run_command(args: Any) -> int:
    """What a launched process runs by default: the parsed command, as torchrun would run it."""
    return int(args.func(args) or 0)


def _entry(target: Callable[[Any], Any], args: Any) -> None:
    """Body of every launched process: a user error is one line on stderr (exit 2), a crash its traceback
    (exit 1); the launcher then reports which rank failed and stops the others."""
    try:
        code = int(target(args) or 0)
    except TinyformerError as exc:
        print(f"tinyformer {getattr(args, 'command', None) or 'train'}: error: {exc}", file=sys.stderr)
        code = 2
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stderr.flush()
    if code:
        raise SystemExit(code)


def launch(nproc: int, args: Any, target: Callable[[Any], Any] = _run_command) -> int:
    """Run ``target(args)`` in ``nproc`` local processes under torch's elastic launcher (what ``torchrun
    --standalone --nproc_per_node nproc`` does); returns 0, or the exit code of the first rank that failed.

    The launcher stops every other rank as soon as one fails, so a failure ends the job instead of
    leaving the others waiting in a collective.
    """
    import logging
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun does: N processes should not each take every core
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1, start_method="spawn")
    # the failing rank prints its own error (_entry); the launcher's logs would repeat it as a traceback
    quiet = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    t0 = time.perf_counter()
    try:
        elastic_launch(config, entrypoint=_entry)(target, args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        print(f"rank {rank} of {nproc} failed (exit code {failure.exitcode}) after {time.perf_counter() - t0:.1f} s; "
              "the other ranks were stopped", file=sys.stderr)
        return code
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return 0
