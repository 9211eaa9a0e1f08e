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

The rest is rung 3's: a bucket is one flat tensor, each gradient is copied into its slice scaled
by 1/W, and a full bucket goes out as one async all-reduce, strictly in index order, so every
rank issues the same collectives. A bucket closes once it holds at least its cap (add the
tensor, then close), so it can overshoot by one tensor; a tensor is never split.

What it costs: as rung 3, B * alpha + 2 (W-1)/W * N * beta, plus one broadcast of P integers,
once. What it lacks (the next rung, no_sync.py, adds it): gradient accumulation without
communication; each backward all-reduces, even when k micro-steps only need their sum averaged.
"""

from __future__ import annotations

import math
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


class TorchLayoutDDP(nn.Module, EventRecorder):
    """Average gradients, by the time `loss.backward()` returns, in torch's DDP's buckets."""

    claims = frozenset({"batchnorm", "mixed-dtypes", "torch-layout"})

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float | None = None) -> None:
        super().__init__()
        if bucket_cap_mb is None:  # torch's default: a small first bucket, to start sending soon
            self.caps = (MiB, 25 * MiB)
        else:
            self.caps = bucket_caps(bucket_cap_mb)  # in bytes, the first bucket's and the rest's
        self.module = module
        self.world_size = dist.get_world_size()
        self.param_names, self.params = shared.trainable_parameters(module, "TorchLayoutDDP")
        self.all_reduce_count = 0
        self._start_event_log()
        self._arrived: set[int] = set()  # parameters whose gradient this backward produced
        self._next_bucket = 0  # the next bucket to launch
        self._ready_order: list[int] = []  # the order gradients arrived in, until the rebuild
        self.has_rebuilt_buckets = False
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
