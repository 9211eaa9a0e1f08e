"""Exercise 6 (chapter 05, rung 5): no_sync(), accumulation without an all-reduce per micro-step.

k micro-steps of accumulation under DDP would pay k rounds of all-reduces when only the sum of
the k gradients is needed. `no_sync()` lets the first k-1 backwards accumulate in `.grad` on
each rank alone; the next synced backward all-reduces the accumulated sum once. The DDP below is
rung 4 (torch's layout), given; the TODOs are only about no_sync. Fill them in, then check:

    python -m pytest tests/test_ddp_equivalence.py -x \
        --ddp tutorials/exercises/no_sync.py:NoSyncDDP --ddp-claims torch-layout,no-sync,batchnorm

The claim trains with k micro-steps, two inside `no_sync()`, against one process and torch's DDP
doing the same (bit for bit), and counts your all-reduces: none inside `no_sync()`. `batchnorm`
puts BatchNorm in the model, so its buffers are compared with torch's too, bit for bit: that is
what checks TODO 3's rule.
Stuck? Chapter 05 (tutorials/05_no_sync.py) explains the idea, and where the forward must be.
Only once your own attempt passes, compare it with rung 5, miniddp/steps/no_sync.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from miniddp.steps.torch_layout import TorchLayoutDDP


class NoSyncDDP(TorchLayoutDDP):
    """Rung 4, plus `no_sync()`: by the time a synced `loss.backward()` returns, every `.grad`
    holds the average over the ranks of everything accumulated since the last synced step."""

    claims = TorchLayoutDDP.claims | {"no-sync"}

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_cap_mb: float | None = None,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__(module, bucket_cap_mb=bucket_cap_mb)
        self.broadcast_buffers = broadcast_buffers  # torch's option; the no-sync claim takes it

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """TODO 1. Inside this block, backward must send nothing, and leave nothing half done
        for the next synced backward (a bucket counted as partly filled, a callback queued, an
        order of readiness recorded from an unsynced backward). Outside it, everything is as
        before. torch decides per forward, not per backward: chapter 05's pitfall shows what
        follows from that, and which of the two your flag should be read in."""
        raise NotImplementedError(
            "TODO exercise 6 (tutorials/exercises/no_sync.py, chapter 05): let backwards "
            "inside NoSyncDDP.no_sync accumulate without an all-reduce"
        )
        yield

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """TODO 3. Rung 4's forward broadcasts rank 0's buffers (BatchNorm's statistics) every
        time. torch's DDP does so only in a forward that follows a synced one: inside no_sync
        each rank's statistics run on alone until the step ends; with broadcast_buffers=False,
        never. The checks compare buffers with torch's, bit for bit, so yours must follow the
        same rule."""
        return super().forward(*inputs, **kwargs)

    def _on_gradient_ready(self, index: int, param: torch.Tensor) -> None:
        """TODO 2. Rung 4's hook copies the gradient into its bucket and may launch it. Why is
        the gradient that the first synced backward after no_sync() copies already the sum of
        all k micro-steps? (What does autograd do to `.grad` before this hook runs?)"""
        super()._on_gradient_ready(index, param)
