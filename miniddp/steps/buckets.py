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

Here the ladder takes MiniDDP's shape, so that each rung above, and MiniDDP, adds its idea to
this code: a `Bucket` runs its own life (add, is_full, launch, wait, write_back, reset), and the
wrapper's steps carry MiniDDP's names.
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
    params: Sequence[torch.Tensor], order: Sequence[int], cap: float
) -> list[list[int]]:
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
        layout = assign_buckets(self.params, list(range(len(self.params)))[::-1], cap)
        self.buckets = [Bucket(i, indices, self.params) for i, indices in enumerate(layout)]
        # Where each parameter's gradient goes: (its bucket, its position in it).
        self._slot = {
            index: (b, pos) for b in self.buckets for pos, index in enumerate(b.param_indices)
        }
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

    def _start_reducing(self) -> None:
        """The first gradient of a backward: queue the wait for its end."""
        if self._reducing:
            return
        self._reducing = True
        Variable._execution_engine.queue_callback(self._finish_backward)

    def _on_gradient_ready(self, index: int, param: torch.Tensor) -> None:
        """Runs inside the autograd engine right after `param.grad` was accumulated."""
        self._start_reducing()
        self._note("hook", self.param_names[index])
        self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        """Copy one gradient into its bucket; once the bucket is full, launch what can go."""
        self._marked_ready[index] = True
        bucket, position = self._slot[index]
        bucket.add(position, self.world_size)
        if bucket.is_full:
            self._note("ready", f"bucket {bucket.index}")
            self._launch_full_buckets()

    def _launch_full_buckets(self) -> None:
        """Launch buckets strictly in index order, so every rank issues the same collectives in
        the same sequence even if its gradients arrive in a different order."""
        buckets = self.buckets
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
        for bucket in self.buckets:
            # Each bucket goes back to `.grad` as soon as it arrives, while later ones travel.
            bucket.wait()
            self._note("wait", f"bucket {bucket.index}")
            bucket.write_back()
        self._reset_backward()
        if missing:
            raise shared.no_gradient(self.param_names[i] for i in missing)
        self._note("sync", "end")

    def _reset_backward(self) -> None:
        self._reducing = False  # and every bucket empty, no parameter marked ready
        self._marked_ready = [False] * len(self.params)
        self._next_bucket = 0
        for bucket in self.buckets:
            bucket.reset()
