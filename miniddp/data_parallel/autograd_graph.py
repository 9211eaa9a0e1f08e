"""What MiniDDP asks of the autograd graph: a hook on each parameter's accumulated gradient,
which parameters a backward will not reach, when a backward starts, and which parameters got a
gradient on any rank (find_unused_parameters).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# The hooks a module carries for the DDP that wraps it now, so that a second wrapper can take over.
_HOOKS_OF: weakref.WeakKeyDictionary[nn.Module, list] = weakref.WeakKeyDictionary()


def hook_every_parameter(
    module: nn.Module,
    params: Sequence[torch.Tensor],
    on_gradient_ready: Callable[[int, torch.Tensor], None],
) -> list:
    """Call `on_gradient_ready(index, param)` right after each parameter's gradient has been
    accumulated into `.grad`. A module wrapped again (a fresh DDP after training) hands its
    hooks over, as torch's DDP does: the previous wrapper's are removed, and its list emptied."""
    previous = _HOOKS_OF.get(module, [])
    for handle in previous:
        handle.remove()
    previous.clear()
    _HOOKS_OF[module] = [
        param.register_post_accumulate_grad_hook(partial(on_gradient_ready, index))
        for index, param in enumerate(params)
    ]
    return _HOOKS_OF[module]


class ParameterUsage:
    """Which parameters got a gradient on this rank since the last synced backward (no_sync
    steps count too, as in torch) and, after one small all-reduce, on any rank."""

    def __init__(self, count: int) -> None:
        self._here = torch.zeros(count, dtype=torch.int32)
        self.last_on_any_rank: torch.Tensor | None = None  # what a joined rank re-sends (ddp.py)

    def note(self, index: int) -> None:
        self._here[index] = 1

    def clear(self) -> None:
        self._here.zero_()

    def on_any_rank(self, device: torch.device, group: Any, wait: Callable) -> list[bool]:
        usage = self._here.to(device, copy=True)  # NCCL moves only GPU tensors
        wait(dist.all_reduce(usage, group=group, async_op=True), "all-reduce of parameter usage")
        self.clear()
        self.last_on_any_rank = usage
        return [bool(count) for count in usage.tolist()]

    def resend_last(self, device: torch.device, group: Any, wait: Callable) -> None:
        """A joined rank's part in the usage all-reduce (join.py). torch's joined rank re-sends
        the map its last synced backward received, so a parameter used on any rank then counts
        as used as long as others train (its `.grad` becomes zeros, not None, which momentum or
        weight decay would then apply to): the same here, for torch's bits."""
        last = self.last_on_any_rank
        if last is None:  # joined before any synced backward: it used nothing
            self.on_any_rank(device, group, wait)
            return
        wait(dist.all_reduce(last, group=group, async_op=True), "all-reduce of parameter usage")
        last.clamp_(max=1)  # torch's sums grow each time; only "not zero" is ever read


def parameters_not_reached(output: Any, params: Sequence[torch.Tensor]) -> list[int]:
    """Walk the autograd graph back from the outputs; return the indices of `params` it never
    reaches. Those get no gradient in this backward, so the wrapper marks them ready up front
    (contributing zeros, or what no_sync accumulated)."""
    position = {id(p): i for i, p in enumerate(params)}
    reached: set[int] = set()
    seen: set[Any] = set()
    stack = []
    for tensor in find_tensors(output):
        if tensor.grad_fn is not None:
            stack.append(tensor.grad_fn)
        elif id(tensor) in position:
            reached.add(position[id(tensor)])
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None and id(variable) in position:
            reached.add(position[id(variable)])
        stack.extend(next_fn for next_fn, _ in fn.next_functions if next_fn is not None)
    return [i for i in range(len(params)) if i not in reached]


def when_backward_reaches(output: Any, callback: Callable[[], None]) -> None:
    """Call `callback` each time a backward pass reaches a tensor of `output` (the first thing
    a backward through this output does, before any parameter's gradient)."""
    for tensor in find_tensors(output):
        if tensor.requires_grad:
            tensor.register_hook(lambda _: callback())


def find_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) output, found where torch's DDP looks: tensors, and lists,
    tuples (namedtuples too), dicts and dataclasses of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from find_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from find_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from find_tensors(getattr(obj, field.name))
