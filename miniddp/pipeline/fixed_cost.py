"""A layer that takes a fixed time: compute made deterministic, to measure a schedule.

On a shared laptop, how long a forward takes varies from one microbatch to the next, and the
stages' processes steal each other's cores. The bubble formula assumes every F takes t_f and
every B takes t_b. `FixedCost(t_f, t_b)` makes that true: it passes its input through unchanged
and sleeps t_f in forward and t_b in backward. A sleeping process uses no core, so four stages
on two cores still run side by side.
"""

from __future__ import annotations

import time

import torch
from torch import nn


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.backward_s)
        return grad, None, None


class FixedCost(nn.Module):
    """Identity in values; `forward_s` seconds in forward, `backward_s` in backward."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.forward_s, self.backward_s)

    def extra_repr(self) -> str:
        return f"forward={self.forward_s * 1e3:g} ms, backward={self.backward_s * 1e3:g} ms"
