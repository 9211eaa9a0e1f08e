"""Where a parameter lives across the ranks: the mark each parallelism leaves on its parameters.

Three things span every parallelism, and each must know, for every parameter, which ranks hold
which part of it:

    clip_grad_norm_     the true norm counts every piece once, and a replica once, not W times
    checkpoints         a shard is saved as its full tensor, and cut back out for each rank
    MiniDDP's refusal   averaging a tensor-parallel shard with a *different* shard destroys both

They read this mark, never a parallelism's internals, so no parallelism imports another. Each
parallelism adds its own field when it takes a parameter:

    TensorShard(group, dim)        tensor parallelism: this rank holds chunk(full, W, dim)[rank]
                                   of the full tensor, W = the size of `group`; expert
                                   parallelism's experts too, along their own axis ("expert")
    DataShard(group, owner)        ZeRO / fully_shard: the gradient is held by `owner` alone
                                   (ZeRO-1/2), or each rank of `group` holds a flat piece
                                   (fully_shard: owner None)
    Stage(group, index, count,     pipeline: the parameter is stage `index`'s, of `count` stages
          rank)                    over `group`, run on its rank `rank`; the other ranks of
                                   `group` hold other stages

A parameter no parallelism marked is replicated: every rank holds the whole of it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary


@dataclass(frozen=True)
class TensorShard:
    """chunk(full, W, dim)[rank of group]: a tensor-parallel shard; with axis "expert", this
    expert-parallel rank's experts (chunk(E, ep, 0)), cut alike along another axis of the mesh."""

    group: dist.ProcessGroup | None
    dim: int
    axis: str = "tensor"


@dataclass(frozen=True)
class DataShard:
    """Held by `owner` alone (ZeRO), or with owner None a different piece on every rank of
    `group` (fully_shard)."""

    group: dist.ProcessGroup | None
    owner: int | None = None

    def counted_here(self) -> bool:
        return self.owner is None or self.owner == dist.get_rank(self.group)


@dataclass(frozen=True)
class Stage:
    """Stage `index` of `count`, the pipeline running over `group`, on rank `rank` of it (None:
    index % W, torch's loop; a V schedule's second stage is elsewhere, so a stage names it)."""

    group: dist.ProcessGroup | None
    index: int
    count: int
    rank: int | None = None

    def runs_on(self) -> int:
        """The rank of `group` that runs this stage."""
        return self.index % dist.get_world_size(self.group) if self.rank is None else self.rank


@dataclass(frozen=True)
class Placement:
    """Everything known about where one parameter lives; None: not split that way."""

    tensor: TensorShard | None = None
    data: DataShard | None = None
    stage: Stage | None = None

    @property
    def replicated(self) -> bool:
        return self == REPLICATED


REPLICATED = Placement()
_MARKS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> its Placement


def placement_of(param: torch.Tensor) -> Placement:
    return _MARKS.get(param, REPLICATED)


def mark(
    param: torch.Tensor,
    *,
    tensor: TensorShard | None = None,
    data: DataShard | None = None,
    stage: Stage | None = None,
) -> None:
    """Add what one parallelism knows to `param`'s placement (the other fields stay)."""
    given = {"tensor": tensor, "data": data, "stage": stage}
    _MARKS[param] = replace(placement_of(param), **{k: v for k, v in given.items() if v})


def carry_over(source: torch.Tensor, target: torch.Tensor) -> None:
    """`target` replaces `source` (a shard made from it): it keeps the marks `source` had."""
    if source in _MARKS:
        _MARKS[target] = _MARKS[source]


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of `group`, in its order (None: the whole job)."""
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)
