"""Exercise 4 (chapter 03, rung 3): BucketedDDP, gradients packed into a few flat buckets.

Rung 2 sent one message per gradient: P tensors paid P latencies. Here gradients are copied,
scaled by 1/W, into flat buckets of about `bucket_cap_mb` MiB, and each full bucket goes out as
one async all-reduce, strictly in bucket order. The `Bucket` owns its steps (add, launch, wait,
write_back, reset). Fill in the TODOs, then check, with the claim
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

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from miniddp.data_parallel.layout import bucket_caps
from miniddp.steps import shared


class Bucket:
    """Given, but for `add`: one flat gradient buffer that runs its own life, once per
    backward pass:

        add(position)   a gradient is ready: copy it in, scaled by 1/W, into its slice
        is_full         every slice is filled: the bucket can travel
        launch(reduce)  start its all-reduce without waiting (`pending` holds the handle)
        wait()          block until the sum has arrived
        write_back()    copy each averaged slice into the `.grad` it came from
        reset()         forget this backward, ready for the next

    Each parameter owns a fixed slice of `flat` (`views[i]`, shaped like the parameter), so one
    all-reduce of `flat` averages every gradient in it at once.
    """

    def __init__(
        self,
        index: int,
        param_indices: Sequence[int],
        params: Sequence[torch.Tensor],
    ) -> None:
        self.index = index
        self.param_indices = list(param_indices)
        self.params = [params[i] for i in self.param_indices]
        total = sum(p.numel() for p in self.params)
        self.flat = torch.zeros(total, dtype=self.params[0].dtype, device=self.params[0].device)
        self.views = [
            piece.view_as(p)
            for piece, p in zip(self.flat.split([p.numel() for p in self.params]), self.params)
        ]
        self.reset()

    def reset(self) -> None:
        self.filled = 0
        # (position, the .grad it was copied from): where write_back() puts the average
        self.sources: list[tuple[int, torch.Tensor | None]] = []
        self.pending: dist.Work | None = None  # the in-flight all-reduce

    def add(self, position: int, divide_by: int) -> None:
        """Copy the gradient of parameter `position` into its slice, divided by `divide_by`
        (the world size).

        TODO 2. The gradient's place is its slice, `self.views[position]`, scaled as in exercise 3;
        copying and scaling are one pass over the memory if done together. `write_back()` needs
        to know where each average goes back to (`self.sources`), and `is_full` how many slices
        are filled. A parameter with no gradient (`.grad` is None) must still fill its slice:
        with what, so that the other ranks' sum is right?
        """
        raise NotImplementedError(
            "TODO exercise 4 (tutorials/exercises/buckets.py, chapter 03): copy the gradient "
            "into its bucket in Bucket.add"
        )

    @property
    def is_full(self) -> bool:
        return self.filled == len(self.params)

    def launch(self, reduce: Callable[[Bucket], dist.Work]) -> None:
        """Start summing `flat` across ranks; `reduce` returns at once with a handle."""
        self.pending = reduce(self)

    def wait(self) -> None:
        """Block until the sum is in `flat`."""
        self.pending.wait()
        self.pending = None

    def write_back(self) -> None:
        """Put each average into the `.grad` its gradient was copied from."""
        for position, grad in self.sources:
            grad.copy_(self.views[position])


def assign_buckets(
    params: Sequence[torch.Tensor], order: Sequence[int], cap: float
) -> list[list[int]]:
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
        layout = assign_buckets(self.params, list(range(len(self.params)))[::-1], cap)
        self.buckets = [Bucket(i, indices, self.params) for i, indices in enumerate(layout)]
        # Where each parameter's gradient goes: (its bucket, its position in it).
        self._slot = {
            index: (b, pos) for b in self.buckets for pos, index in enumerate(b.param_indices)
        }
        # Every replica starts from rank 0's weights and buffers, whatever seed each rank used.
        shared.broadcast_from_rank0([*module.parameters(), *module.buffers()])
        self._reset_backward()
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(partial(self._on_gradient_ready, index))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._reducing:
            raise shared.unfinished_backward()
        shared.broadcast_from_rank0(self.module.buffers())  # rank 0's BatchNorm statistics
        return self.module(*inputs, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Nothing to do: the end of backward already waited for every bucket."""

    def _start_reducing(self) -> None:
        """The first gradient of a backward: queue the wait for its end."""
        if self._reducing:
            return
        self._reducing = True
        Variable._execution_engine.queue_callback(self._finish_backward)

    def _on_gradient_ready(self, index: int, param: torch.Tensor) -> None:
        """Runs inside the autograd engine right after `param.grad` was accumulated."""
        self._start_reducing()
        self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        """Copy one gradient into its bucket; once the bucket is full, launch what can go."""
        self._marked_ready[index] = True
        bucket, position = self._slot[index]
        bucket.add(position, self.world_size)
        if bucket.is_full:
            self._launch_full_buckets()

    def _launch_full_buckets(self) -> None:
        """TODO 3. Launch the buckets that are full, without waiting for them (`bucket.launch`).
        Collectives pair up by their order on each rank, and buckets may fill in a different order
        on each rank: what order of launches makes every rank's k-th all-reduce the same bucket,
        whatever the order they filled in? (tutorials/mistakes/ready_order.py shows what goes
        wrong.)"""
        raise NotImplementedError(
            "TODO exercise 4 (tutorials/exercises/buckets.py, chapter 03): launch the full "
            "buckets in index order in BucketedDDP._launch_full_buckets"
        )

    def _all_reduce(self, bucket: Bucket) -> dist.Work:
        return dist.all_reduce(bucket.flat, async_op=True)

    def _finish_backward(self) -> None:
        """Queued on the autograd engine: runs once, when the whole backward pass is done.

        TODO 4. When this returns, every `.grad` holds its average, read back from its bucket,
        and nothing is left for the next backward to trip over (`_reset_backward`). Every rank
        must launch every bucket, even one holding a parameter that got no gradient on this rank
        (`self._marked_ready` says which); this rung then refuses such a parameter
        (`shared.no_gradient`).
        """
        raise NotImplementedError(
            "TODO exercise 4 (tutorials/exercises/buckets.py, chapter 03): wait for each "
            "bucket and write it back in BucketedDDP._finish_backward"
        )

    def _reset_backward(self) -> None:
        self._reducing = False  # and every bucket empty, no parameter marked ready
        self._marked_ready = [False] * len(self.params)
        self._next_bucket = 0
        for bucket in self.buckets:
            bucket.reset()
