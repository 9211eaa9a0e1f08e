"""Which positions of the sequence a rank holds, and how to cut a tensor into them and back.

Context parallelism splits the *sequence*: each of the W ranks of the context-parallel group
holds S/W positions of every activation, q, k and v included. Which positions is the layout:

    plain          rank r holds chunk r of torch.chunk(x, W, dim): positions [r S/W, (r+1) S/W)
    load-balanced  rank r holds chunks r and 2W-1-r of torch.chunk(x, 2W, dim), concatenated
                   (torch's _HeadTailLoadBalancer)

Why balance: under a causal mask query i attends to keys 0..i, so the work of a chunk of
queries grows with its position. Plain, rank r computes r + 1/2 chunk pairs' worth of scores
(a diagonal pair is half masked): the last rank 2W-1 times the first, and the ring waits for it
at every step. Head and tail paired, chunk r (early, cheap) and chunk 2W-1-r (late, dear) cost
the same on every rank: (r + 1/2) + (2W-1-r + 1/2) = 2W pairs of half-size chunks each.
attention.py counts them.

`shard_sequence` is differentiable (a slice); `unshard_sequence` gathers every rank's part with
MiniDDP's all-gather, and its backward takes this rank's part of the gradient back, as torch's
DTensor full_tensor() does (a gathered, replicated tensor's gradient is the same on every rank).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from miniddp.collectives import all_gather
from miniddp.job.env import size_and_rank_in
from miniddp.job.faults import wait_for


def group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """W and this rank's place in the context-parallel group, or a clear error."""
    return size_and_rank_in(
        group,
        "context-parallel",
        "pass each rank its own group (mesh['cp'].get_group()), or group=None for the whole job",
    )


def chunks_of(rank: int, world_size: int, load_balance: bool) -> list[int]:
    """The chunks rank `rank` holds, in its local order: [r] of W, or [r, 2W-1-r] of 2W."""
    return [rank, 2 * world_size - 1 - rank] if load_balance else [rank]


def chunk_count(world_size: int, load_balance: bool) -> int:
    return 2 * world_size if load_balance else world_size


def refuse_uneven(length: int, world_size: int, load_balance: bool, what: str) -> None:
    """A length the layout cannot cut into equal chunks, refused with the fix."""
    pieces = chunk_count(world_size, load_balance)
    if length % pieces:
        how = f"2W = {pieces} (load_balance=True: two chunks a rank)" if load_balance else "W"
        raise ValueError(
            f"{what} has {length} positions, which do not split into {pieces} equal chunks "
            f"over {world_size} context-parallel ranks: the length must be a multiple of {how}. "
            f"Pad or trim the sequence to a multiple of {pieces}."
        )


def shard_sequence(
    x: torch.Tensor,
    dim: int,
    group: dist.ProcessGroup | None = None,
    load_balance: bool = False,
) -> torch.Tensor:
    """This rank's part of `x` along `dim` (the sequence), laid out as the module docstring says."""
    world_size, rank = group_size_and_rank(group)
    refuse_uneven(x.shape[dim], world_size, load_balance, f"a tensor of shape {tuple(x.shape)}")
    pieces = torch.chunk(x, chunk_count(world_size, load_balance), dim)
    return torch.cat([pieces[c] for c in chunks_of(rank, world_size, load_balance)], dim)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, load_balance: bool) -> Any:
        ctx.args = (dim, group, load_balance)
        world_size, _ = group_size_and_rank(group)
        local = x.contiguous()
        parts = [torch.empty_like(local) for _ in range(world_size)]
        work = all_gather(parts, local, group=group, async_op=True)
        wait_for(work, f"unshard_sequence's all-gather of {tuple(x.shape)}", group)
        # Each rank's part is its chunks in its local order; put every chunk back in its place.
        per_rank = len(chunks_of(0, world_size, load_balance))
        placed: dict[int, torch.Tensor] = {}
        for rank, part in enumerate(parts):
            for chunk, piece in zip(
                chunks_of(rank, world_size, load_balance), part.chunk(per_rank, dim)
            ):
                placed[chunk] = piece
        return torch.cat([placed[c] for c in sorted(placed)], dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        dim, group, load_balance = ctx.args
        return shard_sequence(grad, dim, group, load_balance), None, None, None


def unshard_sequence(
    x_local: torch.Tensor,
    dim: int,
    group: dist.ProcessGroup | None = None,
    load_balance: bool = False,
) -> torch.Tensor:
    """The whole tensor, on every rank, from each rank's `shard_sequence` part (the inverse)."""
    group_size_and_rank(group)
    if load_balance and x_local.shape[dim] % 2:
        raise ValueError(
            f"with load_balance=True a rank's part holds two equal chunks, but this one has "
            f"{x_local.shape[dim]} positions along dim {dim}: give it what shard_sequence("
            "..., load_balance=True) returned"
        )
    return _Unshard.apply(x_local, dim % x_local.dim(), group, load_balance)
