"""Rung 3, buckets: gradients travel together in a few flat tensors, launched in a fixed order.

The previous rung (overlap.py) sent one message per gradient, so P tensors paid P latencies,
in whatever order each rank's backward produced them. Here gradients are packed into buckets of
about `bucket_cap_mb` MiB (2**20 bytes): a bucket is one flat tensor, each parameter owns a fixed
slice of it, and its hook copies the gradient there, scaled by 1/W. Once a bucket's last gradient
is in, the whole bucket goes out as one async all-reduce.

The layout is built once, at construction. Gradients tend to arrive in the reverse of the order
the parameters were registered in (last layer first), so parameters are walked in reverse. Each
(dtype, device) fills its own bucket, as a flat tensor has one dtype; a tensor is added, *then*
its bucket is closed if it holds at least the cap, so a bucket can overshoot by one tensor and a
tensor is never split.

Buckets launch strictly in index order: a full bucket waits until every earlier one has gone.
So every rank issues the same all-reduces in the same order, whatever order its own gradients
arrive in: no rank can pair its bucket 2 with another rank's bucket 1.

What it costs: about B = N / cap messages instead of P, so B * alpha + 2 (W-1)/W * N * beta,
mostly behind backward; exposed is about the last bucket. What it lacks (the next rung,
torch_layout.py, adds it): reverse registration order is a guess, and where it is wrong a bucket
waits for a gradient that comes late. And with 3 or more ranks gloo's sum depends on where each
gradient sits in its bucket: only torch's exact layout gives torch's exact bits.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from miniddp.layout import bucket_caps
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


def assign_buckets(params: list[torch.Tensor], order: list[int], cap: int) -> list[list[int]]:
    """Walk `order`; each (dtype, device) fills its own bucket until it holds `cap` bytes.
    Buckets come out in the order they were closed, then the partly filled ones."""
    closed, filling, filled_bytes = [], {}, {}
    for index in order:
        key = (params[index].dtype, params[index].device)
        filling.setdefault(key, []).append(index)
        filled_bytes[key] = filled_bytes.get(key, 0) + params[index].nbytes
        if filled_bytes[key] >= cap:
            closed.append(filling.pop(key))
            filled_bytes[key] = 0
    return closed + list(filling.values())


class BucketedDDP(nn.Module, EventRecorder):
    """Average gradients, by the time `loss.backward()` returns, in buckets of about
    `bucket_cap_mb` MiB (default 25), laid out once."""

    claims = frozenset({"batchnorm", "mixed-dtypes"})

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float | None = None) -> None:
        super().__init__()
        _, cap = bucket_caps(bucket_cap_mb)  # in bytes: 25 MiB, unless bucket_cap_mb says
        self.module = module
        self.world_size = dist.get_world_size()
        self.param_names, self.params = shared.trainable_parameters(module, "BucketedDDP")
        self.all_reduce_count = 0
        self._start_event_log()
        self._arrived: set[int] = set()  # parameters whose gradient this backward produced
        self._next_bucket = 0  # the next bucket to launch
        # Every replica starts from rank 0's weights and buffers, whatever seed each rank used.
        shared.broadcast_from_rank0([*module.parameters(), *module.buffers()])
        layout = assign_buckets(self.params, list(range(len(self.params)))[::-1], cap)
        self.buckets = [Bucket(n, ix, [self.params[i] for i in ix]) for n, ix in enumerate(layout)]
        # Where each parameter's gradient goes: its bucket and its view in it.
        self._slot = {i: (b, view) for b in self.buckets for i, view in zip(b.params, b.views)}
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(partial(self._on_gradient_ready, index))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._arrived:
            raise shared.unfinished_backward()
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

    def _on_gradient_ready(self, index: int, param: torch.Tensor) -> None:
        """Runs inside the autograd engine right after `param.grad` was accumulated."""
        if not self._arrived:  # the first gradient of this backward
            Variable._execution_engine.queue_callback(self._finish_backward)
        self._arrived.add(index)
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
            raise shared.no_gradient(self.param_names[i] for i in missing)
        self._note("sync", "end")
