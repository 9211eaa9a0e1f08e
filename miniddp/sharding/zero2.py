"""ZeRO-2: gradients reduce-scattered per bucket, so each rank keeps only its own share's averages.

Under ZeRO-1 every rank still receives every averaged gradient, though it steps only its own
share: the all-reduce that delivered the rest was half wasted. An all-reduce is a
reduce-scatter followed by an all-gather (miniddp/collectives/ring.py); ZeRO-2 keeps the first
half for the gradients, and ZeRO-1's all-gather of the updated *parameters* becomes the second:

    DDP      all-reduce(gradients)                                   2(W-1)/W·Ψ sent per rank
    ZeRO-2   reduce-scatter(gradients), step, all-gather(parameters)  (W-1)/W·Ψ + (W-1)/W·Ψ

It is a comm hook for MiniDDP, whose state is the ZeroRedundancyOptimizer that says who owns
which parameter:

    ddp = miniddp.MiniDDP(model)
    optimizer = miniddp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    ddp.register_comm_hook(optimizer, reduce_scatter_hook)

In each bucket, rank r's piece is the gradients of the parameters r owns there, laid end to end
and padded to the longest rank's piece (a reduce-scatter needs equal pieces; the padding is the
price of whole-parameter ownership, stated by the benchmark). The gradients of parameters
another rank owns are dropped (`.grad = None`) once copied into the bucket, so after backward
this rank holds 4Ψ/W bytes of gradients. MiniDDP's buckets stay, as they do in DDP: freeing them
too is what fully_shard (ZeRO-3) does.

With two ranks the sums are a + b = b + a, so training is bitwise MiniDDP + AdamW; with more
the ring adds in another order than gloo's all-reduce, and the last bits may differ.
"""

from __future__ import annotations

from typing import Any

import torch

import miniddp.collectives as collectives
from miniddp.sharding.zero import ZeroRedundancyOptimizer


def reduce_scatter_hook(optimizer: ZeroRedundancyOptimizer, bucket: Any) -> torch.futures.Future:
    """Average the bucket's gradients onto their owners: a reduce-scatter of one piece per rank.
    `bucket` is any DDP comm hook's (MiniDDP's GradBucket or torch's dist.GradBucket): this
    reads its buffer() and parameters() only."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        raise TypeError(
            "reduce_scatter_hook's state must be the miniddp.ZeroRedundancyOptimizer that owns "
            f"the parameters: ddp.register_comm_hook(optimizer, reduce_scatter_hook); got "
            f"{type(optimizer).__name__}"
        )
    world, me = optimizer.world_size, optimizer.rank
    flat = bucket.buffer()
    owners = [optimizer.owner_of(param) for param in bucket.parameters()]
    by_rank = [[v for v, o in zip(bucket.gradients(), owners) if o == r] for r in range(world)]
    longest = max(sum(v.numel() for v in views) for views in by_rank)
    pieces = flat.new_zeros(world, longest)
    for piece, views in zip(pieces, by_rank):
        if views:
            filled = piece[: sum(v.numel() for v in views)]
            torch.cat([v.reshape(-1) for v in views], out=filled)
            filled.mul_(1.0 / world)  # as DDP does: g·(1/W), then a sum
    for param, owner in zip(bucket.parameters(), owners):
        if owner != me:
            param.grad = None  # its bucket slot holds it for the reduce-scatter
    mine = flat.new_empty(longest)
    work = collectives.reduce_scatter(
        mine, list(pieces), group=optimizer.process_group, async_op=True
    )

    def unpack(_: torch.futures.Future) -> torch.Tensor:
        if by_rank[me]:
            averages = mine[: sum(v.numel() for v in by_rank[me])].split(
                [v.numel() for v in by_rank[me]]
            )
            torch._foreach_copy_([v.view(-1) for v in by_rank[me]], list(averages))
        return flat  # MiniDDP writes our averages back into our parameters' .grad

    return work.get_future().then(unpack)
