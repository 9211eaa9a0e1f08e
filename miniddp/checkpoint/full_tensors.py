"""A tensor-parallel or pipelined model's state, whole, for one checkpoint file; and each rank's
own part cut back out of it on load.

Both parallelisms leave every rank with a state dict that looks complete (the unsplit model's
names) but holds only this rank's part. Saved from rank 0 and loaded on every rank, it puts rank
0's part everywhere, and nothing notices: the shapes match. The marks of miniddp/placement.py
say what each rank holds, so this module never reads a parallelism's internals.

Tensor parallelism, `TensorShard(group, dim)`: rank r of the W ranks of `group` holds

    shard_r = torch.chunk(full, W, dim)[r],   so   full = torch.cat([shard_0, .., shard_W-1], dim)

A checkpoint holds `full` (an all-gather over `group`, then the cat): the unsplit model's state
dict, same keys and shapes. Loading, rank r' of W' cuts chunk(full, W', dim)[r'] for itself.
Both are copies of bits, so cut(gather(shards)) is every shard back, bit for bit, and the file
loads into one process (W' = 1: the full tensor itself) or at any TP size W' that divides it.
The optimizer's states shaped like the shard (momentum, Adam's exp_avg and exp_avg_sq) are
elementwise: entry i of the full tensor's state is entry i of the gathered states. They are
gathered and cut the same way; a state of another shape (Adam's scalar step) is the same on
every rank and stays as it is.

Pipeline parallelism, `Stage(group, index, count)`: stage s runs on rank s of the pipeline's
`group` and its parameters are nowhere else. So the checkpoint holds all `count` stages' states,
keyed by stage: every rank of rank 0's pipeline sends its own (model, optimizer, bucket layout,
after the TP gather) to rank 0; the ranks of the other pipelines, data-parallel replicas of the
same stages, send nothing. Loading, rank s of a pipeline takes entry s, its own. Interleaved
pipelines (v stages a rank, count = v W) are refused, naming the fix: a rank would hold v
stages under one model's keys, and this keying has one stage a rank.

The gathers are collectives (every rank of the group, the same entries in the same order); the
cuts are not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from miniddp.checkpoint.file import CheckpointError
from miniddp.job.faults import wait_for
from miniddp.placement import TensorShard, group_ranks, placement_of


@dataclass(frozen=True)
class Pipeline:
    """This rank's place in a pipeline: it holds stage `index` of `count` over `group`."""

    group: dist.ProcessGroup | None
    index: int  # this rank's rank in `group`: the stage it holds (a tied copy is saved here too)
    count: int


@dataclass(frozen=True)
class Spread:
    """What the marks say about one module's state: the entries that are tensor-parallel shards
    (by state_dict key), and the pipeline stage it is, if any."""

    shards: dict[str, TensorShard]
    pipeline: Pipeline | None

    @property
    def any(self) -> bool:
        """The ranks hold different state: saving is a collective."""
        return bool(self.shards) or self.pipeline is not None


def spread_of(module: nn.Module) -> Spread:
    """Read the marks of `module`'s parameters (a parameter without one is replicated)."""
    shards: dict[str, TensorShard] = {}
    stages = set()
    for key, value in module.state_dict(keep_vars=True).items():
        placement = placement_of(value)
        if placement.tensor is not None:
            shards[key] = placement.tensor
        if placement.stage is not None:
            stages.add((placement.stage.group, placement.stage.count))
    if len(stages) > 1:
        raise CheckpointError(
            f"this model's parameters belong to {len(stages)} different pipelines (their Stage "
            "marks name other groups or stage counts): checkpoint each PipelineStage's "
            "submodule on its own, one stage per rank"
        )
    pipeline = None
    if stages:
        [(group, count)] = stages
        if count != dist.get_world_size(group):
            raise CheckpointError(
                f"this model is a pipeline of {count} stages on {dist.get_world_size(group)} "
                "ranks, several stages a rank (interleaved): save_checkpoint keys a "
                "pipeline's state by stage, one stage a rank. Save each stage's submodule and "
                "optimizer with torch.save on its rank, or checkpoint a one-stage-a-rank "
                "pipeline (ScheduleGPipe, Schedule1F1B)"
            )
        pipeline = Pipeline(group, dist.get_rank(group), count)
    return Spread(shards, pipeline)


def unsplit_shapes(local: dict[str, torch.Size], shards: dict[str, TensorShard]) -> dict[str, Any]:
    """The shape of every entry in the unsplit model: a shard's `dim` is W times longer."""
    shapes = dict(local)
    for key, shard in shards.items():
        shape = list(local[key])
        shape[shard.dim] *= dist.get_world_size(shard.group)
        shapes[key] = torch.Size(shape)
    return shapes


def gather_shards(
    state: dict[str, torch.Tensor], shards: dict[str, TensorShard]
) -> dict[str, torch.Tensor]:
    """`state` with every tensor-parallel shard replaced by its full tensor (a collective over
    each shard's group)."""
    full = dict(state)
    for key, shard in shards.items():
        full[key] = _gather(state[key], shard, f"{key!r}'s tensor-parallel shards")
    return full


def cut_shards(state: dict[str, Any], shards: dict[str, TensorShard]) -> dict[str, Any]:
    """`state` (full tensors) with this rank's chunk of every tensor-parallel entry in place of
    the full tensor. The caller checked the shapes against `unsplit_shapes` first."""
    pieces = dict(state)
    for key, shard in shards.items():
        if key in state:  # load_state_dict names a missing one
            pieces[key] = _cut(state[key], shard)
    return pieces


def optimizer_shards(
    module: nn.Module, optimizer: torch.optim.Optimizer, shards: dict[str, TensorShard]
) -> dict[int, str]:
    """The optimizer's numbers (its state_dict's) of the parameters that are tensor-parallel
    shards, with their state_dict key."""
    key_of = {id(value): key for key, value in module.state_dict(keep_vars=True).items()}
    found = {}
    params = [param for group in optimizer.param_groups for param in group["params"]]
    for index, param in enumerate(params):
        key = key_of.get(id(param))
        if key in shards:
            found[index] = key
    return found


def gather_optimizer_shards(
    state_dict: dict[str, Any],
    numbers: dict[int, str],
    shards: dict[str, TensorShard],
    local: dict[str, torch.Size],
) -> dict[str, Any]:
    """`optimizer.state_dict()` with each state shaped like its parameter's shard gathered to the
    full tensor's (a collective: the same optimizer on every rank of each group)."""
    state = dict(state_dict["state"])
    for index, key in numbers.items():
        if index not in state:
            continue  # no step yet: the same on every rank
        state[index] = {
            name: _gather(value, shards[key], f"{key!r}'s optimizer state {name!r}")
            if _shaped(value, local[key])
            else value
            for name, value in sorted(state[index].items())  # the same order on every rank
        }
    return {**state_dict, "state": state}


def cut_optimizer_shards(
    state_dict: dict[str, Any],
    numbers: dict[int, str],
    shards: dict[str, TensorShard],
    full: dict[str, torch.Size],
) -> dict[str, Any]:
    """A full optimizer state dict with this rank's chunk of each state shaped like its
    parameter's full tensor."""
    state = dict(state_dict["state"])
    for index, key in numbers.items():
        if index in state:
            state[index] = {
                name: _cut(value, shards[key]) if _shaped(value, full[key]) else value
                for name, value in state[index].items()
            }
    return {**state_dict, "state": state}


def gather_stages(entry: dict[str, Any], pipeline: Pipeline) -> list[dict[str, Any]] | None:
    """Every stage's `entry` on rank 0, indexed by stage (None elsewhere). Only the ranks of
    rank 0's pipeline take part: another pipeline's ranks hold replicas of the same stages."""
    if 0 not in group_ranks(pipeline.group):
        return None
    entry = _on_cpu(entry)  # unpickled on rank 0: not onto another rank's GPU
    gathered: list[Any] | None = [None] * pipeline.count if dist.get_rank() == 0 else None
    dist.gather_object(entry, gathered, dst=0, group=pipeline.group)
    return gathered


def _gather(local: torch.Tensor, shard: TensorShard, what: str) -> torch.Tensor:
    """cat(all_gather(local), dim): the full tensor whose chunk(., W, dim)[r] rank r holds."""
    local = local.detach().contiguous()
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(shard.group))]
    work = dist.all_gather(pieces, local, group=shard.group, async_op=True)
    wait_for(work, f"all-gather of {what} for save_checkpoint", shard.group)
    return torch.cat(pieces, shard.dim)


def _cut(full: torch.Tensor, shard: TensorShard) -> torch.Tensor:
    world_size, rank = dist.get_world_size(shard.group), dist.get_rank(shard.group)
    return torch.chunk(full, world_size, shard.dim)[rank].clone()  # its own storage


def _shaped(value: Any, shape: torch.Size) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == shape


def _on_cpu(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _on_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(item) for item in value)
    return value
