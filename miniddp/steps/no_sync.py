"""Rung 5, no_sync: each forward decides whether its backward synchronizes.

The previous rung (torch_layout.py) all-reduced after every backward. Gradient accumulation
(chapter 00) sums the gradients of k micro-batches in `.grad` before one optimizer step, and only
that sum needs averaging over the ranks: averaging each micro-step's gradient, then summing the
averages, gives the same number (up to rounding) for k times the communication. `no_sync()`
skips the first k-1:

    for j, (x, y) in enumerate(micro_batches):
        with ddp.no_sync() if j < k - 1 else nullcontext():
            loss_fn(ddp(x), y).div(k).backward()    # forward AND backward inside

A forward run inside `no_sync()` leaves its backward's hooks idle, so each rank's `.grad` just
accumulates; the first forward outside it arms the hooks, and its backward copies the whole
accumulated `.grad` into the buckets, as rung 4's did with one micro-step's.

Why the forward decides, not the backward: torch's DDP prepares its reducer for the coming
backward at the end of each forward (with unused parameters, the next rung, that preparation
walks the graph the forward just built), and this rung decides where torch does, to behave as
torch's. The decision is read by every hook of the backward that follows: a forward outside
`no_sync()` with only `backward()` inside still synchronizes (chapter 05's pitfall), and the
reverse skips.

Buffers follow the same decision, as in torch: they are refreshed from rank 0 only before a
forward that follows a synced one (an accumulating rank keeps its own BatchNorm statistics until
the step syncs), and never with `broadcast_buffers=False`.

The forward's decision is a state every hook reads, so it gets names: `Phase` LOCAL (inside
no_sync, or before any synced forward), ARMED by a synced forward, REDUCING once its backward's
first gradient arrives (rung 4 needed only a flag: reducing or not).

The rest is rung 4's: torch's bucket layout (one bucket per dtype at first, rebuilt once from
rank 0's gradient-ready order), each gradient copied into its slice scaled by 1/W, full buckets
launched strictly in index order: bitwise torch's DDP at any world size, no_sync included.

What it costs: with k micro-steps per optimizer step, rung 4's communication once per step
instead of k times. What it lacks (the next rung, unused.py, adds it): a parameter that gets
no gradient in some backward (a branch some steps or some ranks skip) stops training with an
error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from enum import Enum
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


class Phase(Enum):
    """Where the current forward/backward pair stands: what a gradient hook must do."""

    LOCAL = "gradients only accumulate locally (inside no_sync, or no synced forward yet)"
    ARMED = "a synced forward ran: its backward will reduce"
    REDUCING = "backward is filling and launching buckets"


class NoSyncDDP(nn.Module, EventRecorder):
    """Average gradients in torch's DDP's buckets by the time `loss.backward()` returns, unless
    the forward ran inside `no_sync()`: then they accumulate locally."""

    claims = frozenset({"batchnorm", "mixed-dtypes", "torch-layout", "no-sync"})

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_cap_mb: float | None = None,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.broadcast_buffers = broadcast_buffers
        self.param_names, self.params = shared.trainable_parameters(module, "NoSyncDDP")
        self._layout = BucketLayout(self.params, bucket_cap_mb)
        # Every replica starts from rank 0's weights and buffers, whatever seed each rank used.
        shared.broadcast_from_rank0([*module.parameters(), *module.buffers()])
        self.all_reduce_count = 0
        self._start_event_log()
        self._require_backward_grad_sync = True  # False inside no_sync()
        self._require_forward_param_sync = True  # buffers are refreshed after a synced forward
        self._reset_backward(Phase.LOCAL)
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(partial(self._on_gradient_ready, index))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._phase is Phase.REDUCING:
            raise shared.unfinished_backward()
        if self._layout.rebuild_due and torch.is_grad_enabled():
            self._rebuild_buckets()
        # Each forward updates buffers (BatchNorm's statistics) locally: like torch's DDP, start
        # every forward that follows a synced one from rank 0's.
        if self.broadcast_buffers and self._require_forward_param_sync:
            shared.broadcast_from_rank0(self.module.buffers())
        self._note("forward", "start")
        output = self.module(*inputs, **kwargs)
        # Whether this forward's backward synchronizes is decided now, at forward time: that is
        # why the forward must run inside `no_sync()` for accumulation to skip communication.
        synced = torch.is_grad_enabled() and self._require_backward_grad_sync
        self._require_forward_param_sync = synced
        self._phase = Phase.ARMED if synced else Phase.LOCAL
        if self._observed and torch.is_grad_enabled():
            self._note_when_backward_starts(output)
        self._note("forward", "end")
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: forwards run inside this block skip the all-reduce;
        the first forward+backward outside it then reduces the whole accumulated `.grad`."""
        previous = self._require_backward_grad_sync
        self._require_backward_grad_sync = False
        try:
            yield
        finally:
            self._require_backward_grad_sync = previous

    def finish_gradient_synchronization(self) -> None:
        """Nothing to do: the end of backward already waited for every bucket."""

    def _rebuild_buckets(self) -> None:
        """Once, before the second synced forward: rank 0's order, torch's caps."""
        order = torch.tensor(self._layout.ready_order, device=self.params[0].device)
        dist.broadcast(order, src=0)
        self._layout.rebuild(order.tolist())
        self._note("rebuild", f"{len(self._layout.buckets)} buckets")

    def _start_reducing(self) -> None:
        """The first sign of a synced backward: queue the wait for its end."""
        if self._phase is not Phase.ARMED:
            return
        self._phase = Phase.REDUCING
        Variable._execution_engine.queue_callback(self._finish_backward)

    def _on_gradient_ready(self, index: int, param: torch.Tensor) -> None:
        """Runs inside the autograd engine right after `param.grad` was accumulated."""
        self._start_reducing()  # the first gradient of a synced backward starts it
        if self._phase is Phase.LOCAL:
            return
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
        self._reset_backward(Phase.LOCAL)
        if missing:
            self._layout.ready_order.clear()  # incomplete: learn it again in the next backward
            raise shared.no_gradient(self.param_names[i] for i in missing)
        self._note("sync", "end")

    def _reset_backward(self, phase: Phase) -> None:
        self._phase = phase  # and every bucket empty, no parameter marked ready
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
