"""Communication hooks: what MiniDDP does with a full bucket, as a function you can swap.

`ddp.register_comm_hook(state, hook)` replaces the bucket's all-reduce with
`hook(state, bucket) -> Future[Tensor]`, torch's signature: torch's own hooks
(`torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook`, ...) run on
MiniDDP unchanged, and these run on torch's DDP. The bucket arrives holding this rank's own
gradients, not yet divided by W: the hook averages (scale by 1/W, then all-reduce with SUM).

    ddp.register_comm_hook(None, all_reduce_hook("ring"))   # MiniDDP over our ring all-reduce
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from miniddp import collectives


def all_reduce_hook(algorithm: str = "auto"):
    """A hook that averages each bucket with one of MiniDDP's own all-reduce algorithms ("ring",
    "reduce_broadcast", "recursive_doubling" or "auto"), built from send/recv in
    `miniddp.collectives`.

    It scales by the float 1/W before summing, as MiniDDP's default path does, so with 2 ranks
    (where a + b = b + a) the result is bit for bit the one gloo's all-reduce gives.
    """
    if algorithm not in collectives.ALL_REDUCE_ALGORITHMS:
        raise ValueError(
            f"Unknown all-reduce algorithm {algorithm!r}; "
            f"choose one of {', '.join(collectives.ALL_REDUCE_ALGORITHMS)}."
        )

    def hook(process_group: Any, bucket: Any) -> torch.futures.Future:
        group = process_group if isinstance(process_group, dist.ProcessGroup) else None
        flat = bucket.buffer()
        flat.mul_(1.0 / dist.get_world_size(group))
        work = collectives.all_reduce(flat, group=group, algorithm=algorithm, async_op=True)
        return work.get_future().then(lambda future: future.value()[0])  # torch wants a Tensor

    hook.__name__ = f"{algorithm}_all_reduce_hook"
    return hook
