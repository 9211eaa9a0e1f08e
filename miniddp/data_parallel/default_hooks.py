"""Communication hooks: what MiniDDP does with a full bucket, as a function you can swap, and
the `Reducer` every bucket holds, which runs the hook or, without one, the plain all-reduce.

`ddp.register_comm_hook(state, hook)` replaces the bucket's all-reduce with
`hook(state, bucket) -> Future[Tensor]`, torch's signature: torch's own hooks
(`torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook`, ...) run on
MiniDDP unchanged, and these run on torch's DDP. The bucket arrives holding this rank's own
gradients, not yet divided by W: the hook averages (scale by 1/W, then all-reduce with SUM).

    ddp.register_comm_hook(None, all_reduce_hook("ring"))   # MiniDDP over our ring all-reduce
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import miniddp.collectives as collectives
from miniddp.job.faults import wait_for

if TYPE_CHECKING:
    from miniddp.data_parallel.bucket import Bucket


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


CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]


class GradBucket:
    """What a communication hook receives: torch's `dist.GradBucket` interface over a Bucket.

    The methods mirror torch's, so hooks written for torch's DDP run here unchanged.
    """

    def __init__(self, bucket: Bucket, is_last: bool) -> None:
        self._bucket = bucket
        self._is_last = is_last

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat tensor holding every gradient of this bucket (not yet averaged)."""
        return self._bucket.flat

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._bucket.flat.copy_(tensor)

    def gradients(self) -> list[torch.Tensor]:
        return list(self._bucket.views)

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        return self._is_last


class Reducer:
    """What every bucket of one model travels through: an all-reduce over the model's process
    group, or, once one is registered, torch's comm hook `hook(state, GradBucket) -> Future`;
    and the one wait seam (miniddp/job/faults.py), which names a rank that died, stalled or
    stopped early instead of surfacing as a bare gloo timeout."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.comm_hook: tuple[Any, CommHook] | None = None

    def all_reduce(self, bucket: Bucket) -> dist.Work | torch.futures.Future:
        if self.comm_hook is None:
            return dist.all_reduce(bucket.flat, group=self.group, async_op=True)
        state, hook = self.comm_hook
        return hook(state, GradBucket(bucket, bucket.is_last))

    def wait(self, pending: dist.Work | torch.futures.Future, what: str) -> Any:
        """Like `pending.wait()`, naming the rank that never answered (faults.py)."""
        return wait_for(pending, what, self.group)
