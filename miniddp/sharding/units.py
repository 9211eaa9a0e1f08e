"""The units fully_shard made, by number, and the mistakes that numbering makes visible.

Every fully_shard call is a unit, numbered in call order per process group: the same numbers
on every rank, since every rank shards the same model in the same order (fully_shard checks the
shapes). The numbers name units in errors, and let each gather first check that every rank
gathers the same unit. This module also refuses, at the call, what would shard wrongly later:
a child after its ancestor, a parameter tied across units, a submodule called outside its unit.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

import miniddp.collectives as collectives
from miniddp.job.faults import CollectiveFailed, ranks, wait_for


class Unit(Protocol):
    """What these checks read of a unit (fully_shard's ShardedParameters): its number and name,
    its group, its shards. A protocol, so that this module needs nothing from fully_shard.py."""

    number: int
    name: str
    group: dist.ProcessGroup | None
    shards: list[nn.Parameter]

    @property
    def world_size(self) -> int: ...


UNIT_NUMBER_BYTES = 8  # what each rank sends each other rank before a gather (an int64)
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


def check_every_rank_gathers(unit: Unit) -> None:
    """A unit skipped on one rank (a branch in the forward) would pair this unit's
    all-gather with another unit's there: gloo aborts the process when the sizes differ
    ("Received data size doesn't match expected size"), and mixes parameters silently when
    they do not. So first an all-gather of each rank's unit number (8 bytes); on a
    mismatch every rank raises, naming both units, and nothing is left in flight."""
    world = unit.world_size
    everyone = torch.empty(world, dtype=torch.int64)  # UNIT_NUMBER_BYTES from each
    mine = torch.tensor([unit.number])
    work = collectives.all_gather_into_tensor(everyone, mine, unit.group, async_op=True)
    what = f"all-gather of which unit each rank gathers ({unit.name})"
    wait_for(work.get_future(), what, unit.group)
    elsewhere = {r: int(n) for r, n in enumerate(everyone.tolist()) if n != unit.number}
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
    if not unit.gathered:
        raise RuntimeError(
            f"{type(module).__name__} was called on its own, but its parameters belong to "
            f"{unit.name} and are full only during that module's forward. Call the unit "
            "instead, or make this module a unit of its own: fully_shard(it) before its "
            "ancestor."
        )
