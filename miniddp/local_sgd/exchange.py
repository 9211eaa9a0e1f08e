"""How the replicas average what they send each other at a sync, and how many bytes that is.

Local SGD averages parameters, DiLoCo pseudo-gradients; both hand a list of tensors to an
`Exchange`, which starts one all-reduce per tensor and returns a `PendingAverage` to wait on
later (so a Streaming DiLoCo fragment's average can travel while inner steps go on).

The average is SUM, then a division by W on arrival: what torchft's Manager does (its
`allreduce` sums, then divides by the number of participants), so that the bits agree with it.

Which all-reduce: `"gloo"` is torch.distributed's own on the group's backend. It is the default
because the proofs are against torchft and torch, which run gloo's: at W = 2 every algorithm gives
the same bits (a + b = b + a), but at W >= 3 the bits depend on the order of the additions, and
gloo's CPU ring folds chunk c in the order c-1, c-2, ..., c (leftwards), while ours
(miniddp/collectives/ring.py) goes rightwards. The course's own all-reduces ("ring", "auto",
"recursive_doubling", "reduce_broadcast") can be chosen instead: same average, last bits aside.

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

EXCHANGE_ALGORITHMS = ("gloo", *collectives.ALL_REDUCE_ALGORITHMS)
EXCHANGE_DTYPES = (None, torch.bfloat16, torch.float16)


@dataclass
class PendingAverage:
    """All-reduces in flight; `wait()` returns the averages, in the dtype each tensor had."""

    travelling: list[torch.Tensor]
    works: list
    dtypes: list[torch.dtype]
    divide_by: int

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        averages = []
        for tensor, dtype in zip(self.travelling, self.dtypes):
            total = tensor if tensor.dtype == dtype else tensor.to(dtype)
            averages.append(total.div_(self.divide_by))
        return averages


class Exchange:
    """Averages lists of tensors over `group` (None: the whole job), counting bytes sent."""

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
        self.size = dist.get_world_size(group)
        self.sent_bytes = 0

    def start(self, tensors: Sequence[torch.Tensor]) -> PendingAverage:
        """Start summing every tensor over the group (in place, on a copy cast to `dtype`)."""
        travelling = [t if self.dtype in (None, t.dtype) else t.to(self.dtype) for t in tensors]
        works = [self._all_reduce(t) for t in travelling]
        self.sent_bytes += sum(t.numel() * t.element_size() for t in travelling)
        return PendingAverage(travelling, works, [t.dtype for t in tensors], self.size)

    def _all_reduce(self, tensor: torch.Tensor):
        if self.algorithm == "gloo":
            return dist.all_reduce(tensor, ReduceOp.SUM, group=self.group, async_op=True)
        return collectives.all_reduce(
            tensor, ReduceOp.SUM, group=self.group, algorithm=self.algorithm, async_op=True
        )
