"""One fully_shard unit's parameters, and the collectives that move them.

A unit's shards are gathered into full parameters and its full gradients reduce-scattered back
onto the shards, each collective in two halves: `start_*` issues it on MiniDDP's communication
thread and returns at once, `finish_*` waits for it (through the one wait seam, so that a dead
rank is named) and puts the result in place. Between the two, the caller computes: prefetch.py
decides what runs between.

HSDP (fully_shard over a 2-D mesh): the shards are cut over `group`, the mesh's shard dim, and
`replicas` holds the ranks with the same shards, one per replica (the replicate dim). The
reduce-scatter then leaves rank r the average over its shard group of chunk r, and an all-reduce
over `replicas` averages those: issued behind the reduce-scatter on the one communication
thread, on its output, so the two travel back to back and are waited for as one.

Sharding: a parameter of n elements is flattened and cut into W chunks of ceil(n/W), the last
padded with zeros, so every rank's piece has the same length (a collective needs that). Rank
r's chunk is `module.<name>`: a 1-D Parameter the optimizer steps. Padding stays zero (its
gradient is zero, so Adam leaves it alone); the benchmark states its cost.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

import miniddp.collectives as collectives
from miniddp.job.faults import wait_for
from miniddp.sharding.mixed_precision import MixedPrecisionPolicy
from miniddp.sharding.units import ShardedState, gather_once_every_rank_agrees


@dataclass
class InFlight:
    """A collective issued and not yet waited for: its Work, its output, what errors call it,
    the group it runs over; and `first`, a collective issued before it whose output it reduces
    (HSDP's reduce-scatter, before the all-reduce): waited for first, so that its failure is
    named rather than hidden behind a second collective that ran on what it left."""

    work: collectives.Work
    output: torch.Tensor
    what: str
    group: dist.ProcessGroup | None
    first: InFlight | None = None
    post_divide: float = 1.0  # what is left of the average's 1/W once the output arrives

    def wait(self) -> torch.Tensor:
        if self.first is not None:
            self.first.wait()
        wait_for(self.work.get_future(), self.what, self.group)
        return self.output


@dataclass
class ShardedParameters:
    """What one fully_shard call manages: its parameters' places, shapes and shards."""

    number: int  # the how-manieth fully_shard call over this group: the same on its every rank
    name: str  # "fully_shard unit 2 (Linear: weight, bias)": what errors call it
    places: list[list[tuple[nn.Module, str]]]  # per parameter: (module, attribute) it lives at
    shapes: list[torch.Size]
    shards: list[nn.Parameter]
    group: dist.ProcessGroup | None  # the shard group: each rank holds another piece
    replicas: dist.ProcessGroup | None  # HSDP's replicate group (the same pieces), or None
    reshard_after_forward: bool
    policy: MixedPrecisionPolicy
    originals: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # unsharded
    sharded_state: ShardedState = ShardedState.SHARDED
    full: list[torch.Tensor] = field(default_factory=list)  # the latest forward's, unsharded
    requires_gradient_sync: bool = True
    accumulated: list[torch.Tensor] | None = None  # full gradients held back by no sync
    forward_prefetch: list[ShardedParameters] | None = None  # explicit lists (prefetch.py)
    backward_prefetch: list[ShardedParameters] | None = None
    gradient_divide_factor: float | None = None  # None: the average over the ranks

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.policy.compute_dtype(self.shards[0].dtype)

    @property
    def gradient_dtype(self) -> torch.dtype:
        return self.policy.gradient_dtype(self.shards[0].dtype)

    def start_gather(self, dtype: torch.dtype | None = None) -> InFlight:
        """Issue the all-gather of every shard (one collective for all), in `dtype`: by default
        the compute dtype (mixed_precision.py). The gather itself first checks that every
        rank gathers this unit (units.gather_once_every_rank_agrees)."""
        world, length = self.world_size, sum(s.numel() for s in self.shards)
        dtype, device = dtype or self.compute_dtype, self.shards[0].device
        gathered = torch.empty(world * length, dtype=dtype, device=device)
        mine = torch.cat([s.detach().to(dtype) for s in self.shards])  # cast before the gather
        work = gather_once_every_rank_agrees(self, gathered, mine)
        what = f"all-gather of {self.name} ({gathered.nbytes:,} bytes)"
        return InFlight(work, gathered, what, self.group)

    def finish_gather(self, gathering: InFlight) -> list[torch.Tensor]:
        """Wait for `gathering`; one full tensor per parameter."""
        gathered = gathering.wait()
        world, length = self.world_size, sum(s.numel() for s in self.shards)
        rows, full, offset = gathered.view(world, length), [], 0
        for shard, shape in zip(self.shards, self.shapes):
            columns = rows[:, offset : offset + shard.numel()]
            full.append(columns.reshape(-1)[: shape.numel()].reshape(shape).clone())
            offset += shard.numel()
        return full

    def gather(self, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        return self.finish_gather(self.start_gather(dtype))

    def gather_masters(self) -> list[torch.Tensor]:
        """The full parameters in their masters' dtypes, for a state dict: gathered in the
        widest of those dtypes, so that casting each back is exact."""
        widest = functools.reduce(torch.promote_types, (s.dtype for s in self.shards))
        return [t.to(s.dtype) for t, s in zip(self.gather(widest), self.shards)]

    def start_reduce_scatter(self, grads: list[torch.Tensor]) -> InFlight:
        """Issue the reduce-scatter that leaves rank r the average over ranks of chunk r of
        every gradient, and under HSDP the all-reduce that averages it over the replicas. The
        gradients are in gradient_dtype already (see _Unshard.backward).

        Two averages, each a sum and one division (gloo's AVG), in torch's FSDP2's order
        (`_get_gradient_divide_factors`: AVG for the reduce-scatter, AVG for the all-reduce,
        in fp32 and bf16): (sum over S of g) / S, then (sum over R of that) / R. Dividing by
        a power of two is exact, so at 2 x 2 that is the sum over all four divided by 4. In
        float16 both are sums instead, with torch's factors over all S x R ranks: each
        gradient divided by `pre` first, the result by `post` once it arrives. With a
        gradient_divide_factor, both are sums, and the result is divided by the factor."""
        world, length = self.world_size, sum(s.numel() for s in self.shards)
        pieces = torch.zeros(world, length, dtype=grads[0].dtype, device=grads[0].device)
        offset = 0
        for grad, shard in zip(grads, self.shards):
            padded = pieces.new_zeros(world * shard.numel())
            padded[: grad.numel()] = grad.reshape(-1)
            pieces[:, offset : offset + shard.numel()] = padded.view(world, shard.numel())
            offset += shard.numel()
        mine = pieces.new_empty(length)
        what = f"reduce-scatter of {self.name}'s gradients ({pieces.nbytes:,} bytes)"
        op, post = dist.ReduceOp.AVG, 1.0
        if self.gradient_divide_factor is not None:  # torch's set_gradient_divide_factor:
            op, post = dist.ReduceOp.SUM, self.gradient_divide_factor  # sums, then one division
        elif pieces.dtype == torch.float16:  # divided on both sides of the sums: see below
            replicas = 1 if self.replicas is None else dist.get_world_size(self.replicas)
            pre, post = float16_divide_factors(world * replicas)
            pieces.div_(pre)
            op = dist.ReduceOp.SUM
        work = collectives.reduce_scatter_tensor(
            mine, pieces, op=op, group=self.group, async_op=True
        )
        reducing = InFlight(work, mine, what, self.group, post_divide=post)
        if self.replicas is None:
            return reducing
        work = collectives.all_reduce(mine, op, self.replicas, async_op=True)
        what = f"all-reduce of {self.name}'s gradient shard over its replicas ({mine.nbytes:,} B)"
        return InFlight(work, mine, what, self.replicas, first=reducing, post_divide=post)

    def finish_reduce_scatter(self, reducing: InFlight) -> None:
        """Wait for `reducing`, and add each shard's piece into its `.grad` in the shard's
        dtype, as autograd would have (None: set it; else add in place). Then run the shard's
        post-accumulate-grad hooks (an optimizer stepping in backward, say): autograd never
        accumulates into a shard, so it would not run them; torch's FSDP2 runs them here too."""
        reduced = reducing.wait()
        if reducing.post_divide != 1:
            reduced.div_(reducing.post_divide)
        reduced = reduced.split([s.numel() for s in self.shards])
        for shard, piece in zip(self.shards, reduced):
            if shard.grad is None:
                shard.grad = piece.to(shard.dtype)
            else:
                shard.grad += piece
            for hook in (getattr(shard, "_post_accumulate_grad_hooks", None) or {}).values():
                hook(shard)

    def unshard(self, piece: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """One tensor cut like a shard (an optimizer state, say), gathered to `shape`."""
        gathered = piece.new_empty(self.world_size * piece.numel())
        work = collectives.all_gather_into_tensor(
            gathered, piece.contiguous(), self.group, async_op=True
        )
        what = f"all-gather of a state of {self.name} ({gathered.nbytes:,} bytes)"
        wait_for(work.get_future(), what, self.group)
        return gathered[: shape.numel()].reshape(shape).clone()

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        return cut(full, dist.get_rank(self.group), self.world_size)

    @staticmethod
    def free(full: list[torch.Tensor]) -> None:
        for tensor in full:
            tensor.untyped_storage().resize_(0)

    @staticmethod
    def is_freed(full: list[torch.Tensor]) -> bool:
        return not all(tensor.untyped_storage().nbytes() for tensor in full)

    @staticmethod
    def refill(full: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Put gathered values back into the tensors autograd saved: same objects, their
        storage back."""
        for tensor, value in zip(full, values):
            tensor.untyped_storage().resize_(value.untyped_storage().nbytes())
            tensor.data.copy_(value)  # .data: autograd need not see the refill

    def hold_full(self, full: list[torch.Tensor]) -> None:
        """The modules compute with `full` (gathered, or refilled for backward)."""
        self._place(full)
        self.sharded_state = ShardedState.UNSHARDED

    def hold_shards(self) -> None:
        """The modules hold the shards again: what the optimizer steps and a state dict saves."""
        self._place(self.shards)
        self.sharded_state = ShardedState.SHARDED

    def _place(self, tensors: list[torch.Tensor]) -> None:
        for places, tensor in zip(self.places, tensors):
            for module, name in places:
                module._parameters[name] = tensor


def cut(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s piece of `full`: flattened, padded with zeros to W·ceil(n/W), chunk r."""
    chunk = -(-full.numel() // world)
    padded = full.new_zeros(world * chunk)
    padded[: full.numel()] = full.reshape(-1)
    return padded[rank * chunk :][:chunk].clone()


def float16_divide_factors(world_size: int) -> tuple[float, float]:
    """How a float16 average over W ranks divides: by `pre` before the sum, `post` after.

    fp16's largest value is 65504, and the loss scaler pushes gradients up towards it: a sum of
    W of them may overflow where their average would not, and dividing each by W first may
    underflow the small ones. So, as torch's FSDP2 does (and with its factors, to give its
    bits), divide by about sqrt(W) on each side: pre doubles while it divides W and W / pre
    exceeds it; post = W / pre. At W = 2: pre 2, post 1; at W = 8: pre 4, post 2."""
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre
