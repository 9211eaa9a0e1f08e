"""Checkpoints that let a data-parallel job resume exactly where it stopped.

When torchrun restarts a job, every process starts from nothing: whatever should survive must be
in the checkpoint. Resuming *exactly* (the same bits as a run that never stopped) needs all of

    model        the inner module's state dict (not the wrapper's: its keys start with "module.")
    optimizer    momentum and Adam's moments; without them the next steps take other sizes
    progress     step, epoch, and how many batches of that epoch were consumed, so the sampler
                 resumes mid-epoch instead of replaying or skipping data
    RNG states   every rank's: dropout and random augmentation draw from them, each rank its own
    buckets      MiniDDP's bucket layout: with 3 or more ranks gloo's sums depend on where each
                 gradient sits in its bucket, and a fresh wrapper would start again from its
                 first-step layout (chapter 03e)

Model and optimizer are the same on every rank after each step (that is what DDP guarantees),
so one copy is enough. RNG states differ per rank, so they are gathered to rank 0 and saved as a
list indexed by rank; on resume, rank r restores entry r, whichever process or host is rank r
now (torchrun does not promise a worker keeps its rank across restarts).

Rank 0 alone writes the file, atomically, and every rank reads it back without running code
from it (checkpoint_file.py). So every rank must call `save_checkpoint` (it gathers the RNG
states), and `load_checkpoint` with a MiniDDP wrapper (the bucket layout must change on every
rank at once, or the ranks' all-reduces stop matching). Both check, through the store, that
every rank came (meet.py): `if rank == 0: save_checkpoint(...)`, the usual idiom with torch's
DDP, is a `CheckpointError` within a second instead of a hang until the timeout. And a load
checks the whole checkpoint against the model and optimizer before it changes anything.

Every rank reads the file itself, so all ranks must see the same path: one node, or a shared
filesystem across nodes.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp.checkpoint_file import (
    FORMAT,
    VERSION,
    CheckpointError,
    Progress,
    mismatch_with,
    read_checkpoint,
    write_atomically,
)
from miniddp.ddp import MiniDDP
from miniddp.faults import CollectiveFailed, wait_for
from miniddp.meet import meet

__all__ = [
    "FORMAT",
    "CheckpointError",
    "LoadedCheckpoint",
    "Progress",
    "capture_rng_state",
    "load_checkpoint",
    "read_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
]

EVERY_RANK_SAVES = (
    "Call save_checkpoint on every rank, not under `if rank == 0:`: it gathers every rank's RNG "
    "state, and rank 0 alone writes the file."
)
EVERY_RANK_LOADS = (
    "Call load_checkpoint with a MiniDDP wrapper on every rank: it sets the bucket layout, which "
    "must be the same on every rank. (Or load into the bare module before wrapping it, on one "
    "rank if you like: MiniDDP copies rank 0's weights to the others when it is built.)"
)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What `load_checkpoint` restored, and what the caller still has to act on."""

    path: Path
    progress: Progress
    saved_world_size: int
    rng_restored: bool
    extra: dict[str, Any]


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    progress: Progress,
    extra: dict[str, Any] | None = None,
) -> None:
    """Save everything needed to resume exactly. Every rank must call it (it gathers RNG
    states); a rank that calls it alone gets a `CheckpointError` within a second.

    Returns on every rank once the file is complete on disk; if rank 0 could not write it,
    every rank raises `CheckpointError`. `extra` takes tensors and plain Python values (what
    `weights_only` loading accepts), e.g. the settings the run was started with.
    """
    path = Path(path)
    _every_rank_comes("save_checkpoint()", EVERY_RANK_SAVES)
    rng_states = _gather(capture_rng_state())
    problem = None
    if _rank() == 0:
        checkpoint = {
            "format": FORMAT,
            "version": VERSION,
            "model": _unwrap(model).state_dict(),
            "buckets": _bucket_layout(model),
            "optimizer": optimizer.state_dict(),
            "progress": {
                "step": progress.step,
                "epoch": progress.epoch,
                "batches_done": progress.batches_done,
            },
            "world_size": len(rng_states),
            "rng": rng_states,
            "extra": dict(extra or {}),
        }
        try:
            write_atomically(checkpoint, path)
        except Exception as error:
            problem = f"{type(error).__name__}: {error}"
    problem = _outcome_from_rank0(problem, path)
    if problem is not None:
        raise CheckpointError(f"Rank 0 could not write the checkpoint {path}: {problem}")


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    map_location: torch.device | str | None = None,
    allow_world_size_change: bool = False,
) -> LoadedCheckpoint:
    """Restore model, optimizer and this rank's RNG states from `path`; return the progress.

    Pass the MiniDDP wrapper as `model` (not the module inside) so that its bucket layout comes
    back too; then every rank must call it. `map_location` defaults to the device of the
    model's parameters, so each rank's tensors land on its own GPU rather than on the one that
    saved them. Each rank reads the file on its own, so this also works in a single process.
    A checkpoint that does not fit the model or optimizer changes nothing: all is checked first.

    If the world size changed, an exact resume is impossible: the sampler now splits every epoch
    differently and there is no saved RNG state for new ranks. With `allow_world_size_change`,
    model, optimizer and progress are restored and the RNG is left alone (`rng_restored` is
    False): seed each rank from (seed, rank, step) so the new run is at least reproducible, and
    restart the interrupted epoch or skip the samples (not batches) already seen.
    """
    path = Path(path)
    if map_location is None:
        map_location = next(_unwrap(model).parameters()).device
    checkpoint = read_checkpoint(path, map_location=map_location)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    saved_world_size = checkpoint["world_size"]
    if saved_world_size != world_size and not allow_world_size_change:
        raise CheckpointError(
            f"{path} was saved by {saved_world_size} ranks and this job has {world_size}: the "
            "data would be split differently and RNG states are missing, so it cannot resume "
            "exactly. Relaunch with the old world size, or pass allow_world_size_change=True."
        )
    mismatch = mismatch_with(checkpoint, _unwrap(model), optimizer)
    if mismatch is not None:
        raise CheckpointError(
            f"{path} does not fit this model or optimizer: {mismatch}. Nothing was loaded."
        )
    if isinstance(model, MiniDDP):
        _every_rank_comes("load_checkpoint()", EVERY_RANK_LOADS)
    try:
        if isinstance(model, MiniDDP) and checkpoint["buckets"] is not None:
            model.load_bucket_state(checkpoint["buckets"])  # checks the names before it changes
        _unwrap(model).load_state_dict(checkpoint["model"])
        if optimizer is not None:
            optimizer.load_state_dict(checkpoint["optimizer"])
    except (RuntimeError, ValueError, KeyError) as error:  # what mismatch_with cannot foresee
        raise CheckpointError(f"{path} does not fit this model or optimizer: {error}") from None
    rng_restored = saved_world_size == world_size
    if rng_restored:
        restore_rng_state(checkpoint["rng"][_rank()])
    return LoadedCheckpoint(
        path=path,
        progress=Progress(**checkpoint["progress"]),
        saved_world_size=saved_world_size,
        rng_restored=rng_restored,
        extra=checkpoint["extra"],
    )


def capture_rng_state() -> dict[str, Any]:
    """This process's random number generators: torch's CPU generator, the current GPU's,
    Python's `random`, and numpy's global one. Generators you created
    yourself (`torch.Generator()`) are not global: checkpoint those separately."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    kind, keys, position, has_gauss, gauss = numpy.random.get_state()
    # As a list of ints: weights_only loading refuses numpy arrays.
    state["numpy"] = (kind, keys.tolist(), position, has_gauss, gauss)
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what `capture_rng_state` returned."""
    torch.set_rng_state(state["torch"].cpu())  # map_location may have moved it to a GPU
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu(), torch.cuda.current_device())
    if "numpy" in state:  # checkpoints written before numpy was a dependency may lack it
        kind, keys, position, has_gauss, gauss = state["numpy"]
        numpy.random.set_state(
            (kind, numpy.array(keys, dtype=numpy.uint32), position, has_gauss, gauss)
        )


def _every_rank_comes(point: str, advice: str) -> None:
    """Wait until every rank reaches `point`: a CheckpointError at once if one never will."""
    if not dist.is_initialized():
        return
    try:
        meet(point, advice)
    except CollectiveFailed as failure:
        raise CheckpointError(str(failure)) from None


def _gather(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's `state`, indexed by rank (just ours without a process group)."""
    if not dist.is_initialized():
        return [state]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, state)
    return everyone


def _outcome_from_rank0(problem: str | None, path: Path) -> str | None:
    """Rank 0's `problem` writing `path`, on every rank: a failure seen only on rank 0 would
    leave the others training on as if the checkpoint existed. The others wait here for as
    long as rank 0 writes, so the wait goes through wait_for: if rank 0 dies meanwhile, they
    get a CollectiveFailed naming it, not gloo's "Connection closed by peer"."""
    if not dist.is_initialized():
        return problem
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    failed = torch.tensor([problem is not None], dtype=torch.uint8, device=device)
    wait_for(
        dist.broadcast(failed, src=0, async_op=True),
        f"broadcast of whether rank 0 wrote the checkpoint {path}",
    )
    if not failed.item():
        return None
    holder = [problem]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _bucket_layout(model: nn.Module) -> dict[str, Any] | None:
    """MiniDDP's bucket layout; None for other models: torch's DDP keeps its layout inside the
    C++ reducer, out of reach."""
    return model.bucket_state() if isinstance(model, MiniDDP) else None


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper, so the checkpoint loads with or without one."""
    while isinstance(model, (MiniDDP, DistributedDataParallel)):
        model = model.module
    return model
