"""The checkpoint file: written whole or not at all, read without running anything, checked.

Writing is atomic: into a temporary file, flushed and fsynced, then renamed over the old
checkpoint. A crash at any moment leaves either the old checkpoint or the new one, never half of
one. Reading uses `torch.load(weights_only=True)`, which rebuilds tensors and plain Python values
but runs no code from the file, so a checkpoint from elsewhere cannot execute anything. Then
every part the loader will use is checked, so that a damaged or foreign file is a
`CheckpointError` naming the file, never a traceback from deep inside pickle or a dataclass.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

FORMAT = "miniddp-checkpoint"
RNG_FORMAT = "miniddp-checkpoint-rng"  # one rank's RNG state, beside the checkpoint
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


PROGRESS_KEYS = [field.name for field in fields(Progress)]


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
        raise CheckpointError(
            f"{path} holds Python objects other than tensors and plain values, which "
            "weights_only loading refuses to rebuild (running their code could do anything): "
            f"{_what_was_refused(error)}. It is not a MiniDDP checkpoint; load it with "
            "weights_only=False only if you trust where it came from."
        ) from None
    except Exception as error:
        raise CheckpointError(f"{path} is corrupt: {_first_line(error)}") from None
    _check_contents(checkpoint, path)
    checkpoint["rng"] = rng_states(path, checkpoint, map_location)
    return checkpoint


def rng_states(
    path: Path, checkpoint: dict[str, Any], map_location: torch.device | str
) -> list[dict[str, Any] | None]:
    """Every rank's RNG state for this save: rank 0's from the file, the others' from their
    files beside it (None where there is none: saved by rank 0 alone, or not yet written)."""
    return [
        state if state is not None else _rng_beside(path, rank, checkpoint, map_location)
        for rank, state in enumerate(checkpoint["rng"])
    ]


def rng_path(path: Path, rank: int) -> Path:
    """Where rank `rank` (not 0: its state is in the checkpoint) writes its RNG state."""
    return path.with_name(f"{path.name}.rng") / f"rank{rank}.pt"


def _rng_beside(
    path: Path, rank: int, checkpoint: dict[str, Any], map_location: torch.device | str
) -> dict[str, Any] | None:
    """Rank `rank`'s RNG state from its file beside the checkpoint, if it belongs to this save
    (the ranks write them before rank 0 says the checkpoint is written: one from an older save
    is a leftover, and a checkpoint saved by rank 0 alone has none)."""
    beside = rng_path(path, rank)
    if not beside.is_file() or "save_id" not in checkpoint:
        return None
    try:
        entry = torch.load(beside, map_location=map_location, weights_only=True)
    except Exception as error:
        raise CheckpointError(f"{beside} is corrupt: {_first_line(error)}") from None
    if not isinstance(entry, dict) or entry.get("format") != RNG_FORMAT:
        raise CheckpointError(f"{beside} is not a MiniDDP RNG state file.")
    return entry["rng"] if entry.get("save_id") == checkpoint["save_id"] else None


def _check_contents(checkpoint: Any, path: Path) -> None:
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
    progress = checkpoint["progress"]
    if not isinstance(progress, dict) or sorted(progress) != sorted(PROGRESS_KEYS):
        found = sorted(progress) if isinstance(progress, dict) else type(progress).__name__
        raise CheckpointError(
            f"{path} has a progress entry this MiniDDP does not read: {found}; it expects "
            f"exactly {PROGRESS_KEYS}."
        )
    if not all(type(value) is int for value in progress.values()):
        raise CheckpointError(f"{path} has a progress entry that is not whole numbers: {progress}")
    stages = checkpoint.get("stages")  # a pipeline's: model, optimizer, buckets keyed by stage
    if stages is not None and not (
        type(stages) is int
        and stages > 0
        and all(
            isinstance(checkpoint[part], dict) and sorted(checkpoint[part]) == list(range(stages))
            for part in ("model", "optimizer", "buckets")
        )
    ):
        raise CheckpointError(
            f"{path} is damaged: it says it holds a pipeline of {stages!r} stages, but its "
            "model, optimizer and bucket layout are not one entry per stage, keyed 0, 1, ..."
        )
    world_size, rng = checkpoint["world_size"], checkpoint["rng"]
    if type(world_size) is not int or not isinstance(rng, list) or len(rng) != world_size:
        raise CheckpointError(
            f"{path} is damaged: it says {world_size!r} ranks saved it but holds "
            f"{len(rng) if isinstance(rng, list) else 'no list of'} RNG states."
        )


def mismatch_with(
    checkpoint: dict[str, Any],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    full_shapes: dict[str, torch.Size] | None = None,
) -> str | None:
    """Why `checkpoint` cannot be loaded into `module` and `optimizer`, or None if it can:
    what `load_state_dict` would find out only halfway through loading. A fully sharded or
    tensor-parallel module passes the full shapes of its state (its checkpoints hold the full
    state); a pipeline stage, its own stage's entries of `checkpoint`."""
    saved, current = checkpoint["model"], module.state_dict()
    shapes = full_shapes or {key: tensor.shape for key, tensor in current.items()}
    for key, shape in shapes.items():
        theirs = saved.get(key)
        if isinstance(theirs, torch.Tensor) and theirs.shape != shape:
            return (
                f"{key!r} has shape {tuple(theirs.shape)} in the checkpoint and "
                f"{tuple(shape)} in this model"
            ) + _sharded_hint(theirs.shape, shape, checkpoint["world_size"])
    missing = [key for key in current if key not in saved]
    if missing:
        return f"this model has {_first_few(missing)}, which the checkpoint lacks"
    unexpected = [key for key in saved if key not in current]
    if unexpected:
        return f"the checkpoint has {_first_few(unexpected)}, which this model lacks"
    if optimizer is None:
        return None
    groups = checkpoint["optimizer"].get("param_groups", [])
    if len(groups) != len(optimizer.param_groups):
        return (
            f"the checkpoint's optimizer has {len(groups)} parameter groups and this one "
            f"{len(optimizer.param_groups)}"
        )
    for index, (theirs, ours) in enumerate(zip(groups, optimizer.param_groups)):
        if len(theirs["params"]) != len(ours["params"]):
            return (
                f"the optimizer's parameter group {index} holds {len(theirs['params'])} "
                f"parameters in the checkpoint and {len(ours['params'])} here"
            )
    return _another_kind_of_optimizer(groups, optimizer)


def _another_kind_of_optimizer(
    groups: list[dict[str, Any]], optimizer: torch.optim.Optimizer
) -> str | None:
    """torch's `load_state_dict` takes the checkpoint's hyperparameters and state whatever
    optimizer saved them: SGD's groups and momentum buffers loaded into AdamW replace its own,
    and AdamW fails only then ('step'), or at its first step ('betas'). Each kind has its own
    hyperparameters, so groups that both lack some of this optimizer's and hold some it lacks
    come from another kind. (One side alone differs across torch versions, as new options
    appear: an older checkpoint of the same optimizer still loads.)"""
    names = {"params", "param_names"}
    saved = set().union(*(set(group) - names for group in groups)) if groups else set()
    here = set().union(*(set(group) - names for group in optimizer.param_groups))
    extra, lacking = sorted(saved - here), sorted(here - saved)
    if not (extra and lacking):
        return None
    return (
        f"the checkpoint's optimizer was another kind than this {type(optimizer).__name__}: "
        f"its parameter groups have {_first_few(extra)}, which this one lacks, and lack "
        f"{_first_few(lacking)}, which this one has. Load it into the kind of optimizer that "
        "saved it"
    )


def _sharded_hint(saved: torch.Size, here: torch.Size, world_size: int) -> str:
    """A 1-D entry of ceil(n/W) elements where this model has n is a shard: the file holds one
    rank's `model.state_dict()` of a fully sharded model, not the full state."""
    n = torch.Size(here).numel()
    if len(saved) == 1 and world_size > 1 and saved[0] == -(-n // world_size) != n:
        return (
            f" (a shard: its {saved[0]} elements are a 1/{world_size} of {n}, cut for "
            f"W = {world_size}; save fully sharded models with save_checkpoint on every rank, "
            "which writes the full state, or convert with miniddp.sharding.full_state_dict)"
        )
    return ""


def _first_few(keys: list[str]) -> str:
    shown = ", ".join(map(repr, keys[:3]))
    return shown + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def write_atomically(obj: Any, path: Path) -> None:
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


def _what_was_refused(error: BaseException) -> str:
    """torch wraps the one useful sentence in paragraphs of advice, and words it differently
    by case: "Unsupported global: GLOBAL __main__.Payload was not an allowed global by default",
    "Trying to load unsupported GLOBAL posix.system whose module posix is blocked"."""
    for line in str(error).splitlines():
        line = line.strip().removeprefix("WeightsUnpickler error:").strip()
        if "unsupported" in line.lower():
            return line.split(". ", 1)[0].rstrip(".")
    return "torch did not say which"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
