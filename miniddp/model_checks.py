"""What MiniDDP checks about the model it wraps: before training, and before each backward.

Before training, every rank must hold the same model with the same settings: DDP sums gradients
position by position, so a different shape, order or dtype on one rank would either hang the
collectives or quietly add up unrelated numbers. Before each backward (with
find_unused_parameters), which parameters the coming backward will not reach.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def refuse_sparse_gradients(module: nn.Module) -> None:
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            raise ValueError(
                f"Module '{name}' produces sparse gradients (sparse=True); MiniDDP reduces dense "
                "buckets only. Construct it with sparse=False."
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


def find_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) output: a tensor, or lists, tuples and dicts of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from find_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from find_tensors(item)
