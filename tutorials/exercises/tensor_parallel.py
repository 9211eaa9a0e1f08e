"""Exercise 10 (chapter 13): Megatron's f and g, the only two places tensor parallelism talks.

Fill in the three TODOs, then check them with the same tests miniddp.tensor_parallel passes
(outputs, gradient shards and parameters against one process and torch's own tensor
parallelism, the all-reduces a block issues, DP x TP):

    MINIDDP_TP_FG=tutorials/exercises/tensor_parallel.py \
        python -m pytest tests/test_tensor_parallel.py -x

With MINIDDP_TP_FG set, the tests' ranks build every colwise and rowwise layer with your two
functions in place of the library's (tests/tensor_parallel_tasks.py, `learners_f_and_g`).

The idea, for a block split over W ranks: its input X is the same on every rank; rank r
computes with its slices of the weights, and the block's output is the sum of the ranks' parts.

    f  enters the split region. forward: X is already on every rank.  backward: each rank's
       slices used X, so each holds one part of dL/dX, and dL/dX is their sum.
    g  leaves it. forward: the output is the sum of the ranks' partial outputs.
       backward: a sum passes its gradient unchanged to every term.

Stuck? Chapter 13 (tutorials/13_model_parallel.py), section 2; the answer is
miniddp/tensor_parallel/layers.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class CopyToTensorParallel(torch.autograd.Function):
    """f: identity forward, all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        # Given: autograd needs a new tensor object to record this node, not `x` itself.
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # TODO 1: return the sum of `grad` over the ranks of ctx.group, and None for the group
        # (hint: dist.all_reduce works in place on dense memory: grad.contiguous() first).
        raise NotImplementedError("TODO exercise 10 (f's backward): sum the gradient over ranks")


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        # TODO 2: return the sum of x over the ranks of `group`, without writing into x (the op
        # that made x may need it for its own backward: all-reduce a copy).
        raise NotImplementedError("TODO exercise 10 (g's forward): sum the partial outputs")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # TODO 3: what does a sum pass back to each of its terms?
        raise NotImplementedError("TODO exercise 10 (g's backward): the gradient of a sum")


def copy_to_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return ReduceFromTensorParallel.apply(x, group)
