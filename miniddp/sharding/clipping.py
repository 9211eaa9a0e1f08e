"""Gradient clipping over every parallelism: the one place where sharding stops being invisible.

`torch.nn.utils.clip_grad_norm_(params, max_norm)` computes the norm of the gradients it is
given and scales them by min(1, max_norm / norm). Under DDP every rank holds every averaged
gradient, so each computes the true norm. But under ZeRO-2 a rank holds only the gradients it
owns, under fully_shard a piece of each, under tensor parallelism a shard of some, under a
pipeline only its stage's: each rank would compute the norm of *its part*, clip by a factor of
its own, and the replicas would drift apart while nothing complains.

    loss.backward()
    miniddp.sharding.clip_grad_norm_(model.parameters(), max_norm=1.0)   # the true norm
    optimizer.step()

Same signature and return value as torch's (its ZeRO and FSDP1 offered a `clip_grad_norm_`
method for the same reason). A collective: call it on every rank, with the parameters that rank
holds. It reads only the mark each parallelism leaves on its parameters (miniddp/placement.py).

The maths. For p < inf the norm is a sum over pieces,

    ||g||_p^p = sum over the distinct pieces x of the model's gradients of ||x||_p^p

and a piece is held by several ranks exactly along the axes where it is *not* split. Call a
parameter's category C the set of axes along which it is distinct across ranks, read off its
marks:

    "data"    a DataShard mark (ZeRO, fully_shard): counted only where counted_here(), so a
              ZeRO-1 gradient, replicated but owned, is counted once, on its owner; under
              HSDP the mark names the shard group, and the replicas along the other mesh dim,
              which hold the same piece, are no axis here: each piece counts once
    "tensor"  a TensorShard mark: each TP rank holds another chunk
    "expert"  a TensorShard mark on the "expert" axis: each EP rank holds other experts (the
              experts are replicated over TP, so they are distinct along ep, not tp)
    "stage"   a Stage mark: counted only on the rank of the stage group that runs the stage,
              index % W (W ranks; one stage a rank: the index itself; a V schedule's second
              stage, on rank 2W - 1 - index, its mark names), so a replica another stage holds
              (a GPT's tied embedding on the last stage, marked as stage 0's) is counted once,
              by stage 0's rank; interleaved, a rank's v stages all count there

Each rank adds ||x||_p^p per category into a vector v of 15 partial sums (one per non-empty
subset of the four axes). Along each axis k that some parameter has, in the fixed order data,
tensor, expert, stage, one all-reduce SUM over k's group adds the ranks' vectors, after every
rank whose place in that group is not 0 has zeroed the entries of the categories that do not
contain k:

    v_C  <-  sum over the ranks r of the group of  v_C(r)   if k in C   (distinct pieces)
    v_C  <-  v_C(rank 0 of the group)                        otherwise   (replicas: one copy)

Why that is the true sum: on a mesh, v_C at a rank depends only on its coordinates along the
axes in C (along the others it holds the same pieces). After the all-reduce along k, v_C is
constant along k, and either summed over k (k in C) or taken at k = 0 (k not in C); the later
all-reduces, along other axes, keep it constant along k. After the last axis, every rank holds,
for every C, the sum over the distinct coordinates along C of the pieces at coordinate 0 along
the rest: each distinct piece once. The parameters no parallelism marked (the empty category)
are replicated everywhere, so their sum stays local and is added at the end. Then

    total = (sum of the entries) ^ (1/p)

For p = inf the norm is a maximum, and a replica's maximum is its own: the all-reduces take MAX
and zero nothing.

Every rank ends with the same bits, by the same sums in the same order. An all-reduce hands all
the ranks of its group one result, so after the one along k the vector is the same bits along k.
A later all-reduce along another axis keeps that: the two groups through two ranks that differ
only along k get the same bits at the same places in the group, zero the same entries, and add
them by the same algorithm over the same size. So after the last axis every rank holds the same
vector, and each adds the same 16 entries (the local one last) in the same order and takes the
same root. The unmarked parameters' part is the same on every rank as long as their gradients
are (DDP's are: its all-reduce hands every rank one result).

The cost: one all-reduce of 15 numbers per axis some parameter is split along, in float64 (the
ranks need one dtype without asking one another, and under a pipeline they hold different
parameters; the total is then cast back to the gradients' dtype, as torch returns it). A model
no parallelism touched costs no communication, and the result is torch's `clip_grad_norm_` bit
for bit.

Refused before any communication, by each rank from its own marks: two groups of one kind (two
TP groups of different ranks), and groups of two kinds that share ranks other than this one (the
sums along the two axes would count some pieces twice): both mean the marks are not the axes of
one mesh.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import reduce

import torch
import torch.distributed as dist

from miniddp.job.faults import wait_for
from miniddp.placement import DataShard, Placement, group_ranks, placement_of

KINDS = ("data", "tensor", "expert", "stage")  # the axes, in the order their all-reduces run
CATEGORIES = range(1, 1 << len(KINDS))  # the non-empty subsets of KINDS, as bit masks


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of `parameters` by their total norm over every rank, and return that
    norm (the same on every rank). A collective when some parameter is marked: call it on every
    rank, with the parameters that rank holds."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm_type = float(norm_type)
    marked = [(p, placement_of(p)) for p in params if not placement_of(p).replicated]
    marked = _experts_sharded_over_the_rest_of_data(marked)
    replicated = [p.grad for p in params if placement_of(p).replicated and p.grad is not None]
    if not marked:
        total = torch.nn.utils.get_total_norm(replicated, norm_type, error_if_nonfinite, foreach)
    else:
        total = _total_over_ranks(params, marked, replicated, norm_type, foreach)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} of the gradients is non-finite ({total}), "
                "so it cannot clip them. Pass error_if_nonfinite=False to clip anyway."
            )
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total


def _total_over_ranks(
    params: list[torch.Tensor],
    marked: list[tuple[torch.Tensor, Placement]],
    replicated: list[torch.Tensor],
    norm_type: float,
    foreach: bool | None,
) -> torch.Tensor:
    groups = _one_group_per_kind([placement for _, placement in marked])
    grads = [p.grad for p in params if p.grad is not None]
    device = (grads or params)[0].device
    dtypes = [g.dtype for g in grads]  # what torch's norm would be returned in
    dtype = reduce(torch.promote_types, dtypes) if dtypes else torch.get_default_dtype()
    infinite = math.isinf(norm_type)
    by_category: dict[int, list[torch.Tensor]] = {}
    for param, placement in marked:
        category = _category_counted_here(placement)
        if param.grad is not None and category is not None:
            by_category.setdefault(category, []).append(param.grad)
    partial = torch.zeros(len(CATEGORIES), dtype=torch.float64, device=device)
    for category, held in by_category.items():
        partial[category - 1] = _part(held, norm_type, foreach)
    for bit, kind in enumerate(KINDS):
        if kind not in groups or dist.get_world_size(groups[kind]) == 1:
            continue  # no parameter split along this axis, or an axis of one rank
        group = groups[kind]  # None: the whole job
        if not infinite and dist.get_rank(group) != 0:
            replicas = [c - 1 for c in CATEGORIES if not c & (1 << bit)]
            partial[replicas] = 0  # the same on every rank of the group: rank 0's copy counts
        wait_for(
            dist.all_reduce(
                partial,
                op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM,
                group=group,
                async_op=True,
            ),
            f"all-reduce of the gradients' norm of order {norm_type:g} along the {kind} axis "
            "(clip_grad_norm_)",
            group,
        )
    local = _part(replicated, norm_type, foreach).to(device).reshape(1)
    entries = torch.cat([partial, local])  # the same values in the same order on every rank
    total = entries.max() if infinite else entries.sum().pow(1.0 / norm_type)
    return total.to(dtype)


def _experts_sharded_over_the_rest_of_data(
    marked: list[tuple[torch.Tensor, Placement]],
) -> list[tuple[torch.Tensor, Placement]]:
    """fully_shard with expert parallelism (parallelize_experts.py): most parameters are
    sharded over dp x ep, the experts over dp (and cut over ep). An expert's piece is then
    distinct along dp and along ep, which together are the others' data axis: it is counted
    along that one axis, as a piece of dp x ep, so that the data axis has one group."""
    data = {tuple(group_ranks(pl.data.group)): pl.data.group for _, pl in marked if pl.data}
    if len(data) < 2:
        return marked
    widest, group = max(data.items(), key=lambda item: len(item[0]))
    recast = []
    for param, placement in marked:
        expert, shard = placement.tensor, placement.data
        if expert is not None and expert.axis == "expert" and shard is not None:
            across = set(group_ranks(shard.group)) | set(group_ranks(expert.group))
            together = len(group_ranks(shard.group)) * len(group_ranks(expert.group))
            if across <= set(widest) and together == len(widest):
                placement = Placement(data=DataShard(group), stage=placement.stage)
        recast.append((param, placement))
    return recast


def _category_counted_here(placement: Placement) -> int | None:
    """The bit mask of the axes `placement` is distinct along, or None where another rank
    counts this copy (a ZeRO gradient's non-owner, a replica of another stage's parameter)."""
    data, stage = placement.data, placement.stage
    if data is not None and not data.counted_here():
        return None
    if stage is not None and dist.get_rank(stage.group) != stage.runs_on():
        return None
    return sum(1 << KINDS.index(kind) for kind in _marks(placement))


def _marks(placement: Placement) -> dict[str, object]:
    """The axes a parameter is split along, each with its mark (a TensorShard names its own)."""
    tensor = placement.tensor
    along = {"data": placement.data, "stage": placement.stage}
    along |= {tensor.axis: tensor} if tensor is not None else {}
    return {kind: mark for kind, mark in along.items() if mark is not None}


def _one_group_per_kind(placements: list[Placement]) -> dict[str, dist.ProcessGroup | None]:
    """The one group each axis runs over; refused if the marks are not the axes of one mesh."""
    groups: dict[str, tuple[tuple[int, ...], dist.ProcessGroup | None]] = {}
    for placement in placements:
        for kind, mark in _marks(placement).items():
            ranks = tuple(group_ranks(mark.group))
            seen = groups.setdefault(kind, (ranks, mark.group))[0]
            if seen != ranks:
                raise ValueError(
                    f"clip_grad_norm_ got parameters split over two different {kind} groups, "
                    f"of ranks {list(seen)} and {list(ranks)}: it adds the norm along each axis "
                    f"of one mesh once. Use one {kind} group for every parameter (the mesh's), "
                    "or clip each group's parameters separately."
                )
    me = dist.get_rank()
    kinds = [kind for kind in KINDS if kind in groups]
    for i, first in enumerate(kinds):
        for second in kinds[i + 1 :]:
            shared = sorted((set(groups[first][0]) & set(groups[second][0])) - {me})
            if shared:
                raise ValueError(
                    f"clip_grad_norm_: the {first} group and the {second} group share ranks "
                    f"{shared} besides this one ({me}), so they are not two axes of one mesh, "
                    "and a sum along both would count their pieces twice. Build the groups "
                    "from one mesh: mesh['dp'].get_group(), mesh['tp'].get_group(), "
                    "mesh['pp'].get_group()."
                )
    return {kind: group for kind, (_, group) in groups.items()}


def _part(grads: list[torch.Tensor], norm_type: float, foreach: bool | None) -> torch.Tensor:
    """sum of ||g||_p^p over `grads` (for p = inf, their largest |element|), in float64."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    norm = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach).to(torch.float64)
    return norm if math.isinf(norm_type) else norm.pow(norm_type)
