"""The chores every rung does the same way, so that each rung's file keeps to its idea.

Each name says what it does; none of it changes from one rung to the next.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn


def trainable_parameters(module: nn.Module, wrapper: str) -> tuple[list[str], list[nn.Parameter]]:
    """The parameters to average, with their names: those that require grad, in registration
    order, a tied (shared) weight once: it is one tensor with one gradient, and
    `named_parameters()` skips repeats."""
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(
            f"{wrapper} got a module with no parameter that requires grad: there is nothing to "
            "average. Wrap the model you train (or unfreeze its parameters)."
        )
    return [name for name, _ in named], [p for _, p in named]


def broadcast_from_rank0(tensors: Iterable[torch.Tensor]) -> None:
    """Overwrite each tensor with rank 0's value, on every rank (one message per tensor)."""
    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor, src=0)


def unfinished_backward() -> RuntimeError:
    return RuntimeError(
        "The previous backward pass started reducing gradients but never finished (did it "
        "raise?). Start again from a fresh forward on every rank."
    )


def no_gradient(names: Iterable[str]) -> RuntimeError:
    return RuntimeError(
        f"These parameters got no gradient in this backward pass: {', '.join(names)}. The "
        "ladder's rungs do not support unused parameters. Make every parameter take part in the "
        "loss, freeze the unused ones (requires_grad=False), or use "
        "MiniDDP(module, find_unused_parameters=True)."
    )
