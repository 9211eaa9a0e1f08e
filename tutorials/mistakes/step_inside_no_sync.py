"""Mistake: optimizer.step() inside no_sync(), with every micro-step.

Symptom: the replicas drift apart from the first step. Each rank steps on its own gradient,
computed from its own shard only; nothing is ever averaged. The property checks catch it at
once: the replicas' gradients differ ("the gradients were not averaged across ranks").

Why: no_sync() is meant for the first k - 1 micro-steps. Wrapping the whole step in it, the
last micro-step's forward too, means no backward is ever armed to all-reduce: the accumulated
.grad stays local when the optimizer reads it.

How torch avoids it: it doesn't. no_sync() cannot know which backward you meant to be the last,
and nothing checks that a step was ever synchronized; MiniDDP doesn't either.

The fix: correct_loop.py, the last micro-step outside no_sync(), the step after it.
"""

from __future__ import annotations

import torch
from torch import nn


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    k = len(micro_batches)
    with model.no_sync():  # the mistake: around every micro-step and the step
        for inputs, targets in micro_batches:
            loss = nn.functional.mse_loss(model(inputs), targets) / k
            loss.backward()
        optimizer.step()
