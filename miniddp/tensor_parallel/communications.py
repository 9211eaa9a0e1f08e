"""Megatron's f and g: the only two places a tensor-parallel block talks to its peers.

A block split the Megatron way (chapter 13) holds, on each of the W ranks of the tensor-parallel
group, a column slice of its first weight and a row slice of its last. Its input X is the same on
every rank (replicated); its output must be too. In between, each rank works alone:

    X --f--> X A_r --...--> Z_r = Y_r B_r --g--> Z = sum_r Z_r

    f  forward: identity        (X is already on every rank)
       backward: all-reduce     (dL/dX = sum_r dL/dX_r: each rank's slice used X, so each
                                 contributed a part of X's gradient)
    g  forward: all-reduce      (Z is the sum of the ranks' partial products)
       backward: identity       (dL/dZ_r = dL/dZ: a sum passes its gradient to every term)

f and g are conjugate: each is the other with forward and backward swapped. That is why a block
costs exactly one all-reduce forward (g) and one backward (f); an attention and an MLP make a
transformer block's two each way.

Both call `dist.all_reduce` by attribute, so the simulated link (miniddp/observe/link.py) sees them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _CopyToTensorParallel(torch.autograd.Function):
    """f: identity forward, all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)  # a new tensor object, so autograd records this node

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()  # all_reduce writes in place and needs dense memory
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """g: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        total = x.contiguous().clone()  # x may be saved by the op that made it: never write it
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Megatron's f: enter a parallel region (its gradient is summed over `group`)."""
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Megatron's g: leave a parallel region (the ranks' partial results are summed)."""
    return _ReduceFromTensorParallel.apply(x, group)
