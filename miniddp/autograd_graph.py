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


def check_wrappable(module: nn.Module, trainable: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Refuse, at construction, a model that training could only fail on later."""
    if not trainable:
        raise ValueError(
            "MiniDDP got a module with no parameter that requires grad: there is nothing to "
            "synchronize. Wrap the model you train (or unfreeze its parameters)."
        )
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            raise ValueError(
                f"Module '{name}' produces sparse gradients (sparse=True); MiniDDP reduces dense "
                "buckets only. Construct it with sparse=False."
            )
    on_meta = [name for name, p in module.named_parameters() if p.is_meta]
    if on_meta:
        raise ValueError(
            f"Parameter '{on_meta[0]}' (and {len(on_meta) - 1} more) is on the meta device: it "
            "has a shape but no values, so there is nothing to broadcast or train. Materialize "
            "the model first: module.to_empty(device=...) and then initialize its weights (e.g. "
            "reset_parameters(), or load a state dict)."
        )


def verify_same_model_on_every_rank(
    named_params: Sequence[tuple[str, torch.Tensor]],
    settings: dict[str, Any],
    group: dist.ProcessGroup | None,
) -> None:
    """Compare every rank's parameters and settings with rank 0's; on a mismatch EVERY rank
    raises the same error (an error on one rank only would leave the others hanging)."""
    mine = [(name, tuple(p.shape), tuple(p.stride()), str(p.dtype)) for name, p in named_params]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (mine, settings), group=group)
    reference, reference_settings = everyone[0]
    for rank, (theirs, their_settings) in enumerate(everyone[1:], start=1):
        problem = _first_difference(reference, theirs, rank)
        for name, value in reference_settings.items():
            if problem is None and their_settings[name] != value:
                problem = f"{name} is {value} on rank 0 and {their_settings[name]} on rank {rank}"
        if problem:
            raise ValueError(
                f"MiniDDP needs the same model and settings on every rank, but {problem}. "
                "Build it with the same code and arguments on every rank."
            )


def _first_difference(reference: list[tuple], theirs: list[tuple], rank: int) -> str | None:
    if len(reference) != len(theirs):
        return (
            f"rank 0 has {len(reference)} parameters that require grad while rank {rank} "
            f"has {len(theirs)}"
        )
    fields = ("name", "shape", "stride", "dtype")
    for ours, other in zip(reference, theirs):
        for field, a, b in zip(fields, ours, other):
            if a != b:
                return (
                    f"parameter '{ours[0]}' has {field} {a} on rank 0 and {field} {b} "
                    f"on rank {rank}"
                )
    return None


def broadcast_from_rank0(
    tensors: Sequence[torch.Tensor],
    what: str,
    group: dist.ProcessGroup | None,
    wait: Callable[[dist.Work, str], Any],
    source: int = 0,
) -> None:
    """Overwrite `tensors` with rank 0's values, so every replica starts (and stays) equal: one
    flat message per (dtype, device) instead of one per tensor. `wait` is the DDP's wait seam.
    (Under Join, rank 0 may have stopped training: then `source` is another rank in `group`.)"""
    src = source if group is None else dist.get_global_rank(group, source)
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        for same_kind in by_kind.values():
            flat = torch.cat([t.reshape(-1) for t in same_kind])
            nbytes = flat.numel() * flat.element_size()
            work = dist.broadcast(flat, src=src, group=group, async_op=True)
            wait(work, f"broadcast of {what} from rank {source} ({nbytes:,} bytes)")
            for tensor, piece in zip(same_kind, flat.split([t.numel() for t in same_kind])):
                tensor.copy_(piece.view_as(tensor))


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
        self.last_on_any_rank: torch.Tensor | None = None  # what a joined rank re-sends (join.py)

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


def parameters_not_reached(output: Any, params: Sequence[torch.Tensor]) -> list[int]:
    """Walk the autograd graph back from the outputs; return the indices of `params` it never
    reaches. Those get no gradient in this backward, so MiniDDP marks them ready up front
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
