"""A fully sharded model's state, whole: out of the shards for saving, and back into them.

Under fully_shard, `model.state_dict()` holds this rank's 1-D shards: saved from one rank, they
are a W-th of the model, and loaded on every rank they put that W-th everywhere, silently (the
shapes match). So checkpoints hold the *full* state, as torch's `get_model_state_dict(...,
StateDictOptions(full_state_dict=True))` gives it:

    full_state_dict(model)                                  # all-gathers; the unsharded model's
    load_full_state_dict(model, state)                      # each rank cuts its own shards
    full_optimizer_state_dict(model, optimizer)             # momentum, Adam's moments, whole
    load_full_optimizer_state_dict(model, optimizer, state)

The full state is the state of the same model without sharding (same keys, same shapes), so it
loads at any world size, and into a plain module too. Cutting is exact: a shard is a slice of
the flattened parameter, padded with zeros, so cut(gather(shards)) gives the same bits back, and
so do the optimizer's states, which are elementwise (Adam's moments of the padding stay zero).

The two `full_*` functions are collectives (call them on every rank); the two loads are not.
Under HSDP they gather over each rank's shard group: every replica holds the same pieces, so
each gathers the same full state, and a load cuts for whatever mesh the model has now.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from miniddp.sharding.sharded_parameters import ShardedParameters
from miniddp.sharding.units import UNIT_OF


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every shard replaced by its full, unsharded parameter, on every
    rank (a collective: call it on all of them)."""
    state = module.state_dict()
    gathered: dict[int, list[torch.Tensor]] = {}
    with torch.no_grad():
        for key, (unit, index) in _sharded_keys(module).items():
            if id(unit) not in gathered:
                gathered[id(unit)] = unit.gather_masters()  # one all-gather per unit
            state[key] = gathered[id(unit)][index]
    return state


def full_shapes(module: nn.Module) -> dict[str, torch.Size]:
    """The shape every state_dict entry has in the full state (no communication)."""
    shapes = {key: value.shape for key, value in module.state_dict().items()}
    for key, (unit, index) in _sharded_keys(module).items():
        shapes[key] = unit.shapes[index]
    return shapes


def load_full_state_dict(module: nn.Module, state_dict: dict[str, Any], strict: bool = True):
    """Load a full state dict (from `full_state_dict`, or from the same model unsharded) into a
    fully sharded `module`: each rank keeps its own piece of every parameter. Returns what
    `load_state_dict` returns."""
    pieces = dict(state_dict)
    for key, (unit, index) in _sharded_keys(module).items():
        if key not in state_dict:
            continue  # load_state_dict names it as missing
        full, shape = state_dict[key], unit.shapes[index]
        if tuple(full.shape) != tuple(shape):
            raise ValueError(
                f"{key!r} has shape {tuple(full.shape)} in the state dict and {tuple(shape)} in "
                "this model (unsharded): the state dict belongs to another model"
            )
        pieces[key] = unit.cut(full)
    return module.load_state_dict(pieces, strict=strict)


def full_optimizer_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """`optimizer.state_dict()`, with each state of a shard (momentum, exp_avg, exp_avg_sq, ...)
    gathered to its parameter's full shape: what the same optimizer holds without sharding. A
    collective: every rank, the same optimizer."""
    saved = optimizer.state_dict()
    state = dict(saved["state"])
    for index, param in enumerate(_optimized(optimizer)):
        unit = UNIT_OF.get(param)
        if unit is None or index not in state:
            continue
        shape = _shape_of(unit, param)
        state[index] = {
            name: unit.unshard(value, shape) if _is_piece(value, param) else value
            for name, value in sorted(state[index].items())  # the same order on every rank
        }
    return {**saved, "state": state}


def load_full_optimizer_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> None:
    """Load `full_optimizer_state_dict`'s result: each rank keeps its pieces of the states."""
    state = dict(state_dict["state"])
    for index, param in enumerate(_optimized(optimizer)):
        unit = UNIT_OF.get(param)
        if unit is None or index not in state:
            continue
        shape = _shape_of(unit, param)
        state[index] = {
            name: unit.cut(value) if _is_full(value, shape) else value
            for name, value in state[index].items()
        }
    optimizer.load_state_dict({**state_dict, "state": state})


def _sharded_keys(module: nn.Module) -> dict[str, tuple[ShardedParameters, int]]:
    """Each state_dict key that holds a shard, with its unit and its index there."""
    found = {}
    for key, value in module.state_dict(keep_vars=True).items():
        unit = UNIT_OF.get(value)
        if unit is not None:
            found[key] = (unit, _index_in(unit, value))
    return found


def _optimized(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in its state_dict's numbering."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _index_in(unit: ShardedParameters, shard: torch.Tensor) -> int:
    return next(i for i, s in enumerate(unit.shards) if s is shard)


def _shape_of(unit: ShardedParameters, shard: torch.Tensor) -> torch.Size:
    return unit.shapes[_index_in(unit, shard)]


def _is_piece(value: Any, shard: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.shape == shard.shape and value.dim() == 1


def _is_full(value: Any, shape: torch.Size) -> bool:
    return torch.is_tensor(value) and value.shape == shape and value.dim() > 0
