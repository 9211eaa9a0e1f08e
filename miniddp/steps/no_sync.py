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
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from miniddp.layout import MiB, bucket_caps
from miniddp.observe.events import EventRecorder
from miniddp.steps import shared


class Bucket:
    """One flat tensor holding the gradients of `params` (indices into the wrapper's params)
    end to end; `views[i]` is params[i]'s slice of it, shaped like that parameter."""

    def __init__(self, index: int, params: list[int], tensors: list[torch.Tensor]) -> None:
        self.index, self.params = index, params
        self.flat = tensors[0].new_zeros(sum(t.numel() for t in tensors))  # same dtype, device
        pieces = self.flat.split([t.numel() for t in tensors])
        self.views = [piece.view_as(t) for piece, t in zip(pieces, tensors)]
        self.ready = 0  # gradients copied in during this backward
        self.work: dist.Work | None = None  # the all-reduce in flight


def assign_buckets(
    params: list[torch.Tensor], order: list[int], first_cap: float, cap: float
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
        if bucket_cap_mb is None:  # torch's default: a small first bucket, to start sending soon
            self.caps = (MiB, 25 * MiB)
        else:
            self.caps = bucket_caps(bucket_cap_mb)  # in bytes, the first bucket's and the rest's
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self.world_size = dist.get_world_size()
        self.param_names, self.params = shared.trainable_parameters(module, "NoSyncDDP")
        self.all_reduce_count = 0
        self._start_event_log()
        self._arrived: set[int] = set()  # parameters whose gradient this backward produced
        self._next_bucket = 0  # the next bucket to launch
        self._ready_order: list[int] = []  # the order gradients arrived in, until the rebuild
        self.has_rebuilt_buckets = False
        self._require_backward_grad_sync = True  # False inside no_sync()
        self._sync_this_backward = False  # what the latest forward decided
        self._refresh_buffers = True  # buffers come from rank 0 after a synced forward
        # Every replica starts from rank 0's weights and buffers, whatever seed each rank used.
        shared.broadcast_from_rank0([*module.parameters(), *module.buffers()])
        # Iteration 0: one bucket per (dtype, device); the one whose parameters start latest in
        # registration order launches first (torch still assumes backward runs in reverse).
        one_each = assign_buckets(self.params, range(len(self.params)), math.inf, math.inf)
        self._build_buckets(sorted(one_each, key=min, reverse=True))
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(partial(self._on_gradient_ready, index))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._arrived:
            raise shared.unfinished_backward()
        if self._ready_order and torch.is_grad_enabled():
            self._rebuild_buckets()
        # Each forward updates buffers (BatchNorm's statistics) locally: like torch's DDP, start
        # every forward that follows a synced one from rank 0's.
        if self.broadcast_buffers and self._refresh_buffers:
            shared.broadcast_from_rank0(self.module.buffers())
        self._note("forward", "start")
        output = self.module(*inputs, **kwargs)
        # Decided now, and read by every hook of the coming backward: that is why the forward
        # must run inside no_sync() for accumulation to skip communication.
        self._sync_this_backward = torch.is_grad_enabled() and self._require_backward_grad_sync
        self._refresh_buffers = self._sync_this_backward
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

    def _build_buckets(self, layout: list[list[int]]) -> None:
        self.buckets = [Bucket(n, ix, [self.params[i] for i in ix]) for n, ix in enumerate(layout)]
        # Where each parameter's gradient goes: its bucket and its view in it.
        self._slot = {i: (b, view) for b in self.buckets for i, view in zip(b.params, b.views)}

    def _rebuild_buckets(self) -> None:
        """Once, before the second synced forward: rank 0's order, torch's caps."""
        order = torch.tensor(self._ready_order, device=self.params[0].device)
        dist.broadcast(order, src=0)
        self._build_buckets(assign_buckets(self.params, order.tolist(), *self.caps))
        self._ready_order, self.has_rebuilt_buckets = [], True
        self._note("rebuild", f"{len(self.buckets)} buckets")

    def _on_gradient_ready(self, index: int, param: torch.Tensor) -> None:
        """Runs inside the autograd engine right after `param.grad` was accumulated."""
        if not self._sync_this_backward:
            return  # the forward ran inside no_sync(): .grad accumulates here, nothing travels
        if not self._arrived:  # the first gradient of this backward
            Variable._execution_engine.queue_callback(self._finish_backward)
        self._arrived.add(index)
        if not self.has_rebuilt_buckets:
            self._ready_order.append(index)
        self._note("hook", self.param_names[index])
        bucket, view = self._slot[index]
        torch.mul(param.grad, 1.0 / self.world_size, out=view)  # scale while copying: one pass
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._note("ready", f"bucket {bucket.index}")
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Launch each full bucket whose predecessors have all been launched, in index order."""
        while self._next_bucket < len(self.buckets):
            bucket = self.buckets[self._next_bucket]
            if bucket.ready < len(bucket.params):
                return
            name = f"bucket {bucket.index}"
            self._note("launch", name)
            bucket.work = dist.all_reduce(bucket.flat, async_op=True)  # SUM; returns at once
            self._note_when_done(bucket.work, name)
            self.all_reduce_count += 1
            self._next_bucket += 1

    def _finish_backward(self) -> None:
        """Queued on the autograd engine: wait for each bucket and copy it back into `.grad`."""
        self._note("backward", "end")
        missing = [i for i in range(len(self.params)) if i not in self._arrived]
        for index in missing:  # zeros, so every rank still launches every bucket; refused below
            self._slot[index][1].zero_()
            self._slot[index][0].ready += 1
        self._launch_ready_buckets()
        for bucket in self.buckets:
            bucket.work.wait()
            self._note("wait", f"bucket {bucket.index}")
            for index, view in zip(bucket.params, bucket.views):
                if index in self._arrived:
                    self.params[index].grad.copy_(view)
            bucket.ready, bucket.work = 0, None
        self._arrived, self._next_bucket = set(), 0
        if missing:
            self._ready_order = []  # incomplete: learn the order again in the next backward
            raise shared.no_gradient(self.param_names[i] for i in missing)
        self._note("sync", "end")
