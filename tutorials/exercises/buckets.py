"""Exercise 3 (chapter 03): BucketedDDP, gradients packed into a few flat buckets.

Rung 2 sent one message per gradient: P tensors paid P latencies. Here gradients are copied,
scaled by 1/W, into flat buckets of about `bucket_cap_mb` MiB, and each full bucket goes out as
one async all-reduce, strictly in bucket order. Fill in the TODOs, then check, with the claim
that checks the idea itself:

    python -m pytest tests/test_ddp_equivalence.py -x \
        --ddp tutorials/exercises/buckets.py:BucketedDDP --ddp-claims buckets

The gradient checks alone cannot see buckets: one all-reduce per gradient gets the same numbers.
`--ddp-claims buckets` counts your all-reduces per step against the buckets rung 3's rule gives
for the cap, and checks that each one carries exactly its bucket's gradients.
Stuck? Chapter 03 (tutorials/03_bucketing.py) explains the idea. Only once your own attempt
passes, compare it with rung 3, miniddp/steps/buckets.py.
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
    disguise. What must hold: a bucket is one flat tensor, so it holds one dtype on one
    device; a bucket closes once it holds at least `cap` bytes, the tensor that crosses the cap
    included (a tensor is never split); and every rank must compute the same layout, so it may
    depend only on what every rank knows. Chapter 03 states the rule and the order the buckets
    come out in; `--ddp-claims buckets` compares your layout's all-reduces with it.
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

        TODO 2. As in exercise 2, something must run when this backward is over. The gradient's
        place is now its slice of a bucket (`self._slot[index]`), scaled as before; a bucket can
        leave only once all of its gradients are in, so it must know how many are. Copying and
        scaling are one pass over the memory if done together.
        """
        raise NotImplementedError(
            "TODO exercise 3 (tutorials/exercises/buckets.py, chapter 03): copy the gradient "
            "into its bucket in BucketedDDP._on_gradient_ready"
        )

    def _launch_ready_buckets(self) -> None:
        """TODO 3. Launch the buckets that are full, without waiting for them. Collectives pair
        up by their order on each rank, and buckets may fill in a different order on each rank:
        what order of launches makes every rank's k-th all-reduce the same bucket, whatever the
        order they filled in? (tutorials/mistakes/ready_order.py shows what goes wrong.)"""
        raise NotImplementedError(
            "TODO exercise 3 (tutorials/exercises/buckets.py, chapter 03): launch the full "
            "buckets in index order in BucketedDDP._launch_ready_buckets"
        )

    def _finish_backward(self) -> None:
        """Queued on the autograd engine: runs once, when the whole backward pass is done.

        TODO 4. When this returns, every `.grad` holds its average, read back from its bucket,
        and nothing is left for the next backward to trip over. Every rank must launch every
        bucket, even one holding a parameter that got no gradient on this rank (what should its
        slice hold, so that the others' sum is right?); this rung then refuses such a parameter
        (`shared.no_gradient`).
        """
        raise NotImplementedError(
            "TODO exercise 3 (tutorials/exercises/buckets.py, chapter 03): wait for each "
            "bucket and write it back in BucketedDDP._finish_backward"
        )
