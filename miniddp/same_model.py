"""Every replica the same model: checked before training, made so by rank 0's copy.

Before training, every rank must hold the same model with the same settings: DDP sums gradients
position by position, so a different shape, order or dtype on one rank would either hang the
collectives or quietly add up unrelated numbers. So every rank compares its parameters and
settings with rank 0's (and all raise together on a difference), then takes rank 0's values.

Equal shapes are not enough. A tensor-parallel shard has the same shape on every rank of its
TP group and different values: a data-parallel wrapper over a group that holds two ranks of
one TP group would copy rank 0's shard over the other's and average unrelated halves. The mark
tensor parallelism leaves on its shards (miniddp/placement.py) names their group, and any
overlap of two ranks or more is refused, on every rank, before anything is copied.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from miniddp.placement import group_ranks, placement_of


def check_wrappable(
    module: nn.Module, ignored: Collection[str] = ()
) -> list[tuple[str, nn.Parameter]]:
    """Refuse, at construction, a model that training could only fail on later; otherwise its
    (name, parameter) pairs that MiniDDP reduces. Only parameters that require grad are, and a
    tied weight only once: it is one variable with one gradient. `named_parameters()` walks
    modules in registration order and skips repeats, as torch's reducer does. The names in
    `ignored` are someone else's to reduce (torch's params-to-ignore)."""
    trainable = [
        (n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignored
    ]
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
    return trainable


def verify_same_model_on_every_rank(
    named_params: Sequence[tuple[str, torch.Tensor]],
    settings: dict[str, Any],
    group: dist.ProcessGroup | None,
) -> None:
    """Compare every rank's parameters and settings with rank 0's; on a mismatch EVERY rank
    raises the same error (an error on one rank only would leave the others hanging)."""
    mine = [(name, tuple(p.shape), tuple(p.stride()), str(p.dtype)) for name, p in named_params]
    overlap = _shards_of_one_tensor_parallel_group(named_params, group)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (mine, settings, overlap), group=group)
    found = next((problem for _, _, problem in everyone if problem), None)
    if found:
        raise ValueError(found)
    reference, reference_settings, _ = everyone[0]
    for rank, (theirs, their_settings, _) in enumerate(everyone[1:], start=1):
        problem = _first_difference(reference, theirs, rank)
        for name, value in reference_settings.items():
            if problem is None and their_settings[name] != value:
                problem = f"{name} is {value} on rank 0 and {their_settings[name]} on rank {rank}"
        if problem:
            raise ValueError(
                f"MiniDDP needs the same model and settings on every rank, but {problem}. "
                "Build it with the same code and arguments on every rank."
            )


def _shards_of_one_tensor_parallel_group(
    named_params: Sequence[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None
) -> str | None:
    """Why averaging over `group` would destroy tensor-parallel shards, or None."""
    replicas = set(group_ranks(group))
    for name, param in named_params:
        shard = placement_of(param).tensor
        if shard is None:
            continue
        both = sorted(replicas & set(group_ranks(shard.group)))
        if len(both) > 1:
            return (
                f"'{name}' is a tensor-parallel shard over ranks {group_ranks(shard.group)}, and "
                f"the data-parallel group (ranks {sorted(replicas)}) holds {both} of them: "
                "averaging over it would mix different shards, and broadcasting rank 0's "
                "would overwrite the others. Pass the mesh's data-parallel group, e.g. "
                'process_group=mesh["dp"].get_group() (MiniDDP, fully_shard and '
                "ZeroRedundancyOptimizer take it the same way)."
            )
    return None


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
