"""ZeRO-3, fully sharded data parallelism: every rank stores 1/W of each parameter, its gradient
and its optimizer state, and a full parameter exists only while its module computes.

    for block in model.blocks:
        miniddp.fully_shard(block)       # as FSDP2: the submodules first,
    miniddp.fully_shard(model)           # then the root, for what is left
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)   # steps the shards

The life of a sharded module's parameters in one step, on MiniDDP's ring collectives:

    before forward    all-gather the shards into full parameters (the module computes as usual)
    after forward     free the full parameters (reshard_after_forward=True): autograd keeps
                      only their now-empty tensors
    before backward   when the first gradient reaches the module's output, all-gather again
                      into those same tensors
    after backward    reduce-scatter the full gradients with ReduceOp.AVG (a sum, then one
                      division by W, as torch's FSDP2 on gloo), so that rank r keeps the average
                      of shard r; free the full parameters

With `mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)` the shards stay fp32 and the
rest is bf16: mixed_precision.py says where each dtype lives.

Without gradient sync (`set_requires_gradient_sync(False)`), each backward adds the module's
full gradients into a buffer it keeps, as FSDP2 does: accumulation costs no communication, but
holds those full-size gradients until the next synced backward reduce-scatters the total.

A module called twice in one forward does all of this once per call (its shard's gradient is
then the sum of two averages, equal to DDP's within rounding, not bit for bit).

Sharding: a parameter of n elements is flattened and cut into W chunks of ceil(n/W), the last
padded with zeros, so every rank's piece has the same length (a collective needs that). Rank
r's chunk is `module.<name>`: a 1-D Parameter the optimizer steps. Padding stays zero (its
gradient is zero, so Adam leaves it alone); the benchmark states its cost.

Communication per step, per rank: 3(W-1)/W·Ψ (two all-gathers and a reduce-scatter), 1.5 times
DDP's all-reduce; and before each all-gather, 8 bytes to every other rank, the unit's number: a
unit skipped on one rank (a branch in the forward) would pair two units' gathers, which gloo
answers by aborting the process, or, when the sizes match, by mixing their parameters.

Bitwise torch's fully_shard at W = 2, where every sum is a + b = b + a. With more ranks, the
ring adds chunk c's terms in an order set by c, as gloo's does, but torch cuts a parameter by
rows where we cut it flat, so an element may sit in another chunk, summed in another order:
within rounding. Unless the sum is exact, as bf16 gradients reduced in fp32 are (their 8-bit
mantissas fit in fp32's 24): then bit for bit at any W, because we divide once, after the sum,
as gloo's AVG does. DDP multiplies each gradient by 1/W before its sum instead: the same bits
at W = 2 (1/2 is exact), within rounding at W >= 3.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

import miniddp.collectives as collectives
from miniddp.job.env import HOW_TO_LAUNCH
from miniddp.job.faults import wait_for
from miniddp.placement import DataShard, carry_over, mark
from miniddp.same_model import verify_same_model_on_every_rank
from miniddp.sharding.mixed_precision import MixedPrecisionPolicy, refuse_a_child_in_another_dtype
from miniddp.sharding.units import (
    check_every_rank_gathers,
    next_number,
    refuse_outside_its_unit,
    refuse_what_would_shard_wrongly,
    register,
)


@dataclass
class ShardedParameters:
    """What one fully_shard call manages: its parameters' places, shapes and shards."""

    number: int  # the how-manieth fully_shard call over this group: the same on its every rank
    name: str  # "fully_shard unit 2 (Linear: weight, bias)": what errors call it
    places: list[list[tuple[nn.Module, str]]]  # per parameter: (module, attribute) it lives at
    shapes: list[torch.Size]
    shards: list[nn.Parameter]
    group: dist.ProcessGroup | None
    reshard_after_forward: bool
    policy: MixedPrecisionPolicy
    originals: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # unsharded
    gathered: bool = False  # between the unit's forward pre-hook and its forward hook
    full: list[torch.Tensor] = field(default_factory=list)  # the latest forward's, unsharded
    requires_gradient_sync: bool = True
    accumulated: list[torch.Tensor] | None = None  # full gradients held back by no sync

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.policy.compute_dtype(self.shards[0].dtype)

    @property
    def gradient_dtype(self) -> torch.dtype:
        return self.policy.gradient_dtype(self.shards[0].dtype)

    def gather(self, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """All-gather every shard; one full tensor per parameter (one collective for all), in
        `dtype`: by default the compute dtype (mixed_precision.py)."""
        check_every_rank_gathers(self)
        world, length = self.world_size, sum(s.numel() for s in self.shards)
        dtype, device = dtype or self.compute_dtype, self.shards[0].device
        gathered = torch.empty(world * length, dtype=dtype, device=device)
        mine = torch.cat([s.detach().to(dtype) for s in self.shards])  # cast before the gather
        work = collectives.all_gather_into_tensor(gathered, mine, self.group, async_op=True)
        wait_for(
            work.get_future(), f"all-gather of {self.name} ({gathered.nbytes:,} bytes)", self.group
        )
        rows, full, offset = gathered.view(world, length), [], 0
        for shard, shape in zip(self.shards, self.shapes):
            columns = rows[:, offset : offset + shard.numel()]
            full.append(columns.reshape(-1)[: shape.numel()].reshape(shape).clone())
            offset += shard.numel()
        return full

    def gather_masters(self) -> list[torch.Tensor]:
        """The full parameters in their masters' dtypes, for a state dict: gathered in the
        widest of those dtypes, so that casting each back is exact."""
        widest = functools.reduce(torch.promote_types, (s.dtype for s in self.shards))
        return [t.to(s.dtype) for t, s in zip(self.gather(widest), self.shards)]

    def reduce_scatter(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Rank r gets the average over ranks of chunk r of every gradient, in its shard's
        dtype. The gradients are in gradient_dtype already (see _Unshard.backward)."""
        world, length = self.world_size, sum(s.numel() for s in self.shards)
        pieces = torch.zeros(world, length, dtype=grads[0].dtype, device=grads[0].device)
        offset = 0
        for grad, shard in zip(grads, self.shards):
            padded = pieces.new_zeros(world * shard.numel())
            padded[: grad.numel()] = grad.reshape(-1)
            pieces[:, offset : offset + shard.numel()] = padded.view(world, shard.numel())
            offset += shard.numel()
        mine = pieces.new_empty(length)
        work = collectives.reduce_scatter_tensor(
            mine, pieces, op=dist.ReduceOp.AVG, group=self.group, async_op=True
        )
        what = f"reduce-scatter of {self.name}'s gradients ({pieces.nbytes:,} bytes)"
        wait_for(work.get_future(), what, self.group)
        reduced = mine.split([s.numel() for s in self.shards])
        return [piece.to(shard.dtype) for piece, shard in zip(reduced, self.shards)]

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

    def refill(self, full: list[torch.Tensor]) -> None:
        """Gather again into the tensors autograd saved: same objects, their storage back."""
        if all(tensor.untyped_storage().nbytes() for tensor in full):
            return  # never freed: reshard_after_forward=False
        for tensor, values in zip(full, self.gather()):
            tensor.untyped_storage().resize_(values.untyped_storage().nbytes())
            tensor.data.copy_(values)  # .data: autograd need not see the refill

    def place(self, tensors: list[torch.Tensor]) -> None:
        for places, tensor in zip(self.places, tensors):
            for module, name in places:
                module._parameters[name] = tensor


def cut(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s piece of `full`: flattened, padded with zeros to W·ceil(n/W), chunk r."""
    chunk = -(-full.numel() // world)
    padded = full.new_zeros(world * chunk)
    padded[: full.numel()] = full.reshape(-1)
    return padded[rank * chunk :][:chunk].clone()


class _Unshard(torch.autograd.Function):
    """Forward: shards -> full parameters. Backward: full gradients -> this rank's shard of
    their average (or, without gradient sync, held back until a step that syncs)."""

    @staticmethod
    def forward(ctx: Any, state: ShardedParameters, *shards: torch.Tensor) -> tuple:
        ctx.state = state
        full = state.gather()
        ctx.save_for_backward(*full)  # to free them after backward, even if called again since
        return tuple(full)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        state: ShardedParameters = ctx.state
        state.free(list(ctx.saved_tensors))
        grads = tuple(g.to(state.gradient_dtype) for g in grads)  # FSDP2 accumulates in it too
        if state.accumulated is not None:
            grads = tuple(g + held for g, held in zip(grads, state.accumulated))
        if not state.requires_gradient_sync:
            state.accumulated = list(grads)
            return (None, *[None] * len(grads))
        state.accumulated = None
        return (None, *state.reduce_scatter(list(grads)))


class FullyShardedModule:
    """Mixed into a module's class by fully_shard, as FSDP2 does, for the methods below."""

    _sharded: ShardedParameters | None
    _mp_policy: MixedPrecisionPolicy  # even a unit with no parameters casts inputs and outputs

    def set_requires_gradient_sync(self, requires: bool, *, recurse: bool = True) -> None:
        """False: backward keeps full gradients locally, summed, with no communication; the
        next backward with True reduce-scatters the total (like DDP's no_sync)."""
        modules = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        for module in modules:
            if getattr(module, "_sharded", None) is not None:
                module._sharded.requires_gradient_sync = requires


def fully_shard(
    module: nn.Module,
    *,
    process_group: dist.ProcessGroup | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Shard `module`'s parameters that no fully_shard'ed submodule already manages; returns
    `module`, whose class gains `set_requires_gradient_sync`. `mp_policy`: see
    mixed_precision.py (None: compute in the parameters' own dtype)."""
    if not dist.is_initialized():
        raise RuntimeError(f"fully_shard needs a process group. {HOW_TO_LAUNCH}")
    if isinstance(module, FullyShardedModule):
        raise ValueError(f"{type(module).__name__} is already fully sharded")
    policy = MixedPrecisionPolicy() if mp_policy is None else mp_policy
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mp_policy must be a miniddp.sharding.MixedPrecisionPolicy; got {type(policy)}"
        )
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    params: dict[int, torch.Tensor] = {}
    for owner in _own_modules(module):
        for name, param in owner._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((owner, name))
                params[id(param)] = param
    refuse_what_would_shard_wrongly(module, params, places)
    dtypes = {str(p.dtype) for p in params.values()}
    if len(dtypes) > 1 and policy.param_dtype is None:
        raise ValueError(
            f"fully_shard gathers a module's parameters in one flat tensor, so they need one "
            f"dtype; got {sorted(dtypes)}. Call fully_shard on the submodules of each dtype first, "
            "or give an mp_policy with a param_dtype, which they are all gathered in."
        )
    # Every rank must shard the same shapes, or the collectives below would not match: a clear
    # error on every rank instead of a hang.
    named = [
        (f"{type(where[0][0]).__name__}.{where[0][1]}", params[key])
        for key, where in places.items()
    ]
    settings = {"reshard_after_forward": reshard_after_forward, "mp_policy": str(policy)}
    verify_same_model_on_every_rank(named, settings, process_group)
    source = dist.get_global_rank(process_group or dist.group.WORLD, 0)
    world, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    shards = []
    for param in params.values():
        if param.device.type == "meta" or not param.dtype.is_floating_point:
            raise ValueError(
                f"fully_shard shards floating-point CPU parameters; got {param.dtype} on "
                f"{param.device}"
            )
        full = param.detach().clone()
        work = collectives.broadcast(full, src=source, group=process_group, async_op=True)
        wait_for(
            work.get_future(),
            f"broadcast of rank 0's {tuple(full.shape)} parameter (fully_shard)",
            process_group,
        )  # rank 0's values, as DDP does
        shards.append(nn.Parameter(cut(full, rank, world), param.requires_grad))
    number = next_number(process_group)
    names = ", ".join(dict.fromkeys(name for p in places.values() for _, name in p))
    sharded = ShardedParameters(
        number=number,
        name=f"fully_shard unit {number} ({type(module).__name__}: {names})",
        places=list(places.values()),
        shapes=[p.shape for p in params.values()],
        shards=shards,
        group=process_group,
        reshard_after_forward=reshard_after_forward,
        policy=policy,
    )
    _refuse_children_in_another_dtype(module, sharded if shards else None)
    sharded.originals.update(dict.fromkeys(params.values()))
    register(sharded)
    for original, shard in zip(params.values(), shards, strict=True):
        carry_over(original, shard)  # a shard of a TP shard stays one (FSDP x TP), and a stage's
        mark(shard, data=DataShard(process_group))  # then: a piece per rank of the group
    sharded.place(shards)
    module._sharded = sharded if shards else None
    module._mp_policy = policy
    module.register_forward_pre_hook(_before_forward, with_kwargs=True)
    module.register_forward_hook(_after_forward)
    for owner in dict.fromkeys(o for p in places.values() for o, _ in p if o is not module):
        owner.register_forward_pre_hook(functools.partial(refuse_outside_its_unit, sharded))
    cls = type(module)
    module.__class__ = type(f"FullyShard{cls.__name__}", (FullyShardedModule, cls), {})
    return module


def _own_modules(module: nn.Module) -> list[nn.Module]:
    """`module` and its submodules, except those under a fully_shard'ed submodule."""
    found = [module]
    for child in module.children():
        if not isinstance(child, FullyShardedModule):
            found += _own_modules(child)
    return found


def _refuse_children_in_another_dtype(module: nn.Module, unit: ShardedParameters | None) -> None:
    """Every fully_shard'ed child directly under `module` must compute in its dtype, or convert
    at its edges (mixed_precision.refuse_a_child_in_another_dtype says why)."""
    children = [c for owner in _own_modules(module) for c in owner.children()]
    for child in dict.fromkeys(c for c in children if isinstance(c, FullyShardedModule)):
        if unit is not None and child._sharded is not None:
            refuse_a_child_in_another_dtype(unit, child._sharded)


def _before_forward(module: nn.Module, args: Any, kwargs: dict) -> tuple[Any, dict] | None:
    state: ShardedParameters | None = module._sharded
    if state is not None:
        state.full = list(_Unshard.apply(state, *state.shards))
        state.place(state.full)
        state.gathered = True
    return module._mp_policy.cast_inputs(args, kwargs)


def _after_forward(module: nn.Module, args: Any, output: Any) -> Any:
    state: ShardedParameters | None = module._sharded
    if state is not None:
        _free_or_wait_for_backward(state, output)
    return module._mp_policy.cast_output(output)


def _free_or_wait_for_backward(state: ShardedParameters, output: Any) -> None:
    state.place(state.shards)
    state.gathered = False
    full = state.full  # this call's: a module called twice has one set per call
    waiting = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
    if not waiting or not torch.is_grad_enabled():
        state.free(full)
        return
    if state.reshard_after_forward:
        state.free(full)
    torch.autograd.graph.register_multi_grad_hook(waiting, lambda _: state.refill(full), mode="any")
