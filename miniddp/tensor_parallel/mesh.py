"""A 2-D mesh of ranks: tensor parallelism inside each row, data parallelism down each column.

With W = dp x tp ranks numbered row by row (rank = d * tp + t),

    tp = 2, dp = 2:          TP group (a row)   talks every layer: 2 all-reduces of B x T x H
        0  1   <- node 0                         forward and 2 backward per transformer block
        2  3   <- node 1     DP group (a column) talks once a step: one all-reduce of its
        ^  ^                                     parameter shard's gradients (overlapped)
        DP groups

TP's traffic is on the critical path of every layer, forward and backward, and grows with the
batch; DP's is one gradient all-reduce per step that hides behind backward. So TP goes where the
link is fast (NVLink, inside a machine: consecutive ranks, which torchrun puts on one node) and DP
across the slow one (between machines). Ranks d*tp + t with the same t hold the same shards, so
they are exactly the replicas DP averages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class MeshGroups:
    """This rank's two groups, and where it sits in the mesh."""

    dp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    dp_rank: int  # which row: the replica
    tp_rank: int  # which column: the shard


def mesh_ranks(dp: int, tp: int) -> tuple[list[list[int]], list[list[int]]]:
    """The ranks of every TP group (rows) and every DP group (columns)."""
    rows = [[d * tp + t for t in range(tp)] for d in range(dp)]
    return rows, [[row[t] for row in rows] for t in range(tp)]


def mesh_groups(dp: int, tp: int) -> MeshGroups:
    """Build every TP and DP group (all ranks must call this, in the same order) and return this
    rank's. Like torch's `init_device_mesh(device, (dp, tp))`, but plain process groups."""
    if not dist.is_initialized():
        raise RuntimeError("mesh_groups needs a process group: start with torchrun first")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if dp * tp != world_size:
        raise ValueError(
            f"a {dp} x {tp} mesh needs dp * tp = {dp * tp} ranks, but the job has {world_size}: "
            f"choose dp and tp whose product is {world_size}"
        )
    tp_rows, dp_columns = mesh_ranks(dp, tp)
    tp_groups = [dist.new_group(ranks) for ranks in tp_rows]  # every rank joins every new_group
    dp_groups = [dist.new_group(ranks) for ranks in dp_columns]
    dp_rank, tp_rank = divmod(rank, tp)
    return MeshGroups(dp_groups[tp_rank], tp_groups[dp_rank], dp_rank, tp_rank)
