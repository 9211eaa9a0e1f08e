"""Mistake: the loss not divided by the number of accumulation steps.

Symptom: gradients k times too large (k micro-steps per optimizer step), so the effective
learning rate is k times the one set; training diverges or needs a retuned rate whenever k
changes. The property checks catch it against one process on the global batch: "off by a factor
of the accumulation steps".

Why: backward adds into .grad. k micro-batches, each with a mean loss, leave the sum of k mean
gradients in .grad, not their mean. The mean over the global batch needs each micro-batch's
loss divided by k (chapter 00 derives it).

How torch avoids it: it doesn't. DDP averages over ranks (the 1/W it applies), never over
micro-steps: it cannot know how many backwards you accumulate. Dividing by k is yours to do.

The fix: correct_loop.py, `loss = loss_fn(...) / k`.
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
        with model.no_sync() if j < k - 1 else nullcontext():
            loss = nn.functional.mse_loss(model(inputs), targets)  # the mistake: no / k
            loss.backward()
    optimizer.step()
