"""The designs before buckets, each small enough to read at a glance (chapter 04 and the bench).

    NoCommunication     the compute floor: a step as if communication were free
    NaiveAllReduce      after backward, one blocking all-reduce per gradient (chapter 02's way)
    FlatAllReduce       after backward, all gradients in one flat all-reduce: one latency only
    PerParameterAsync   every gradient's all-reduce starts from its hook, while backward goes on
    DeferredMiniDDP     MiniDDP's buckets, but launched only once backward is over (an ablation)

Like MiniDDP and torch's DDP, each leaves `.grad` averaged when `loss.backward()` returns: the
work after backward runs in a callback queued on the autograd engine. Each notes MiniDDP's events
too (`record_events()`, `events`, `event_listeners`), so `miniddp.timeline` draws them all.
Averaging follows torch's recipe, `grad * (1/W)` then SUM, so on 2 ranks every design gives
bit-identical gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from miniddp.buckets import Bucket
from miniddp.ddp import MiniDDP
from miniddp.events import EventRecorder


class AfterBackward(nn.Module, EventRecorder):
    """A wrapper with a hook per parameter and a callback at the end of each backward.

    Subclasses say what happens to a gradient when it is ready (`on_gradient`) and once
    backward is over (`finish`).
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.all_reduce_count = 0
        self._start_event_log()
        self._backward_started = False
        with torch.no_grad():  # start equal, as every DDP does
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(self._make_hook(index))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._note("forward", "start")
        output = self.module(*inputs, **kwargs)
        if self._observed and torch.is_grad_enabled():
            self._note_when_backward_starts(output)
        self._note("forward", "end")
        return output

    def on_gradient(self, index: int, param: torch.Tensor) -> None:
        """Called from the autograd engine right after `param.grad` was accumulated."""

    def finish(self) -> None:
        """Called once backward is over; must leave every `.grad` averaged."""

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_gradient_accumulated(param: torch.Tensor) -> None:
            if not self._backward_started:
                self._backward_started = True
                Variable._execution_engine.queue_callback(self._end_of_backward)
            self._note("hook", self.param_names[index])
            self.on_gradient(index, param)

        return on_gradient_accumulated

    def _end_of_backward(self) -> None:
        self._note("backward", "end")
        self._backward_started = False
        self.finish()
        self._note("sync", "end")

    def _blocking_all_reduce(self, tensor: torch.Tensor, name: str) -> None:
        self._note("launch", name)
        dist.all_reduce(tensor)
        self.all_reduce_count += 1
        self._note("reduced", name)
        self._note("wait", name)


class NoCommunication(AfterBackward):
    """Local gradients only: the floor under every design's step time (not training DDP!)."""


class NaiveAllReduce(AfterBackward):
    """One blocking all-reduce per gradient, after backward: each pays a full round trip, and
    nothing is sent while backward computes."""

    def finish(self) -> None:
        for index, param in enumerate(self.params):
            param.grad.mul_(1.0 / self.world_size)
            self._blocking_all_reduce(param.grad, f"grad {index}")


class FlatAllReduce(AfterBackward):
    """All gradients copied into one flat buffer and reduced at once, after backward: one round
    trip instead of one per gradient, but still nothing sent while backward computes."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.bucket = Bucket(0, range(len(self.params)), self.params)

    def finish(self) -> None:
        for param, view in zip(self.params, self.bucket.views):
            torch.mul(param.grad, 1.0 / self.world_size, out=view)
        self._blocking_all_reduce(self.bucket.flat, "bucket 0")
        for param, view in zip(self.params, self.bucket.views):
            param.grad.copy_(view)


class PerParameterAsync(AfterBackward):
    """Each gradient's all-reduce is launched, without waiting, as soon as its hook runs; the
    end of backward waits for them all. Overlap, but one round trip per gradient.

    Launches follow the order in which gradients arrive: the same on every rank only because
    every rank runs the same graph on the same kind of device. MiniDDP does not rely on that.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self._in_flight: list[tuple[str, torch.futures.Future]] = []

    def on_gradient(self, index: int, param: torch.Tensor) -> None:
        name = f"grad {index}"
        param.grad.mul_(1.0 / self.world_size)
        self._note("launch", name)
        future = dist.all_reduce(param.grad, async_op=True).get_future()
        self.all_reduce_count += 1
        if self._observed:
            future.add_done_callback(lambda _, n=name: self._note("reduced", n))
        self._in_flight.append((name, future))

    def finish(self) -> None:
        for name, future in self._in_flight:
            future.wait()
            self._note("wait", name)
        self._in_flight.clear()


class DeferredMiniDDP(MiniDDP):
    """MiniDDP with every bucket's launch held back until backward is over: the same buckets
    and the same all-reduces, minus the overlap. Only the timing differs from MiniDDP."""

    launch_during_backward = False


BASELINES: dict[str, type[AfterBackward]] = {
    "none": NoCommunication,
    "naive": NaiveAllReduce,
    "flat": FlatAllReduce,
    "async": PerParameterAsync,
}
