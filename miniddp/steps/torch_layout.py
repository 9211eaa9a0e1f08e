"""Rung 4, torch's layout: one bucket at first, then buckets in the order gradients really came.

The previous rung (buckets.py) guessed that gradients arrive in reverse registration order.
Here, as in torch's DDP, nothing is guessed. Iteration 0 puts all parameters of a (dtype, device)
in one bucket, in registration order (no overlap yet), and notes the order in which gradients
really became ready. Before the next forward the buckets are rebuilt once from rank 0's order
(all ranks must launch the same buckets), the earliest gradients first, in a small first bucket
(1 MiB, then 25 MiB; an explicit bucket_cap_mb caps every bucket, the first included) so that
communication starts as early as backward allows. torch's reason for not guessing: with unused
parameters on some ranks, or other collectives issued during backward, buckets launched in a
guessed order could be matched with the wrong collective on another rank.

Why the exact layout matters: with 3 or more ranks gloo sums a bucket in pieces, and which
ranks' values are added first depends on each gradient's offset in the flat tensor: the same
gradients in another layout give other last bits. With torch's order, offsets and 1/W scaling
while copying, this rung is bitwise torch's DDP at any world size.

The layout now has a life of its own, so it gets an object, as in MiniDDP: `BucketLayout`
is built at construction (`initial_layout`), records the ready order in the first backward, and
rebuilds once (`assign_buckets`, now with torch's two caps).

The rest is rung 3's: a bucket (`Bucket`) is one flat tensor, each gradient is copied into its
slice scaled by 1/W, and a full bucket goes out as one async all-reduce, strictly in index order,
so every rank issues the same collectives. A bucket closes once it holds at least its cap (add
the tensor, then close), so it can overshoot by one tensor; a tensor is never split.

What it costs: as rung 3, B * alpha + 2 (W-1)/W * N * beta, plus one broadcast of P integers,
once. What it lacks (the next rung, no_sync.py, adds it): gradient accumulation without
communication; each backward all-reduces, even when k micro-steps only need their sum averaged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from miniddp.data_parallel.layout import bucket_caps
from miniddp.observe.events import EventRecorder
from miniddp.steps import shared


class Bucket:
    """One flat gradient buffer that runs its own life, once per backward pass:

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

        torch multiplies by the float 1/W while copying, one pass over the gradient; `g / W`
        or dividing after the sum would differ in the last bit when W is not a power of two.
        A parameter with no gradient contributes zeros (the end of backward then refuses).
        """
        param, view = self.params[position], self.views[position]
        grad = param.grad
        if grad is None:
            view.zero_()
        else:
            torch.mul(grad, 1.0 / divide_by, out=view)
            self.sources.append((position, grad))
        self.filled += 1

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
    params: Sequence[torch.Tensor], order: Sequence[int], first_cap: float, cap: float
) -> list[list[int]]:
    """Walk `order`; each (dtype, device) fills its own buckets, its first until it holds
    `first_cap` bytes, the others `cap`. Buckets come out in the order they were closed, then the
    partly filled ones (torch takes those from a hash map: their order changes no value)."""
    closed, filling, filled_bytes, has_closed = [], {}, {}, set()
    for index in order:
        key = (params[index].dtype, params[index].device)
        filling.setdefault(key, []).append(index)
        filled_bytes[key] = filled_bytes.get(key, 0) + params[index].nbytes
        if filled_bytes[key] >= (cap if key in has_closed else first_cap):
            closed.append(filling.pop(key))
            filled_bytes[key] = 0
            has_closed.add(key)
    return closed + list(filling.values())


def initial_layout(params: Sequence[torch.Tensor]) -> list[list[int]]:
    """The buckets before any backward has been seen, in launch order: one per (dtype, device).
    The bucket whose parameters start latest in registration order launches first: torch still
    assumes backward runs in reverse."""
    initial = assign_buckets(params, range(len(params)), math.inf, math.inf)
    return sorted(initial, key=min, reverse=True)


class BucketLayout:
    """The buckets of one DDP model, and their life: built at construction (one per dtype),
    the gradient-ready order recorded in the first synced backward, rebuilt once from rank 0's
    record before the next forward."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        bucket_cap_mb: float | None,
    ) -> None:
        self.params = params
        self.first_cap, self.cap = bucket_caps(bucket_cap_mb)
        self.has_rebuilt = False
        self.ready_order: list[int] = []  # gradient arrival order in the first synced backward
        self.build(initial_layout(params))

    def build(self, groups: list[list[int]]) -> None:
        self.buckets = [Bucket(i, indices, self.params) for i, indices in enumerate(groups)]
        # Where each parameter's gradient goes: (its bucket, its position in it).
        self.slot = {
            index: (b, pos) for b in self.buckets for pos, index in enumerate(b.param_indices)
        }

    def record_ready(self, index: int) -> None:
        if not self.has_rebuilt:
            self.ready_order.append(index)

    @property
    def rebuild_due(self) -> bool:
        return bool(self.ready_order) and not self.has_rebuilt

    def rebuild(self, ready_order: list[int]) -> None:
        """Rebuild from an observed order (rank 0's, so every rank gets the same buckets)."""
        self.build(assign_buckets(self.params, ready_order, self.first_cap, self.cap))
        self.has_rebuilt = True
        self.ready_order = []


class TorchLayoutDDP(nn.Module, EventRecorder):
    """Average gradients, by the time `loss.backward()` returns, in torch's DDP's buckets."""

    claims = frozenset({"batchnorm", "mixed-dtypes", "torch-layout"})

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float | None = None) -> None:
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.param_names, self.params = shared.trainable_parameters(module, "TorchLayoutDDP")
        self._layout = BucketLayout(self.params, bucket_cap_mb)
        # Every replica starts from rank 0's weights and buffers, whatever seed each rank used.
        shared.broadcast_from_rank0([*module.parameters(), *module.buffers()])
        self.all_reduce_count = 0
        self._start_event_log()
        self._reset_backward()
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(partial(self._on_gradient_ready, index))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._reducing:
            raise shared.unfinished_backward()
        if self._layout.rebuild_due and torch.is_grad_enabled():
            self._rebuild_buckets()
        # Each forward updates buffers (BatchNorm's statistics) locally: like torch's DDP, start
        # every forward from rank 0's.
        shared.broadcast_from_rank0(self.module.buffers())
        self._note("forward", "start")
        output = self.module(*inputs, **kwargs)
        if self._observed and torch.is_grad_enabled():
            self._note_when_backward_starts(output)
        self._note("forward", "end")
        return output

    def finish_gradient_synchronization(self) -> None:
        """Nothing to do: the end of backward already waited for every bucket."""

    def _rebuild_buckets(self) -> None:
        """Once, before the second synced forward: rank 0's order, torch's caps."""
        order = torch.tensor(self._layout.ready_order, device=self.params[0].device)
        dist.broadcast(order, src=0)
        self._layout.rebuild(order.tolist())
        self._note("rebuild", f"{len(self._layout.buckets)} buckets")

    def _start_reducing(self) -> None:
        """The first gradient of a backward: queue the wait for its end."""
        if self._reducing:
            return
        self._reducing = True
        Variable._execution_engine.queue_callback(self._finish_backward)

    def _on_gradient_ready(self, index: int, param: torch.Tensor) -> None:
        """Runs inside the autograd engine right after `param.grad` was accumulated."""
        self._start_reducing()
        self._layout.record_ready(index)
        self._note("hook", self.param_names[index])
        self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        """Copy one gradient into its bucket; once the bucket is full, launch what can go."""
        self._marked_ready[index] = True
        bucket, position = self._layout.slot[index]
        bucket.add(position, self.world_size)
        if bucket.is_full:
            self._note("ready", f"bucket {bucket.index}")
            self._launch_full_buckets()

    def _launch_full_buckets(self) -> None:
        """Launch buckets strictly in index order, so every rank issues the same collectives in
        the same sequence even if its gradients arrive in a different order."""
        buckets = self._layout.buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].is_full:
            bucket = buckets[self._next_bucket]
            self._note("launch", f"bucket {bucket.index}")
            bucket.launch(self._all_reduce)
            self.all_reduce_count += 1
            self._note_when_done(bucket.pending, f"bucket {bucket.index}")
            self._next_bucket += 1

    def _all_reduce(self, bucket: Bucket) -> dist.Work:
        return dist.all_reduce(bucket.flat, async_op=True)

    def _finish_backward(self) -> None:
        """Queued on the autograd engine: runs once, when the whole backward pass is done."""
        self._note("backward", "end")
        missing = [i for i, ready in enumerate(self._marked_ready) if not ready]
        for index in missing:  # zeros, so every rank still launches every bucket; refused below
            self._mark_ready(index)
        for bucket in self._layout.buckets:
            # Each bucket goes back to `.grad` as soon as it arrives, while later ones travel.
            bucket.wait()
            self._note("wait", f"bucket {bucket.index}")
            bucket.write_back()
        self._reset_backward()
        if missing:
            self._layout.ready_order.clear()  # incomplete: learn it again in the next backward
            raise shared.no_gradient(self.param_names[i] for i in missing)
        self._note("sync", "end")

    def _reset_backward(self) -> None:
        self._reducing = False  # and every bucket empty, no parameter marked ready
        self._marked_ready = [False] * len(self.params)
        self._next_bucket = 0
        for bucket in self._layout.buckets:
            bucket.reset()

    @property
    def buckets(self) -> list[Bucket]:
        """The current buckets, in launch order."""
        return self._layout.buckets

    @property
    def has_rebuilt_buckets(self) -> bool:
        return self._layout.has_rebuilt
