"""Exercise 3 (chapter 03b): BucketedDDP, gradients packed into a few flat buckets.

Rung 2 sent one message per gradient: P tensors paid P latencies. Here gradients are copied,
scaled by 1/W, into flat buckets of about `bucket_cap_mb` MiB, and each full bucket goes out as
one async all-reduce, strictly in bucket order. Fill in the TODOs, then check:

    python -m pytest tests/test_ddp_equivalence.py --ddp tutorials/exercises/buckets.py:BucketedDDP

The checks see gradients, not buckets: a layout of one parameter per bucket passes them too. So
also look at `len(ddp.buckets)` and `[b.params for b in ddp.buckets]`, as chapter 03b prints them.
Stuck? Chapter 03b (tutorials/03b_bucketing.py) explains the idea; the answer is rung 3,
miniddp/steps/buckets.py (`python -m miniddp.steps diff 2 3`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from miniddp.layout import bucket_caps
from miniddp.steps import shared


class Bucket:
    """Given: one flat tensor holding the gradients of `params` (indices into the wrapper's
    params) end to end; `views[i]` is params[i]'s slice of it, shaped like that parameter."""

    def __init__(self, index: int, params: list[int], tensors: list[torch.Tensor]) -> None:
        self.index, self.params = index, params
        self.flat = tensors[0].new_zeros(sum(t.numel() for t in tensors))  # same dtype, device
        pieces = self.flat.split([t.numel() for t in tensors])
        self.views = [piece.view_as(t) for piece, t in zip(pieces, tensors)]
        self.ready = 0  # gradients copied in during this backward
        self.work: dist.Work | None = None  # the all-reduce in flight


def assign_buckets(params: list[torch.Tensor], order: list[int], cap: int) -> list[list[int]]:
    """Group parameter indices into buckets, walking `order`.

    TODO 1. As shipped, every parameter gets a bucket of its own: correct, and rung 2 in
    disguise. Instead, each (dtype, device) fills its own bucket (a flat tensor has one dtype):
    add the parameter, *then* close the bucket if it holds at least `cap` bytes (`p.nbytes`).
    Return the closed buckets in the order they closed, then the partly filled ones.
    """
    return [[index] for index in order]


class BucketedDDP(nn.Module):
    """Average gradients, by the time `loss.backward()` returns, in buckets of about
    `bucket_cap_mb` MiB (default 25), laid out once."""

    claims = frozenset({"batchnorm", "mixed-dtypes"})

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float | None = None) -> None:
        super().__init__()
        _, cap = bucket_caps(bucket_cap_mb)  # in bytes: 25 MiB, unless bucket_cap_mb says
        self.module = module
        self.world_size = dist.get_world_size()
        self.param_names, self.params = shared.trainable_parameters(module, "BucketedDDP")
        self._arrived: set[int] = set()  # parameters whose gradient this backward produced
        self._next_bucket = 0  # the next bucket to launch
        shared.broadcast_from_rank0([*module.parameters(), *module.buffers()])
        # Gradients tend to arrive last layer first: walk the parameters in reverse.
        layout = assign_buckets(self.params, list(range(len(self.params)))[::-1], cap)
        self.buckets = [Bucket(n, ix, [self.params[i] for i in ix]) for n, ix in enumerate(layout)]
        # Where each parameter's gradient goes: its bucket and its view in it.
        self._slot = {i: (b, view) for b in self.buckets for i, view in zip(b.params, b.views)}
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(partial(self._on_gradient_ready, index))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        shared.broadcast_from_rank0(self.module.buffers())  # rank 0's BatchNorm statistics
        return self.module(*inputs, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Nothing to do: the end of backward already waited for every bucket."""

    def _on_gradient_ready(self, index: int, param: torch.Tensor) -> None:
        """Runs inside the autograd engine right after `param.grad` was accumulated.

        TODO 2. On the first gradient of a backward, queue `self._finish_backward`
        (`torch.autograd.Variable._execution_engine.queue_callback`). Note the arrival in
        `self._arrived`. Copy the gradient, scaled by 1.0 / W, into its view
        (`self._slot[index]`; one pass: `torch.mul(..., out=view)`), count it in
        `bucket.ready`, and once the bucket is full, call `self._launch_ready_buckets()`.
        """
        raise NotImplementedError(
            "TODO exercise 3 (tutorials/exercises/buckets.py, chapter 03b): copy the gradient "
            "into its bucket in BucketedDDP._on_gradient_ready"
        )

    def _launch_ready_buckets(self) -> None:
        """TODO 3. Launch full buckets strictly in index order, from `self._next_bucket` on:
        stop at the first bucket that is not full, even if a later one is. Collectives pair up
        by their order on each rank; launching in the order buckets happen to fill could pair
        one rank's bucket 2 with another's bucket 1 (tutorials/mistakes/ready_order.py)."""
        raise NotImplementedError(
            "TODO exercise 3 (tutorials/exercises/buckets.py, chapter 03b): launch the full "
            "buckets in index order in BucketedDDP._launch_ready_buckets"
        )

    def _finish_backward(self) -> None:
        """Queued on the autograd engine: runs once, when the whole backward pass is done.

        TODO 4. Parameters that got no gradient still need zeros in their views, so that every
        rank launches every bucket (then refuse them: `shared.no_gradient`). Launch what is left,
        then for each bucket in order: wait, copy each view back into its `param.grad`, and reset
        the bucket (`ready`, `work`) and `self._arrived`, `self._next_bucket` for the next
        backward.
        """
        raise NotImplementedError(
            "TODO exercise 3 (tutorials/exercises/buckets.py, chapter 03b): wait for each "
            "bucket and write it back in BucketedDDP._finish_backward"
        )
