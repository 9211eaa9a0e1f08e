"""One optimizer step with gradient accumulation under DDP, done right: the loop that
no_sync_backward_only.py, loss_not_divided.py and step_inside_no_sync.py each get wrong in one
line. Works with torch's DistributedDataParallel and with MiniDDP alike.
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
    """Accumulate k micro-batches' gradients, averaged over ranks once, then step.

    The gradient of the mean loss over k micro-batches is the mean of their gradients, so each
    micro-batch's loss is divided by k before backward: .grad then sums to the mean. The first
    k - 1 forwards AND backwards run inside no_sync() (the forward decides whether its backward
    all-reduces); the last runs outside, and its backward averages the whole accumulated .grad
    over the ranks. Only then does the optimizer step, on every rank the same gradient.
    """
    k = len(micro_batches)
    for j, (inputs, targets) in enumerate(micro_batches):
        with model.no_sync() if j < k - 1 else nullcontext():
            loss = nn.functional.mse_loss(model(inputs), targets) / k
            loss.backward()
    optimizer.step()
