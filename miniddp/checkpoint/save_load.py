"""Checkpoints that let a job resume exactly where it stopped, whatever its parallelism.

When torchrun restarts a job, every process starts from nothing: whatever should survive must be
in the checkpoint. Resuming *exactly* (the same bits as a run that never stopped) needs all of

    model        the inner module's state dict (not the wrapper's: its keys start with "module.");
                 under fully_shard or tensor parallelism, the full state, gathered from
                 every rank's shards; for a pipeline, every stage's
    optimizer    momentum and Adam's moments; without them the next steps take other sizes
    progress     step, epoch, and how many batches of that epoch were consumed, so the sampler
                 resumes mid-epoch instead of replaying or skipping data
    RNG states   every rank's: dropout and random augmentation draw from them, each rank its own
    buckets      MiniDDP's bucket layout: with 3 or more ranks gloo's sums depend on where each
                 gradient sits in its bucket, and a fresh wrapper would start again from its
                 first-step layout (chapter 03e)

Under data parallelism model and optimizer are the same on every rank after each step (that is
what DDP guarantees), so rank 0 writes them, with its own RNG state. RNG states differ per rank:
every other rank that calls `save_checkpoint` writes its own beside the file
(`<path>.rng/rank<r>.pt`), marked with the save it belongs to. So both ways of saving work:

    save_checkpoint(path, ...)                    on every rank: the complete checkpoint
    if rank == 0: save_checkpoint(path, ...)      torch's idiom, then dist.barrier(): model,
                                                  optimizer, progress and rank 0's RNG state

Rank 0 never waits for the others (it cannot tell a rank that is on its way to
`save_checkpoint` from one sitting in a `dist.barrier()`), and the others wait for rank 0's word
through the store (meet.py): when it is written, or why it could not be. On resume, rank r
restores entry r of the RNG states, whichever process or host is rank r now (torchrun does not
promise a worker keeps its rank across restarts); a checkpoint saved by rank 0 alone says once,
on rank 0, what the missing states mean. Which states are missing is decided by what was saved,
not by timing: a load on every rank (a MiniDDP wrapper, a sharded model) reads the RNG files
after every rank has come to it, when every save of theirs has returned.

Other parallelisms leave each rank a different part of the model under the same names, so rank
0's state is not everyone's (saved as it is, every rank would resume on rank 0's part, silently:
the shapes match). The marks of miniddp/placement.py say what each rank holds (full_tensors.py):

    fully_shard         the file holds the full state, gathered from every rank's flat pieces
    tensor parallel     the full tensors, cat(all_gather(shards), dim), and the optimizer's
                        states shaped like a shard (Adam's moments) gathered the same way: the
                        unsplit model's state dict, which loads into one process, or at any TP
                        size, each rank cutting its chunk(full, W, dim)[r] back out
    pipeline stage      every stage's model, optimizer and bucket layout in one file, keyed by
                        stage index ("stages": p); stage s loads entry s
    DP x TP x PP        all of these at once: each rank gets its own state back, bit for bit

Saving such a model is a collective, so every rank must call `save_checkpoint`: under
`if rank == 0:` rank 0 names the ranks that did not come and the fix, as soon as it sees them
elsewhere (waiting on a collective, at another meeting point), instead of writing a partial
file; a rank sitting in a collective MiniDDP does not watch (a bare `dist.barrier()`) is waited
for until the process group's timeout, as a barrier would. A ZeroRedundancyOptimizer must be
consolidated first (its `consolidate_state_dict(to=0)` on every rank), or every rank raises a
`CheckpointError` that says so. Writing is atomic and reading runs no code (checkpoint_file.py).
`load_checkpoint` with a MiniDDP wrapper, or a fully sharded model, needs every rank (the bucket
layout must change on every rank at once); it checks through the store that every rank came. A
tensor-parallel or pipelined model loads on each rank alone. A load checks the whole checkpoint
against the model and optimizer before it changes anything.

Every rank reads the file itself, so all ranks must see the same path: one node, or a shared
filesystem across nodes.
"""

from __future__ import annotations

import os
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp.checkpoint.file import (
    FORMAT,
    RNG_FORMAT,
    VERSION,
    CheckpointError,
    Progress,
    mismatch_with,
    read_checkpoint,
    rng_path,
    rng_states,
    write_atomically,
)
from miniddp.checkpoint.full_tensors import (
    Spread,
    cut_optimizer_shards,
    cut_shards,
    gather_optimizer_shards,
    gather_shards,
    gather_stages,
    optimizer_shards,
    spread_of,
    unsplit_shapes,
)
from miniddp.data_parallel.ddp import MiniDDP
from miniddp.job.faults import CollectiveFailed, ranks
from miniddp.job.meet import hear_from, meet, tell_the_others
from miniddp.job.notes import board_of
from miniddp.sharding.full_state import (
    full_optimizer_state_dict,
    full_shapes,
    full_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
)
from miniddp.sharding.units import is_fully_sharded
from miniddp.sharding.zero import ZeroRedundancyOptimizer

SPREAD_SAVES = (
    "This model's state is spread over the ranks (fully sharded, tensor-parallel shards, or a "
    "pipeline's stages): call save_checkpoint on every rank, not under `if rank == 0:` (it "
    "gathers the full state, and rank 0 writes it)."
)
STAGE_PARTS = ("model", "optimizer", "buckets")  # what a pipeline's checkpoint keys by stage
EVERY_RANK_LOADS = (
    "Call load_checkpoint with a MiniDDP wrapper on every rank, as with a fully sharded model: it "
    "sets the bucket layout, or cuts each rank's shards, the same way on every rank. (Or load into "
    "the bare module before wrapping it, on one rank if you like: MiniDDP copies rank 0's "
    "weights to the others when it is built.)"
)
RANK_0_WRITES = (
    "Rank 0 writes the checkpoint, and the other ranks wait for its word that the file is "
    "complete: call save_checkpoint on every rank, or on rank 0 alone."
)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What `load_checkpoint` restored, and what the caller still has to act on."""

    path: Path
    progress: Progress
    saved_world_size: int
    rng_restored: bool  # this rank's RNG state came back
    extra: dict[str, Any]
    ranks_without_rng: tuple[int, ...] = ()  # saved by rank 0 alone: ranks 1.. kept their own


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    progress: Progress,
    extra: dict[str, Any] | None = None,
) -> None:
    """Save everything needed to resume exactly: on every rank for a complete checkpoint, or on
    rank 0 alone (torch's idiom) for all but the other ranks' RNG states. A model whose ranks
    hold different parts of it (fully_shard, tensor parallelism, a pipeline stage) needs every
    rank: they gather it whole.

    Rank 0 returns once the file is complete on disk; another rank, once its RNG state is and
    rank 0 has said that the file is. If rank 0 could not write it, every rank that called
    raises `CheckpointError`. `extra` takes tensors and plain Python values (what `weights_only`
    loading accepts), e.g. the settings the run was started with.
    """
    path = Path(path)
    inner = _unwrap(model)
    sharded, spread = is_fully_sharded(inner), spread_of(inner)
    state, stages = None, None
    if sharded or spread.any:
        _every_rank_comes("save_checkpoint()", SPREAD_SAVES)
        state = _unsplit_state(model, inner, optimizer, sharded, spread)
        if spread.pipeline is not None:
            stages = gather_stages(state, spread.pipeline)
    world_size, save_id = _world_size(), _save_id(progress)
    if _rank() != 0:
        beside = rng_path(path, _rank())
        try:
            write_atomically(_rng_entry(save_id), beside)
        except OSError as error:
            raise CheckpointError(
                f"Rank {_rank()} could not write its RNG state {beside}: "
                f"{type(error).__name__}: {error}"
            ) from None
        problem = hear_from_rank_0(_word_on(path, save_id), RANK_0_WRITES)
        if problem:
            raise CheckpointError(f"Rank 0 could not write the checkpoint {path}: {problem}")
        return
    problem = ""
    try:
        if state is None:  # replicated: rank 0's state is every rank's
            state = {
                "model": inner.state_dict(),
                "optimizer": _optimizer_state(optimizer),
                "buckets": _bucket_layout(model),
            }
        if stages is not None:  # each part keyed by stage
            state = {part: dict(enumerate(entry[part] for entry in stages)) for part in state}
        checkpoint = {
            "format": FORMAT,
            "version": VERSION,
            **state,
            "stages": None if stages is None else len(stages),
            "progress": {
                "step": progress.step,
                "epoch": progress.epoch,
                "batches_done": progress.batches_done,
            },
            "world_size": world_size,
            "rng": [capture_rng_state()] + [None] * (world_size - 1),
            "save_id": save_id,
            "extra": dict(extra or {}),
        }
        write_atomically(checkpoint, path)
    except Exception as error:
        problem = f"{type(error).__name__}: {error}"
    if dist.is_initialized():
        tell_the_others(_word_on(path, save_id), problem)
    if problem:
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
    back too; then every rank must call it, as for a fully sharded model. `map_location`
    defaults to the device of the model's parameters, so each rank's tensors land on its own GPU
    rather than on the one that saved them. Each rank reads the file on its own, so this also
    works in a single process. A checkpoint that does not fit the model or optimizer changes
    nothing: all is checked first. Each rank keeps its own part: its chunk of every
    tensor-parallel shard, its own pipeline stage.

    If the world size changed, an exact resume is impossible: the sampler now splits every epoch
    differently and there is no saved RNG state for new ranks. With `allow_world_size_change`,
    model, optimizer and progress are restored and the RNG is left alone (`rng_restored` is
    False): seed each rank from (seed, rank, step) so the new run is at least reproducible, and
    restart the interrupted epoch or skip the samples (not batches) already seen. A fully
    sharded or tensor-parallel model's full state loads at any world size and TP size (into one
    process too); a pipeline's, into a pipeline of as many stages.
    """
    path = Path(path)
    inner = _unwrap(model)
    if map_location is None:
        map_location = next(inner.parameters()).device
    checkpoint = read_checkpoint(path, map_location=map_location)
    world_size = _world_size()
    saved_world_size = checkpoint["world_size"]
    if saved_world_size != world_size and not allow_world_size_change:
        raise CheckpointError(
            f"{path} was saved by {saved_world_size} ranks and this job has {world_size}: the "
            "data would be split differently and RNG states are missing, so it cannot resume "
            "exactly. Relaunch with the old world size, or pass allow_world_size_change=True."
        )
    sharded, spread = is_fully_sharded(inner), spread_of(inner)
    part = _this_ranks_part(checkpoint, spread, path)
    # The shapes this rank holds (fully_shard: before its flat pieces), then the unsplit ones.
    local = full_shapes(inner) if sharded else {k: v.shape for k, v in inner.state_dict().items()}
    shapes = unsplit_shapes(local, spread.shards)
    mismatch = mismatch_with(part, inner, optimizer, shapes)
    if mismatch is not None:
        raise CheckpointError(
            f"{path} does not fit this model or optimizer: {mismatch}. Nothing was loaded."
        )
    if isinstance(model, MiniDDP) or sharded:
        _every_rank_comes("load_checkpoint()", EVERY_RANK_LOADS)
        # Every rank is here, so every save it made has returned, its RNG file written: read
        # them now. Read before the meeting, a slow rank's file could still be on its way, and
        # rank 0 would call a complete checkpoint "saved by rank 0 alone".
        checkpoint["rng"] = rng_states(path, checkpoint, map_location)
    try:
        if isinstance(model, MiniDDP) and part["buckets"] is not None:
            model.load_bucket_state(part["buckets"])  # checks the names before it changes
        model_state = cut_shards(part["model"], spread.shards)
        if optimizer is not None:
            numbers = optimizer_shards(inner, optimizer, spread.shards)
            optimizer_state = cut_optimizer_shards(
                part["optimizer"], numbers, spread.shards, shapes
            )
        if sharded:
            load_full_state_dict(inner, model_state)
            if optimizer is not None:
                load_full_optimizer_state_dict(inner, optimizer, optimizer_state)
        else:
            inner.load_state_dict(model_state)
            if optimizer is not None:
                optimizer.load_state_dict(optimizer_state)
    except (RuntimeError, ValueError, KeyError) as error:  # what mismatch_with cannot foresee
        raise CheckpointError(f"{path} does not fit this model or optimizer: {error}") from None
    rng = checkpoint["rng"]
    without = tuple(rank for rank, state in enumerate(rng) if state is None)
    rng_restored = saved_world_size == world_size and rng[_rank()] is not None
    if rng_restored:
        restore_rng_state(rng[_rank()])
    if without and saved_world_size == world_size and _rank() == 0:
        warnings.warn(
            f"{path} was saved by rank 0 alone, so it holds no RNG state for {ranks(list(without))}"
            ", which go on from their current random state: model, optimizer and progress resume"
            " exactly, but random draws there (dropout, augmentation) will differ from an"
            " uninterrupted run's unless every rank calls save_checkpoint.",
            stacklevel=2,
        )
    return LoadedCheckpoint(
        path=path,
        progress=Progress(**checkpoint["progress"]),
        saved_world_size=saved_world_size,
        rng_restored=rng_restored,
        extra=checkpoint["extra"],
        ranks_without_rng=without,
    )


def _unsplit_state(
    model: nn.Module,
    inner: nn.Module,
    optimizer: torch.optim.Optimizer,
    sharded: bool,
    spread: Spread,
) -> dict[str, Any]:
    """This rank's model and optimizer state as the unsplit model holds them (a collective):
    fully_shard's flat pieces gathered first (into this rank's tensors), then the
    tensor-parallel shards (into the full tensors). A pipeline stage's is its own stage's."""
    if sharded:
        model_state = full_state_dict(inner)
        optimizer_state = full_optimizer_state_dict(inner, optimizer)
    else:
        model_state, optimizer_state = inner.state_dict(), _optimizer_state(optimizer)
    if spread.shards:
        local = {key: model_state[key].shape for key in spread.shards}
        numbers = optimizer_shards(inner, optimizer, spread.shards)
        optimizer_state = gather_optimizer_shards(optimizer_state, numbers, spread.shards, local)
        model_state = gather_shards(model_state, spread.shards)
    return {"model": model_state, "optimizer": optimizer_state, "buckets": _bucket_layout(model)}


def _this_ranks_part(checkpoint: dict[str, Any], spread: Spread, path: Path) -> dict[str, Any]:
    """The checkpoint as one model's: for a pipeline stage, the entries of its own stage."""
    stages, pipeline = checkpoint.get("stages"), spread.pipeline  # files before PP: no "stages"
    if stages is None and pipeline is None:
        return checkpoint
    if pipeline is None:
        raise CheckpointError(
            f"{path} holds the {stages} stages of a pipeline, keyed by stage, and this model is "
            "not a pipeline stage (no PipelineStage marked its parameters): load it on every "
            f"rank of a {stages}-stage pipeline, into each stage's submodule once its "
            "PipelineStage is built. Nothing was loaded."
        )
    if stages is None:
        raise CheckpointError(
            f"{path} holds one whole model, not a pipeline's stages, and this model is stage "
            f"{pipeline.index} of {pipeline.count}: load it into the whole model before cutting "
            "it into stages. Nothing was loaded."
        )
    if stages != pipeline.count:
        raise CheckpointError(
            f"{path} holds a pipeline of {stages} stages and this pipeline has "
            f"{pipeline.count}: each stage holds other layers. Resume with {stages} stages. "
            "Nothing was loaded."
        )
    return {**checkpoint, **{part: checkpoint[part][pipeline.index] for part in STAGE_PARTS}}


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


def hear_from_rank_0(word: str, advice: str) -> str:
    """Rank 0's word on `word` ("" for written), or a CheckpointError if it never comes."""
    try:
        return hear_from(0, word, advice)
    except CollectiveFailed as failure:
        raise CheckpointError(str(failure)) from None


def _optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict; a ZeroRedundancyOptimizer's only once consolidated."""
    if isinstance(optimizer, ZeroRedundancyOptimizer) and optimizer._all_state_dicts is None:
        raise CheckpointError(
            "the ZeroRedundancyOptimizer's state is spread over the ranks and was not "
            "consolidated on rank 0: call optimizer.consolidate_state_dict(to=0) on every rank "
            "before save_checkpoint"
        )
    return optimizer.state_dict()


def _save_id(progress: Progress) -> str:
    """What marks one save, the same on every rank that calls it: the progress, and how many
    collectives this rank finished (equal on every rank between two steps)."""
    finished = board_of(None).finished if dist.is_initialized() else 0
    return f"{progress.step}/{progress.epoch}/{progress.batches_done}/{finished}"


def _word_on(path: Path, save_id: str) -> str:
    return f"save_checkpoint({str(path)!r}) (save {save_id})"


def _rng_entry(save_id: str) -> dict[str, Any]:
    return {"format": RNG_FORMAT, "save_id": save_id, "rank": _rank(), "rng": capture_rng_state()}


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


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
