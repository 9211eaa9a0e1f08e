"""The units fully_shard made, by number, and the mistakes that numbering makes visible.

Every fully_shard call is a unit, numbered in call order per process group: the same numbers
on every rank, since every rank shards the same model in the same order (fully_shard checks the
shapes). The numbers name units in errors, and label each rank's piece of a gather, so that
every rank sees whether all gather the same unit. This module also refuses, at the call, what
would shard wrongly later: a child after its ancestor, a parameter tied across units, a
submodule called outside its unit.
"""

from __future__ import annotations

import weakref
from enum import Enum
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

import miniddp.collectives as collectives
from miniddp.job.faults import CollectiveFailed, ranks


class ShardedState(Enum):
    """Which parameters a unit's modules hold, in FSDP2's words (its ShardedState). Only
    hold_full and hold_shards move a unit between them."""

    SHARDED = "the shards: what the optimizer steps, outside the unit's forward and backward"
    UNSHARDED = "the full parameters: inside the unit's forward, or its backward"


class Unit(Protocol):
    """What these checks read of a unit (fully_shard's ShardedParameters): its number and name,
    its group, its shards. A protocol, so that this module needs nothing from fully_shard.py."""

    number: int
    name: str
    group: dist.ProcessGroup | None
    shards: list[nn.Parameter]
    sharded_state: ShardedState

    @property
    def compute_dtype(self) -> torch.dtype: ...

    @property
    def world_size(self) -> int: ...


UNIT_NUMBER_BYTES = collectives.ring.LABEL_BYTES  # what leads each piece of a gather: an int64
UNIT_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()  # shard -> its unit
_BY_NUMBER: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (ranks, n) -> unit
_count: dict[tuple[int, ...], int] = {}  # fully_shard calls so far, per group (by its ranks)


def members(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def next_number(group: dist.ProcessGroup | None) -> int:
    key = members(group)
    _count[key] = _count.get(key, 0) + 1
    return _count[key]


def register(unit: Unit) -> None:
    _BY_NUMBER[members(unit.group), unit.number] = unit
    for shard in unit.shards:
        UNIT_OF[shard] = unit


def is_fully_sharded(module: nn.Module) -> bool:
    """Does fully_shard manage any of `module`'s parameters?"""
    return any(param in UNIT_OF for param in module.parameters())


def gather_once_every_rank_agrees(
    unit: Unit, output: torch.Tensor, mine: torch.Tensor
) -> collectives.Work:
    """Issue `unit`'s all-gather of `mine` into `output`, each rank's piece labelled with its
    unit's number, and return at once.

    A unit skipped on one rank (a branch in the forward) would pair this unit's all-gather with
    another unit's there: gloo aborts the process when the sizes differ ("Received data size
    doesn't match expected size"), and mixes parameters silently when they do not. So each
    rank's piece travels with its unit number (UNIT_NUMBER_BYTES), every receive has room for
    the largest piece any unit of the group sends, and once all have arrived every rank sees
    every number: on a mismatch every rank raises, naming both units (the error reaches
    whoever waits for the gather).

    Why in the gather's own messages: checked first, as a blocking 8-byte all-gather on the
    caller's thread, each gather waited for everything in flight before it and for the slower
    rank, and a prefetched gather was exposed again (stubbed out, a step over the bench's link
    went from 784 ms to 546 ms). As a separate all-gather on the communication thread, it
    still cost a round trip more per gather, on cores that compute beside it."""
    labelled = collectives.Labelled(
        label=unit.number,
        room_bytes=largest_piece_bytes(unit.group),
        check=lambda labels: refuse_a_different_unit(unit, labels),
    )
    return collectives.all_gather_into_tensor(
        output, mine, unit.group, async_op=True, labelled=labelled
    )


def largest_piece_bytes(group: dist.ProcessGroup | None) -> int:
    """The most bytes one rank's piece of any unit over `group` can take: its shards, in the
    widest of their dtypes and their compute dtype (a gather moves one or the other)."""
    key = members(group)
    units = [unit for (ranks_of, _), unit in list(_BY_NUMBER.items()) if ranks_of == key]
    return max(
        (
            sum(s.numel() for s in unit.shards)
            * max(max(s.element_size() for s in unit.shards), unit.compute_dtype.itemsize)
            for unit in units
            if unit.shards
        ),
        default=0,
    )


def refuse_a_different_unit(unit: Unit, numbers: list[int]) -> None:
    """Raise on every rank if any rank's unit number (numbers[r]) is not `unit`'s."""
    elsewhere = {r: n for r, n in enumerate(numbers) if n != unit.number}
    if elsewhere:
        here = dist.get_rank(unit.group)
        others = ranks(sorted(elsewhere))
        lines = [
            f"{unit.name} cannot be gathered on rank {here}: the unit gathered at this "
            f"point differs on {others}."
        ]
        for rank, number in elsewhere.items():
            other = _BY_NUMBER.get((members(unit.group), number))
            lines.append(f"  rank {rank}: {other.name if other else f'unit {number}'}")
        lines.append(
            "  Every rank must run the same fully_shard units in the same order (a unit "
            "skipped on one rank, by a branch in the forward, is the usual cause)."
        )
        raise CollectiveFailed("\n".join(lines), unit.name, sorted(elsewhere))


def refuse_what_would_shard_wrongly(
    module: nn.Module,
    params: dict[int, torch.Tensor],
    places: dict[int, list[tuple[nn.Module, str]]],
) -> None:
    """Two mistakes that would otherwise fail much later, or never: sharding a child after its
    ancestor (its parameters are already shards: they would be cut again, and the first forward
    fails with "mat2 must be a matrix"), and a parameter tied across units (each unit would
    shard its own copy: after one step they are two different parameters, silently)."""
    for key, param in params.items():
        owner, name = places[key][0]
        if param in UNIT_OF:
            raise ValueError(
                f"fully_shard({type(module).__name__}) came after its ancestor was sharded: "
                f"its parameter {name!r} is already a shard of {UNIT_OF[param].name}. Shard "
                "the submodules first, then the root: for block in model.blocks: "
                "fully_shard(block); then fully_shard(model)."
            )
    units = [getattr(sub, "_sharded", None) for sub in module.modules()]
    units = [unit for unit in units if unit is not None]
    qualified = {id(sub): prefix for prefix, sub in module.named_modules(remove_duplicate=False)}
    for key, param in params.items():
        for unit in units:
            if param in unit.originals:
                owner, name = places[key][0]
                where = f"{qualified.get(id(owner), type(owner).__name__)}.{name}".lstrip(".")
                raise ValueError(
                    f"Parameter {where!r} is shared with a parameter already managed by "
                    f"{unit.name}: sharded twice, the two would be cut and stepped apart, and "
                    "come untied. Put tied modules in one unit: torch's fully_shard([module_a, "
                    "module_b]); here, leave both to their common ancestor's fully_shard (do "
                    "not shard either alone)."
                )


def refuse_outside_its_unit(unit: Unit, module: nn.Module, args: Any) -> None:
    if unit.sharded_state is not ShardedState.UNSHARDED:
        raise RuntimeError(
            f"{type(module).__name__} was called on its own, but its parameters belong to "
            f"{unit.name} and are full only during that module's forward. Call the unit "
            "instead, or make this module a unit of its own: fully_shard(it) before its "
            "ancestor."
        )
