"""How the replicas average what they send each other at a sync, and how many bytes that is.

Local SGD averages parameters, DiLoCo pseudo-gradients; both hand a list of tensors to an
`Exchange`, which starts one all-reduce per tensor and returns a `PendingAverage` to wait on
later (so a Streaming DiLoCo fragment's average can travel while inner steps go on).

The average is SUM, then a division by W on arrival: what torchft's Manager does (its
`allreduce` sums, then divides by the number of participants), so that the bits agree with it.

Which all-reduce: `"gloo"` is torch.distributed's own on the group's backend. It is the default
because the proofs are against torchft and torch, which run gloo's: at W = 2 every algorithm gives
the same bits (a + b = b + a), but at W >= 3 the bits depend on the order of the additions, and
gloo's CPU ring (seen here at W = 4 on 1,000 elements: chunk c folds ranks c-1, c-2, c-3, then
c) runs leftwards, while ours (miniddp/collectives/ring.py) goes rightwards. The course's own
all-reduces ("ring", "auto", "recursive_doubling", "reduce_broadcast") can be chosen instead:
the same average, last bits aside.

Every wait goes through `miniddp.faults.wait_for`, so that a replica that died is named. Then
the survivors agree on who is left and finish the sync in a group of their own (survivors.py);
every later sync runs there.

Low precision: with `dtype=torch.bfloat16` each tensor travels (and is summed) as bf16, half the
bytes of float32, and is cast back before the division. `sent_bytes` counts the payload handed
to the all-reduces, numel x element size per tensor per sync: the number a bytes-by-formula
check multiplies out (an all-reduce algorithm then sends a multiple of it, 2(W-1)/W for a ring).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from miniddp import collectives
from miniddp.job.faults import CollectiveFailed, wait_for
from miniddp.local_sgd.survivors import Heartbeat, agree_on_survivors, group_of

EXCHANGE_ALGORITHMS = ("gloo", *collectives.ALL_REDUCE_ALGORITHMS)
EXCHANGE_DTYPES = (None, torch.bfloat16, torch.float16)


@dataclass
class PendingAverage:
    """All-reduces in flight (`Exchange.wait` returns the averages). `originals` are the tensors
    as given, kept until the sum arrives: a sync that failed is redone from them."""

    originals: list[torch.Tensor]
    travelling: list[torch.Tensor]
    works: list
    sync: int


class Exchange:
    """Averages lists of tensors over `group` (None: the whole job), counting bytes sent; after
    a replica died, over the survivors (survivors.py)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        algorithm: str = "gloo",
        dtype: torch.dtype | None = None,
    ) -> None:
        if algorithm not in EXCHANGE_ALGORITHMS:
            raise ValueError(
                f"algorithm must be one of {', '.join(EXCHANGE_ALGORITHMS)}; got {algorithm!r}"
            )
        if dtype not in EXCHANGE_DTYPES:
            raise ValueError(
                f"the exchange dtype must be None (the tensors' own), torch.bfloat16 or "
                f"torch.float16; got {dtype}"
            )
        self.group = group
        self.algorithm = algorithm
        self.dtype = dtype
        self.survivors: list[int] | None = None  # global ranks, once a replica has died:
        # then `group` is a new group of theirs (survivors.py)
        self.failure: CollectiveFailed | None = None  # what named the dead, once one died
        self.heartbeat: Heartbeat | None = None  # beats while syncs are due: `open`
        self.syncs = 0
        self.sent_bytes = 0

    @property
    def size(self) -> int:
        """How many replicas the average is over."""
        return dist.get_world_size(self.group)

    def start(self, tensors: Sequence[torch.Tensor]) -> PendingAverage:
        """Start summing every tensor over the group, on a copy (cast to `dtype`)."""
        self.syncs += 1
        travelling = [t.to(self.dtype or t.dtype, copy=True) for t in tensors]
        self.sent_bytes += sum(t.numel() * t.element_size() for t in travelling)
        works = [self._all_reduce(t) for t in travelling]
        return PendingAverage(list(tensors), travelling, works, self.syncs)

    def wait(self, pending: PendingAverage) -> list[torch.Tensor]:
        """The averages, in the dtype each tensor was given in. A replica found dead here is
        left out from this sync on (survivors.py)."""
        try:
            for index, work in enumerate(pending.works):
                wait_for(work, f"sync {pending.sync}: all-reduce of tensor {index}", self.group)
        except CollectiveFailed as failure:
            self.failure = failure
            self.survivors = agree_on_survivors(self.group, pending.sync, failure)
            self.group = group_of(self.survivors)
            pending.travelling = [t.to(self.dtype or t.dtype, copy=True) for t in pending.originals]
            for tensor in pending.travelling:  # the failed sync again, by send/recv
                collectives.all_reduce(tensor, ReduceOp.SUM, group=self.group, algorithm="ring")
        return [
            total.to(given.dtype).div_(self.size)
            for total, given in zip(pending.travelling, pending.originals)
        ]

    def open(self) -> None:
        """Start beating, so that the others can tell this replica slow from dead."""
        self.heartbeat = Heartbeat()

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None

    def _all_reduce(self, tensor: torch.Tensor):
        if self.algorithm == "gloo":
            return dist.all_reduce(tensor, ReduceOp.SUM, group=self.group, async_op=True)
        return collectives.all_reduce(
            tensor, ReduceOp.SUM, group=self.group, algorithm=self.algorithm, async_op=True
        )
