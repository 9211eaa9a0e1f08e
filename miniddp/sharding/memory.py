"""Where a rank's memory goes: parameters, gradients, communication buckets, optimizer state.

Counted from the tensors' storages, not their shapes, so that what shares memory is counted
once: a gradient that is a view into its bucket (`gradient_as_bucket_view=True`) costs its
bytes once, under gradients, and a full parameter that fully_shard freed after its forward
(its storage resized to 0) costs nothing. Categories are filled in the order above; a storage
already counted in one is not counted again in a later one.

The formula it is checked against, for Ψ parameter elements in fp32 trained with Adam(W):

    DDP       4Ψ parameters + 4Ψ gradients + 4Ψ buckets (0 as bucket views) + 8Ψ Adam states
    ZeRO-1    Adam states sharded:  8Ψ/W
    ZeRO-2    gradients sharded too: 4Ψ/W (the buckets stay, see zero2.py)
    ZeRO-3    everything sharded: (4 + 4 + 8)Ψ/W, plus the padding that makes shards equal

Adam's two states are 4Ψ each (exp_avg, exp_avg_sq); its `step` counter adds one 4-byte
scalar per parameter tensor, which the formulas count too, so states are exact.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch
from torch import nn


@dataclass(frozen=True)
class MemoryPerRank:
    """Bytes this rank holds, by what they are for."""

    parameters: int
    gradients: int
    buckets: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return sum(getattr(self, field.name) for field in fields(self))


def measure_memory(
    parameters: Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    buckets: Iterable[torch.Tensor] = (),
) -> MemoryPerRank:
    """Count the storages behind `parameters`, their `.grad`s, `buckets` and the optimizer's
    state, each storage once. A ZeroRedundancyOptimizer's state lives in its local `.optim`."""
    parameters = list(parameters)
    seen: set[int] = set()

    def count(tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for tensor in tensors:
            if tensor is None:
                continue
            if hasattr(tensor, "to_local"):  # torch's FSDP2 parameters are DTensors
                tensor = tensor.to_local()
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    local = getattr(optimizer, "optim", optimizer)
    states = [] if local is None else local.state.values()
    state_tensors = [v for state in states for v in state.values() if torch.is_tensor(v)]
    return MemoryPerRank(
        parameters=count(parameters),
        gradients=count(p.grad for p in parameters),
        buckets=count(buckets),
        optimizer_state=count(state_tensors),
    )


def ddp_buckets(ddp: nn.Module) -> list[torch.Tensor]:
    """The flat bucket tensors of a MiniDDP (empty for anything else)."""
    layout = getattr(ddp, "_layout", None)
    return [] if layout is None else [bucket.flat for bucket in layout.buckets]


@dataclass(frozen=True)
class Formula:
    """The memory a sharding stage should take per rank, in bytes, for fp32 and Adam(W)."""

    stage: str  # "ddp", "zero1", "zero2" or "zero3"
    elements: int  # Ψ
    tensors: int  # parameter tensors whose Adam state this rank keeps (a 4-byte step each)
    world_size: int
    bucket_view: bool = False  # DDP's gradient_as_bucket_view: .grad is its bucket's slice

    def __post_init__(self) -> None:
        if self.bucket_view and self.stage not in ("ddp", "zero1"):
            raise ValueError(
                f"the {self.stage} formula has no gradient_as_bucket_view variant: ZeRO-2 drops "
                "the gradients it does not own, ZeRO-3 has no buckets"
            )

    def expected(self, elements_on_this_rank: int | None = None) -> MemoryPerRank:
        """`elements_on_this_rank`: how many parameter elements this rank owns (ZeRO-1/2: its
        partition; ZeRO-3: its padded shards). Defaults to Ψ/W, rounded up."""
        psi, world = self.elements, self.world_size
        owned = -(-psi // world) if elements_on_this_rank is None else elements_on_this_rank
        sharded_state = self.stage != "ddp"
        sharded_grads = self.stage in ("zero2", "zero3")
        buckets = 0 if self.bucket_view or self.stage == "zero3" else 4 * psi
        return MemoryPerRank(
            parameters=4 * (owned if self.stage == "zero3" else psi),
            gradients=4 * (owned if sharded_grads else psi),
            buckets=buckets,
            optimizer_state=8 * (owned if sharded_state else psi) + 4 * self.tensors,
        )
