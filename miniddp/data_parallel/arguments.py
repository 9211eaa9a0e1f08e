"""Torch 2.13's DDP arguments that only say *which* group, *when* buffers travel, and *what* to
leave out.

MiniDDP takes torch's keywords with torch's meaning, so code moves between the two unchanged.
Two pairs need a rule before construction can start:

- `process_group` or `device_mesh`: a 1-D mesh is one more way to name the group (its only
  axis); naming both, or a mesh with more axes, is ambiguous, so it is refused.
- `broadcast_buffers` (deprecated in torch 2.13) or `forward_sync_buffers`: both say whether
  buffers are copied from rank 0 at each synced forward, but `broadcast_buffers=False` also
  keeps them out of the copy at construction (rank-local buffers stay local), while
  `forward_sync_buffers=False` still copies them once, there. Given both, the new one wins.

And one set before construction, on the module: torch's params-to-ignore, the names a DDP built
around it leaves to someone else.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class BufferSync:
    """When a wrapper copies the module's buffers from rank 0."""

    at_construction: bool
    at_forward: bool


class DeprecatedName:
    """A class attribute that reads and writes another attribute under torch's old name:
    `broadcast_buffers = DeprecatedName("forward_sync_buffers")` keeps `ddp.broadcast_buffers`
    readable and settable, as torch's DDP does."""

    def __init__(self, current: str) -> None:
        self.current = current

    def __get__(self, owner: Any, kind: type | None = None) -> Any:
        return self if owner is None else getattr(owner, self.current)

    def __set__(self, owner: Any, value: Any) -> None:
        setattr(owner, self.current, value)


def buffer_sync(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> BufferSync:
    """Torch 2.13's rule for the two buffer keywords, with its FutureWarning for the old one."""
    if broadcast_buffers is not None:
        if forward_sync_buffers is not None:
            message = (
                "Both broadcast_buffers and forward_sync_buffers were given: broadcast_buffers "
                "is deprecated (torch 2.13) and is ignored. Pass forward_sync_buffers only."
            )
        else:
            message = (
                "broadcast_buffers is deprecated (torch 2.13): use forward_sync_buffers. Unlike "
                "broadcast_buffers=False, forward_sync_buffers=False still copies rank 0's "
                "buffers at construction; keep broadcast_buffers=False if they must stay local."
            )
        warnings.warn(message, FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return BufferSync(at_construction=True, at_forward=forward_sync_buffers)
    at_forward = True if broadcast_buffers is None else broadcast_buffers
    return BufferSync(at_construction=at_forward, at_forward=at_forward)


def group_of(process_group: dist.ProcessGroup | None, device_mesh: Any) -> Any:
    """The group a wrapper reduces over: `process_group`, a 1-D `device_mesh`'s, or the default
    (None). Accepts miniddp.mesh's DeviceMesh and torch's alike."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise RuntimeError(
            "MiniDDP got both process_group and device_mesh: give one. A 1-D mesh names its "
            "group; for one axis of a larger mesh pass device_mesh=mesh['dp']."
        )
    if device_mesh.ndim != 1:
        raise RuntimeError(
            f"MiniDDP's device_mesh must be 1-D (data parallelism runs over one axis), but got "
            f"{device_mesh} with {device_mesh.ndim} axes. Pass one axis: device_mesh=mesh['dp']."
        )
    return device_mesh.get_group(0)


@dataclass(frozen=True)
class ParamsToIgnore:
    """torch's params-to-ignore: names in a module that a DDP built around it leaves out of what
    it broadcasts, compares and averages, because someone else reduces them (expert
    parallelism's experts, summed over the ranks that hold the same experts: miniddp/
    parallelize_experts.py). `trainable`: those of them that train (mixed precision still casts
    them, and folds their gradients into their masters); `others`: every other parameter,
    frozen ones included."""

    names: set[str]
    trainable: list[nn.Parameter]
    others: list[nn.Parameter]

    @staticmethod
    def set_for_model(module: nn.Module, names: Iterable[str]) -> None:
        """torch's `DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`."""
        module._ddp_params_and_buffers_to_ignore = list(names)

    @classmethod
    def of(cls, module: nn.Module) -> ParamsToIgnore:
        names = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        named = list(module.named_parameters())
        trainable = [p for n, p in named if n in names and p.requires_grad]
        return cls(names, trainable, [p for n, p in named if n not in names])
