"""Mistake: no_sync() around backward only. The forward decides, so every micro-step syncs.

Symptom: nothing looks wrong. The gradients are right (up to rounding) and the replicas agree,
but every micro-step all-reduces: k rounds of communication per optimizer step instead of one,
so accumulation saves none of the traffic it was written to save.

Why: DDP decides at forward time whether the coming backward will all-reduce. torch's DDP reads
its no_sync flag in forward(), where it arms the reducer for the backward that follows; a
forward run outside no_sync() has armed it already, and entering no_sync() afterwards changes
nothing. The result stays right because averaging is linear: the mean over ranks of (already
averaged gradients + this micro-step's) is the mean of the sums.

How torch avoids it: it doesn't, at run time. The docstring of `no_sync` warns that "the
forward pass should be included inside the context manager, or else gradients will still be
synchronized", and nothing checks it. The property checks cannot see it either (the numbers are
right): the check that catches it counts the all-reduces per optimizer step
(tests/test_mistakes.py), as chapter 05 does.

The fix: correct_loop.py, forward and backward both inside `with model.no_sync():`.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    k = len(micro_batches)
    for j, (inputs, targets) in enumerate(micro_batches):
        loss = nn.functional.mse_loss(model(inputs), targets) / k  # the mistake: forward outside
        with model.no_sync() if j < k - 1 else nullcontext():
            loss.backward()
    optimizer.step()
