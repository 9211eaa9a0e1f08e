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
                 first-step layout (chapter 03)

Model and optimizer are the same on every rank after each step (that is what DDP guarantees),
so one copy is enough. RNG states differ per rank, so they are gathered to rank 0 and saved as a
list indexed by rank; on resume, rank r restores entry r, whichever process or host is rank r
now (torchrun does not promise a worker keeps its rank across restarts).

Rank 0 alone writes, atomically: into a temporary file, flushed and fsynced, then renamed over the
old checkpoint. A crash at any moment leaves either the old checkpoint or the new one, never half
of one. Loading uses `torch.load(weights_only=True)`, which rebuilds tensors and plain Python
values but runs no code from the file, so a checkpoint from elsewhere cannot execute anything.

Every rank reads the file itself, so all ranks must see the same path: one node, or a shared
filesystem across nodes.
"""

from __future__ import annotations

import os
import pickle
import random
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp.ddp import MiniDDP

FORMAT = "miniddp-checkpoint"
VERSION = 1
REQUIRED_KEYS = {"model", "optimizer", "buckets", "progress", "world_size", "rng", "extra"}


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file."""


@dataclass(frozen=True)
class Progress:
    """Where training stands: `step` optimizer steps done, `batches_done` batches of `epoch`
    consumed. Resume by calling `sampler.set_epoch(epoch)` and skipping `batches_done` batches."""

    step: int
    epoch: int
    batches_done: int


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
    """Save everything needed to resume exactly. Every rank must call it (it gathers RNG states).

    Returns on every rank once the file is complete on disk; if rank 0 could not write it,
    every rank raises `CheckpointError`. `extra` takes tensors and plain Python values (what
    `weights_only` loading accepts), e.g. the settings the run was started with.
    """
    path = Path(path)
    rng_states = _gather(capture_rng_state())
    rank = dist.get_rank() if dist.is_initialized() else 0
    problem = None
    if rank == 0:
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
            _write_atomically(checkpoint, path)
        except Exception as error:
            problem = f"{type(error).__name__}: {error}"
    # Tell every rank how the write went: a failure seen only on rank 0 would otherwise leave the
    # others training on as if the checkpoint existed.
    problem = _from_rank0(problem)
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
    back too. `map_location` defaults to the device of the model's parameters, so each rank's
    tensors land on its own GPU rather than on the one that saved them. Each rank reads the file
    on its own (no collective), so this also works in a single process.

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
    rank = dist.get_rank() if dist.is_initialized() else 0
    saved_world_size = checkpoint["world_size"]
    if saved_world_size != world_size and not allow_world_size_change:
        raise CheckpointError(
            f"{path} was saved by {saved_world_size} ranks and this job has {world_size}: the "
            "data would be split differently and RNG states are missing, so it cannot resume "
            "exactly. Relaunch with the old world size, or pass allow_world_size_change=True."
        )
    try:
        _unwrap(model).load_state_dict(checkpoint["model"])
        if optimizer is not None:
            optimizer.load_state_dict(checkpoint["optimizer"])
        if isinstance(model, MiniDDP) and checkpoint["buckets"] is not None:
            model.load_bucket_state(checkpoint["buckets"])
    except (RuntimeError, ValueError, KeyError) as error:
        raise CheckpointError(
            f"{path} does not fit this model or optimizer: {_first_line(error)}"
        ) from None
    rng_restored = saved_world_size == world_size
    if rng_restored:
        restore_rng_state(checkpoint["rng"][rank])
    return LoadedCheckpoint(
        path=path,
        progress=Progress(**checkpoint["progress"]),
        saved_world_size=saved_world_size,
        rng_restored=rng_restored,
        extra=checkpoint["extra"],
    )


def read_checkpoint(
    path: str | os.PathLike, map_location: torch.device | str = "cpu"
) -> dict[str, Any]:
    """Read and check a checkpoint file without restoring anything (for inspecting it, or for
    restoring only parts of it). Any problem is a `CheckpointError` naming the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"No checkpoint file at {path}.")
    _check_archive(path)
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        if "weights only" not in str(error).lower():
            raise CheckpointError(f"{path} is corrupt: {_first_line(error)}") from None
        refused = next((line for line in str(error).splitlines() if "Unsupported" in line), "")
        raise CheckpointError(
            f"{path} holds Python objects other than tensors and plain values, which "
            "weights_only loading refuses to rebuild (running their code could do anything): "
            f"{refused.strip()} It is not a MiniDDP checkpoint; load it with weights_only=False "
            "only if you trust where it came from."
        ) from None
    except Exception as error:
        raise CheckpointError(f"{path} is corrupt: {_first_line(error)}") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        found = (
            f"a dict with keys {sorted(map(str, checkpoint))[:6]}"
            if isinstance(checkpoint, dict)
            else type(checkpoint).__name__
        )
        raise CheckpointError(
            f"{path} is a torch file but not a MiniDDP checkpoint: it holds {found}."
        )
    if checkpoint.get("version") != VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {checkpoint.get('version')}; this MiniDDP "
            f"reads version {VERSION}."
        )
    missing = sorted(REQUIRED_KEYS - set(checkpoint))
    if missing:
        raise CheckpointError(f"{path} is incomplete: it has no {', '.join(missing)}.")
    return checkpoint


def capture_rng_state() -> dict[str, Any]:
    """This process's random number generators: torch's CPU generator, the current GPU's,
    Python's `random`, and numpy's global one if numpy is loaded. Generators you created
    yourself (`torch.Generator()`) are not global: checkpoint those separately."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    numpy = sys.modules.get("numpy")
    if numpy is not None:
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
    numpy = sys.modules.get("numpy")
    if "numpy" in state and numpy is not None:
        kind, keys, position, has_gauss, gauss = state["numpy"]
        numpy.random.set_state(
            (kind, numpy.array(keys, dtype=numpy.uint32), position, has_gauss, gauss)
        )


def _check_archive(path: Path) -> None:
    """torch.save writes a zip archive with a CRC32 per record (unless someone called
    torch.serialization.set_crc32_options(False)), but torch.load never checks them: a flipped
    bit inside a tensor loads silently. zipfile checks every record."""
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError) as error:
        raise CheckpointError(
            f"{path} is truncated or was not written by torch.save (no complete zip archive): "
            f"{_first_line(error)}"
        ) from None
    if damaged is not None:
        raise CheckpointError(
            f"{path} is corrupt: the record {damaged!r} does not match its checksum."
        )


def _write_atomically(obj: Any, path: Path) -> None:
    """torch.save into a temporary file beside `path`, make it durable, then rename it over
    `path`. rename is atomic within a filesystem: readers see the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for leftover in path.parent.glob(f".{path.name}.*.tmp"):
        leftover.unlink(missing_ok=True)  # from a writer that was killed mid-write
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())  # the bytes are on disk before the name points at them
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)  # and the rename itself survives a power cut


def _fsync_directory(directory: Path) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some platforms cannot open a directory; the rename is still atomic
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _gather(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's `state`, indexed by rank (just ours without a process group)."""
    if not dist.is_initialized():
        return [state]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, state)
    return everyone


def _from_rank0(value: Any) -> Any:
    if not dist.is_initialized():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _bucket_layout(model: nn.Module) -> dict[str, Any] | None:
    """MiniDDP's bucket layout; None for other models: torch's DDP keeps its layout inside the
    C++ reducer, out of reach."""
    return model.bucket_state() if isinstance(model, MiniDDP) else None


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper, so the checkpoint loads with or without one."""
    while isinstance(model, (MiniDDP, DistributedDataParallel)):
        model = model.module
    return model


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
