"""Where a rank's memory goes: parameters, gradients, communication buckets, optimizer state,
and under mixed precision the copies forward and backward compute with.

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

Under MiniDDP's mixed precision (`MixedPrecision(param_dtype=torch.bfloat16)`, see
miniddp/data_parallel/compute_copies.py) the masters, their gradients and Adam's states stay
fp32, and a bf16 copy of every parameter is added; the buckets are in reduce_dtype:

    DDP       4Ψ masters + 2Ψ copies + 4Ψ gradients + 4Ψ buckets (2Ψ in bf16, 0 as views) + 8Ψ
    ZeRO-1    Adam states sharded:  8Ψ/W
    ZeRO-2    gradients sharded too: 4Ψ/W

(ZeRO's paper shards the fp32 masters with the states, 12Ψ/W. Here the masters are the
module's own parameters, which every rank keeps whole: ZeRO-1's all-gather refills them.)

So MiniDDP's formula is not ZeRO's 16Ψ = 2Ψ fp16 parameters + 2Ψ fp16 gradients + 12Ψ fp32
(master, momentum, variance). Its gradients are fp32 (4Ψ, not 2Ψ), because the optimizer steps
the fp32 master and torch's optimizers take a `.grad` of the parameter's own dtype; because an
average reduced in fp32 would lose its extra bits if cast back to bf16; and because no_sync
accumulates in fp32. ZeRO's paper counts the fp16 gradient only (an fp32 one, if any, lives
for the update). MiniDDP's bf16 gradients are the transient ones: each is moved into its
master's fp32 `.grad` as soon as autograd leaves it, so none is held once backward ends.

And the 16Ψ vs 20Ψ question, answered once: chapter 11's 20Ψ is fp32 everything *with* the
bucket (4 + 4 + 4 + 8); fp32 without it (gradient_as_bucket_view) is 16Ψ, the same number as
ZeRO's mixed-precision 16Ψ, which counts no bucket. Mixed precision does not shrink the model's
states at all: MiniDDP's is 18Ψ without the bucket (2 + 4 + 4 + 8), 22Ψ with a fp32 one. What
it saves is the activations (half the bytes) and compute time; what shrinks the states is
sharding them (ZeRO). fully_shard's mixed precision (ZeRO-3) is not in these formulas yet.
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
    compute_copies: int = 0  # mixed precision's param_dtype copies

    @property
    def total(self) -> int:
        return sum(getattr(self, field.name) for field in fields(self))


def measure_memory(
    parameters: Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    buckets: Iterable[torch.Tensor] = (),
    compute_copies: Iterable[torch.Tensor] = (),
) -> MemoryPerRank:
    """Count the storages behind `parameters`, their `.grad`s, `buckets`, the optimizer's
    state and `compute_copies` (mixed precision's, `ddp_compute_copies`), each storage once; a
    gradient left on a compute copy counts as a gradient. A ZeroRedundancyOptimizer's state
    lives in its local `.optim`."""
    parameters, compute_copies = list(parameters), list(compute_copies)
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
        gradients=count(p.grad for p in [*parameters, *compute_copies]),
        buckets=count(buckets),
        optimizer_state=count(state_tensors),
        compute_copies=count(compute_copies),
    )


def ddp_buckets(ddp: nn.Module) -> list[torch.Tensor]:
    """The flat bucket tensors of a MiniDDP (empty for anything else)."""
    layout = getattr(ddp, "_layout", None)
    return [] if layout is None else [bucket.flat for bucket in layout.buckets]


def ddp_compute_copies(ddp: nn.Module) -> list[torch.Tensor]:
    """The param_dtype copies of a MiniDDP under mixed precision (empty for anything else)."""
    copies = getattr(ddp, "_copies", None)
    return [] if copies is None else list(copies.copies)


@dataclass(frozen=True)
class Formula:
    """The memory a sharding stage should take per rank, in bytes, for fp32 masters and
    Adam(W); `param_dtype` and `reduce_dtype` are MiniDDP's MixedPrecision's, if any."""

    stage: str  # "ddp", "zero1", "zero2" or "zero3"
    elements: int  # Ψ
    tensors: int  # parameter tensors whose Adam state this rank keeps (a 4-byte step each)
    world_size: int
    bucket_view: bool = False  # DDP's gradient_as_bucket_view: .grad is its bucket's slice
    param_dtype: torch.dtype | None = None  # the compute copies' dtype; None: no copies
    reduce_dtype: torch.dtype = torch.float32  # the buckets'

    def __post_init__(self) -> None:
        if self.bucket_view and self.stage not in ("ddp", "zero1"):
            raise ValueError(
                f"the {self.stage} formula has no gradient_as_bucket_view variant: ZeRO-2 drops "
                "the gradients it does not own, ZeRO-3 has no buckets"
            )
        if self.stage == "zero3" and self.param_dtype is not None:
            raise ValueError("the zero3 formula counts fp32 fully_shard only, no mixed precision")

    def expected(self, elements_on_this_rank: int | None = None) -> MemoryPerRank:
        """`elements_on_this_rank`: how many parameter elements this rank owns (ZeRO-1/2: its
        partition; ZeRO-3: its padded shards). Defaults to Ψ/W, rounded up."""
        psi, world = self.elements, self.world_size
        owned = -(-psi // world) if elements_on_this_rank is None else elements_on_this_rank
        sharded_state = self.stage != "ddp"
        sharded_grads = self.stage in ("zero2", "zero3")
        bucket = self.reduce_dtype.itemsize
        buckets = 0 if self.bucket_view or self.stage == "zero3" else bucket * psi
        copy = 0 if self.param_dtype is None else self.param_dtype.itemsize
        return MemoryPerRank(
            parameters=4 * (owned if self.stage == "zero3" else psi),
            gradients=4 * (owned if sharded_grads else psi),
            buckets=buckets,
            optimizer_state=8 * (owned if sharded_state else psi) + 4 * self.tensors,
            compute_copies=copy * psi,
        )
