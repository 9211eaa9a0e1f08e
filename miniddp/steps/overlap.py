"""Rung 2, overlap: each gradient's all-reduce starts as soon as that gradient is ready.

The previous rung (naive_ddp.py) sent nothing until backward was over, though backward makes the
gradients one at a time, last layer first. Here a hook on every parameter fires the moment its
gradient has been accumulated into `.grad`: it scales the gradient by 1/W and launches an
asynchronous all-reduce (SUM) of it, and backward goes on computing earlier layers while that
gradient travels. The first hook of a backward also queues a callback on the autograd engine,
which runs when the whole backward is done and waits for every launched all-reduce. So `.grad`
is averaged by the time `loss.backward()` returns, as with torch's DDP.

Why launching in gradient-ready order is safe here, and only here: collectives are matched by
their order, the k-th all-reduce of one rank summed with the k-th of every other rank, and each
rank launches in the order its own backward produces gradients. That order is the same on every
rank only because every rank runs the same graph on the same kind of device. A parameter used on
one rank only, or a backward scheduled differently, would add one rank's weight to another
rank's bias: garbage, or a hang.

What it costs: still P messages, P * alpha + 2 (W-1)/W * N * beta, but most of it now hides
behind backward; exposed is what is still in flight when backward ends. What it lacks (the next
rung, buckets.py, adds it): P messages still pay P latencies, gloo works through them one after
another, and with many small tensors that queue outlasts backward.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from miniddp.observe.events import EventRecorder
from miniddp.steps import shared


class OverlapDDP(nn.Module, EventRecorder):
    """Average gradients with an async all-reduce per gradient, launched from its hook.

    Gradients are averaged when `loss.backward()` returns: `finish_gradient_synchronization()`
    has nothing left to do. `bucket_cap_mb` is accepted, so that every rung is built the same
    way, and ignored: there are no buckets yet.
    """

    claims = frozenset({"batchnorm", "mixed-dtypes"})

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float | None = None) -> None:
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.param_names, self.params = shared.trainable_parameters(module, "OverlapDDP")
        self.all_reduce_count = 0
        self._start_event_log()
        self._in_flight: list[tuple[int, dist.Work]] = []  # this backward's launches, in order
        # Every replica starts from rank 0's weights and buffers, whatever seed each rank used.
        shared.broadcast_from_rank0([*module.parameters(), *module.buffers()])
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(partial(self._on_gradient_ready, index))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._in_flight:
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
        """Nothing to do: the end of backward already waited for every all-reduce."""

    def _on_gradient_ready(self, index: int, param: torch.Tensor) -> None:
        """Runs inside the autograd engine right after `param.grad` was accumulated."""
        if not self._in_flight:  # the first gradient of this backward
            # `Variable._execution_engine` is autograd's engine, the C++ object that runs every
            # backward pass; `queue_callback(fn)` asks it to call `fn` once, when the backward
            # pass it is running now has finished, before `loss.backward()` returns. No public
            # torch API says "when this backward ends", so torch's own FSDP calls this private
            # one too. It is valid only inside a running backward (elsewhere it raises), as
            # here in a gradient hook. Every rung from here up uses it the same way.
            Variable._execution_engine.queue_callback(self._finish_backward)
        self._note("hook", self.param_names[index])
        param.grad.mul_(1.0 / self.world_size)
        name = f"grad {index}"
        self._note("launch", name)
        work = dist.all_reduce(param.grad, async_op=True)  # SUM, in place; returns at once
        self._note_when_done(work, name)
        self.all_reduce_count += 1
        self._in_flight.append((index, work))

    def _finish_backward(self) -> None:
        """Queued on the autograd engine: runs once, when the whole backward pass is done."""
        self._note("backward", "end")
        for index, work in self._in_flight:
            work.wait()
            self._note("wait", f"grad {index}")
        reduced = {index for index, _ in self._in_flight}
        self._in_flight = []
        if len(reduced) < len(self.params):
            raise shared.no_gradient(n for i, n in enumerate(self.param_names) if i not in reduced)
        self._note("sync", "end")
