"""What LocalSGD and DiLoCo refuse at construction, before any message leaves.

Every check here looks only at what each rank holds the same way (its arguments, its model's
shapes and marks), so every replica refuses alike, and none is left waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from miniddp.placement import group_ranks, placement_of


def check_sync_every(sync_every: int) -> None:
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(
            f"sync_every must be a whole number of inner optimizer steps, at least 1; got "
            f"{sync_every!r}. (1 syncs after every step: synchronous data parallelism.)"
        )


def check_replica_group(params: Sequence[tuple[str, torch.Tensor]], group) -> None:
    """Averaging over a group that holds different tensor-parallel shards of one parameter would
    mix the shards into nonsense: refuse, and name the group to pass instead."""
    if not dist.is_initialized():
        raise RuntimeError(
            "LocalSGD and DiLoCo average over a process group, and there is none: call "
            "torch.distributed.init_process_group (or launch with torchrun) first."
        )
    replicas = set(group_ranks(group))
    for name, param in params:
        shard = placement_of(param).tensor
        if shard is None:
            continue
        both = sorted(replicas & set(group_ranks(shard.group)))
        if len(both) > 1:
            raise ValueError(
                f"'{name}' is a tensor-parallel shard over ranks {group_ranks(shard.group)}, "
                f"and the replicas' group (ranks {sorted(replicas)}) holds {both} of them: "
                "averaging would mix different shards. Pass the group that joins the "
                'replicas, e.g. process_group=mesh["diloco"].get_group().'
            )


def trainable(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no parameter that requires grad: there is nothing to sync")
    return named


def check_same_parameters(what: str, given: Iterable[torch.Tensor], model_params) -> None:
    """`given` must be exactly the model's trainable parameters (in any order)."""
    given_ids = {id(p) for p in given}
    model_ids = {id(p) for p in model_params}
    missing, foreign = len(model_ids - given_ids), len(given_ids - model_ids)
    if missing or foreign:
        raise ValueError(
            f"the {what} must hold exactly the model's parameters that require grad; it lacks "
            f"{missing} of them and holds {foreign} others. Build it over model.parameters()."
        )
