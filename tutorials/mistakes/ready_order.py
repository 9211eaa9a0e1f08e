"""Mistake: buckets launched in the order they became full, not in bucket order.

Symptom: when ranks' backwards produce gradients in different orders, one rank's first
all-reduce carries bucket A while another's carries bucket B: collectives pair up by their order
on each rank, so A's values are summed with B's. Equal sizes give silent garbage (different on
every rank); unequal sizes make gloo abort the process. The property checks catch it on a model
whose ranks run two branches in opposite orders: the replicas' gradients differ.

Why: gradient order is not guaranteed to match across ranks. Autograd runs independent branches
in an order that follows how the forward built them, and a forward may branch on the rank, on
the data, or on a random draw; unused parameters or a collective issued during backward shift
things too. Launch order must come from something every rank shares: the bucket index.

How torch avoids it: buckets launch strictly in index order (a full bucket waits for all
earlier ones), and in iteration 0 torch uses one bucket, observes the real order, then rebuilds
every rank's buckets from rank 0's order. Rungs 3 and 4 do the same.

This is rung 3 (BucketedDDP) with `_launch_full_buckets` launching any full bucket at once.
`RankOrderedBranches` is a model whose ranks disagree on the order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from miniddp.steps import BucketedDDP


class LaunchesInReadyOrder(BucketedDDP):
    def _launch_full_buckets(self) -> None:
        for bucket in self.buckets:  # the mistake: any full bucket, earlier ones launched or not
            if bucket.pending is None and bucket.is_full:
                bucket.launch(self._all_reduce)
                self.all_reduce_count += 1


class RankOrderedBranches(nn.Module):
    """Two branches of the same shape, summed; odd ranks compute them in the other order, so
    their backward produces the two weights' gradients in the other order too."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.left = nn.Linear(width, width, bias=False)
        self.right = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() % 2 == 0:
            return torch.tanh(self.left(x)) + torch.tanh(self.right(x))
        right = torch.tanh(self.right(x))
        return torch.tanh(self.left(x)) + right
