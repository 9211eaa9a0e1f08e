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

HSDP, as torch's: `fully_shard(block, mesh=mesh)` with a 2-D mesh ("replicate", "shard")
shards each parameter over the shard dim only (a node, say) and keeps one copy of the model per
replica (one per node). Gathers stay inside a shard group; each reduce-scatter is followed by an
all-reduce of the 1/S shard over the replicas, the only traffic between them:

    per rank and step   3(S-1)/S·Ψ inside the shard group   +   2(R-1)/R·Ψ/S across replicas

against ZeRO-3 over all N = R·S ranks, whose every collective is a ring through every node:
R of its N hops cross between nodes, each carrying 3(N-1)/N·Ψ. Memory: 1/S of the model per
rank, not 1/N. Chapter 11b measures both.

With `mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)` the shards stay fp32 and the
rest is bf16: mixed_precision.py says where each dtype lives.

Without gradient sync (`set_requires_gradient_sync(False)`), each backward adds the module's
full gradients into a buffer it keeps, as FSDP2 does: accumulation costs no communication, but
holds those full-size gradients until the next synced backward reduce-scatters the total.

A module called twice in one forward does all of this once per call (its shard's gradient is
then the sum of two averages, equal to DDP's within rounding, not bit for bit).

Each collective is issued ahead and waited for later, so that communication overlaps compute:
prefetch.py says what runs beside what. How a unit is cut into shards, and its collectives:
sharded_parameters.py.

Communication per step, per rank: 3(W-1)/W·Ψ (two all-gathers and a reduce-scatter), 1.5 times
DDP's all-reduce; and the unit's number, riding in each all-gather's own messages: each of the
W-1 a rank sends is led by it, 8 bytes (units.py; no collective of its own, no round trip
more). A unit skipped on one rank (a branch in the forward) would pair two units' gathers,
which gloo answers by aborting the process, or, when the sizes match, by mixing their
parameters; with the numbers every rank names both units instead.

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
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

import miniddp.collectives as collectives
from miniddp.job.env import HOW_TO_LAUNCH
from miniddp.job.faults import wait_for
from miniddp.mesh import DeviceMesh
from miniddp.placement import DataShard, carry_over, mark
from miniddp.same_model import verify_same_model_on_every_rank
from miniddp.sharding.mixed_precision import MixedPrecisionPolicy, refuse_a_child_in_another_dtype
from miniddp.sharding.prefetch import Prefetcher
from miniddp.sharding.sharded_parameters import ShardedParameters, cut
from miniddp.sharding.units import (
    next_number,
    refuse_outside_its_unit,
    refuse_what_would_shard_wrongly,
    register,
)


class _Unshard(torch.autograd.Function):
    """Forward: shards -> full parameters. Backward: full gradients -> a reduce-scatter that
    adds this rank's shard of their average into each shard's .grad (or, without gradient sync,
    the full gradients held back until a step that syncs)."""

    @staticmethod
    def forward(
        ctx: Any, state: ShardedParameters, prefetcher: Prefetcher, anchor: torch.Tensor
    ) -> tuple:
        ctx.state, ctx.prefetcher = state, prefetcher
        full = prefetcher.unshard_for_forward(state)
        ctx.save_for_backward(*full)  # to free them after backward, even if called again since
        return tuple(full)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        state: ShardedParameters = ctx.state
        state.hold_shards()  # what the optimizer steps, outside forward and backward
        state.free(list(ctx.saved_tensors))
        grads = tuple(g.to(state.gradient_dtype) for g in grads)  # FSDP2 accumulates in it too
        if state.accumulated is not None:
            grads = tuple(g + held for g, held in zip(grads, state.accumulated))
        if state.requires_gradient_sync:
            state.accumulated = None
            ctx.prefetcher.reduce_after_backward(state, list(grads))  # it fills the .grads
        else:
            state.accumulated = list(grads)
        return None, None, None


class FullyShardedModule:
    """Mixed into a module's class by fully_shard, as FSDP2 does, for the methods below."""

    _sharded: ShardedParameters | None
    _mp_policy: MixedPrecisionPolicy  # even a unit with no parameters casts inputs and outputs
    _prefetcher: Prefetcher  # its root's: set again when an ancestor is sharded

    def set_requires_gradient_sync(self, requires: bool, *, recurse: bool = True) -> None:
        """False: backward keeps full gradients locally, summed, with no communication; the
        next backward with True reduce-scatters the total (like DDP's no_sync)."""
        modules = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        for module in modules:
            if getattr(module, "_sharded", None) is not None:
                module._sharded.requires_gradient_sync = requires

    def set_gradient_divide_factor(self, factor: float) -> None:
        """torch's: this unit's gradients are summed over the ranks (replicas too, under HSDP)
        and divided by `factor`, not averaged. Expert parallelism's experts need it: their
        gradient holds the tokens of a whole ep group already (parallelize_experts.py)."""
        self._own_unit("backward").gradient_divide_factor = float(factor)

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """torch's: once this unit has its parameters in forward, issue these units' gathers,
        in this order, instead of the next unit's in the previous forward's order."""
        self._own_unit("forward").forward_prefetch = _units_of(modules)

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """torch's: the same in backward, instead of the next unit in the reversed order."""
        self._own_unit("backward").backward_prefetch = _units_of(modules)

    def set_prefetch(self, enabled: bool) -> None:
        """Called on the root: False waits for every collective at once (no overlap), the
        benchmark's baseline. On by default."""
        self._prefetcher.enabled = enabled

    def _own_unit(self, phase: str) -> ShardedParameters:
        if self._sharded is None:
            raise ValueError(
                f"{type(self).__name__} holds no parameters of its own: it gathers nothing in "
                f"{phase}, so no prefetch can follow its gather. Set it on a unit that does."
            )
        return self._sharded


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    process_group: dist.ProcessGroup | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Shard `module`'s parameters that no fully_shard'ed submodule already manages; returns
    `module`, whose class gains FullyShardedModule's methods.

    Over `process_group` (None: the whole job), or, as torch's, over `mesh`: a 1-D mesh shards
    over its one axis; a 2-D mesh is HSDP, dim 0 replicating and dim 1 sharding, whatever their
    names. `mp_policy`: see mixed_precision.py (None: compute in the parameters' own dtype)."""
    if not dist.is_initialized():
        raise RuntimeError(f"fully_shard needs a process group. {HOW_TO_LAUNCH}")
    if mesh is not None:
        process_group, replicas = _shard_and_replicate_groups(mesh, process_group)
    else:
        replicas = None
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
    if replicas is not None:  # the replicas must agree too: they average their gradients
        verify_same_model_on_every_rank(named, settings, replicas)
    shards = [_shard(param, process_group, replicas) for param in params.values()]
    number = next_number(process_group)
    names = ", ".join(dict.fromkeys(name for p in places.values() for _, name in p))
    sharded = ShardedParameters(
        number=number,
        name=f"fully_shard unit {number} ({type(module).__name__}: {names})",
        places=list(places.values()),
        shapes=[p.shape for p in params.values()],
        shards=shards,
        group=process_group,
        replicas=replicas,
        reshard_after_forward=reshard_after_forward,
        policy=policy,
    )
    _refuse_children_in_another_dtype(module, sharded if shards else None)
    sharded.originals.update(dict.fromkeys(params.values()))
    register(sharded)
    for original, shard in zip(params.values(), shards, strict=True):
        carry_over(original, shard)  # a shard of a TP shard stays one (FSDP x TP), and a stage's
        mark(shard, data=DataShard(process_group))  # then: a piece per rank of the group
    sharded.hold_shards()
    module._sharded = sharded if shards else None
    module._mp_policy = policy
    prefetcher = Prefetcher(root=module)  # the root's, until an ancestor is sharded too
    for unit in [module, *_units_below(module)]:
        unit._prefetcher = prefetcher
    module.register_forward_pre_hook(_before_forward, with_kwargs=True)
    module.register_forward_hook(_after_forward)
    for owner in dict.fromkeys(o for p in places.values() for o, _ in p if o is not module):
        owner.register_forward_pre_hook(functools.partial(refuse_outside_its_unit, sharded))
    cls = type(module)
    module.__class__ = type(f"FullyShard{cls.__name__}", (FullyShardedModule, cls), {})
    return module


def _shard_and_replicate_groups(
    mesh: DeviceMesh, process_group: dist.ProcessGroup | None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """The group to shard over and the group of replicas (None: plain FSDP), as torch's
    fully_shard reads a mesh. Refused alike on every rank (they hold the same mesh), before
    any collective."""
    if process_group is not None:
        raise ValueError(
            "fully_shard takes a mesh or a process_group, not both: the mesh names the groups "
            "itself (a 1-D mesh's one axis, or a 2-D mesh's dim 1 to shard over)."
        )
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            "fully_shard's mesh must be a miniddp.mesh.init_device_mesh mesh (the same call as "
            f"torch's, whose groups MiniDDP's collectives run on); got {type(mesh).__name__}"
        )
    if mesh.ndim == 1:
        return mesh.get_group(), None
    if mesh.ndim == 2:
        replicas = mesh.get_group(0)
        return mesh.get_group(1), replicas if dist.get_world_size(replicas) > 1 else None
    raise ValueError(
        f"fully_shard takes a 1-D mesh (it shards over it) or a 2-D mesh (HSDP: dim 0 "
        f"replicates, dim 1 shards), as torch's does; got {mesh.ndim} axes "
        f"{mesh.mesh_dim_names}. Pass the two data-parallel axes, e.g. "
        f"mesh[({mesh.mesh_dim_names[0]!r}, {mesh.mesh_dim_names[1]!r})]."
    )


def _shard(
    param: torch.Tensor, group: dist.ProcessGroup | None, replicas: dist.ProcessGroup | None
) -> nn.Parameter:
    """This rank's piece of rank 0's values of `param` (rank 0's, as DDP does): under HSDP,
    the first replica's rank 0's, broadcast over the replicas first, then over the shards."""
    if param.device.type == "meta" or not param.dtype.is_floating_point:
        raise ValueError(
            f"fully_shard shards floating-point CPU parameters; got {param.dtype} on {param.device}"
        )
    full = param.detach().clone()
    for over in [replicas, group] if replicas is not None else [group]:
        source = dist.get_global_rank(over or dist.group.WORLD, 0)
        work = collectives.broadcast(full, src=source, group=over, async_op=True)
        what = f"broadcast of rank 0's {tuple(full.shape)} parameter (fully_shard)"
        wait_for(work.get_future(), what, over)
    piece = cut(full, dist.get_rank(group), dist.get_world_size(group))
    return nn.Parameter(piece, param.requires_grad)


def _own_modules(module: nn.Module) -> list[nn.Module]:
    """`module` and its submodules, except those under a fully_shard'ed submodule."""
    found = [module]
    for child in module.children():
        if not isinstance(child, FullyShardedModule):
            found += _own_modules(child)
    return found


def _units_below(module: nn.Module) -> list[nn.Module]:
    return [sub for sub in module.modules() if isinstance(sub, FullyShardedModule)]


def _units_of(modules: list[nn.Module]) -> list[ShardedParameters]:
    if not all(isinstance(m, FullyShardedModule) and m._sharded is not None for m in modules):
        raise ValueError(
            "prefetch lists name fully_shard'ed modules that hold parameters of their own; got "
            f"{[type(m).__name__ for m in modules]}"
        )
    return [m._sharded for m in modules]


def _refuse_children_in_another_dtype(module: nn.Module, unit: ShardedParameters | None) -> None:
    """Every fully_shard'ed child directly under `module` must compute in its dtype, or convert
    at its edges (mixed_precision.refuse_a_child_in_another_dtype says why)."""
    children = [c for owner in _own_modules(module) for c in owner.children()]
    for child in dict.fromkeys(c for c in children if isinstance(c, FullyShardedModule)):
        if unit is not None and child._sharded is not None:
            refuse_a_child_in_another_dtype(unit, child._sharded)


def _before_forward(module: nn.Module, args: Any, kwargs: dict) -> tuple[Any, dict] | None:
    state: ShardedParameters | None = module._sharded
    prefetcher: Prefetcher = module._prefetcher
    if prefetcher.root is module:
        prefetcher.begin_forward()
    if state is not None:
        state.full = list(_Unshard.apply(state, prefetcher, _anchor(state)))
        state.hold_full(state.full)
    return module._mp_policy.cast_inputs(args, kwargs)


def _anchor(state: ShardedParameters) -> torch.Tensor:
    """What ties a unit's full parameters into autograd's graph, so that _Unshard.backward
    runs: an empty leaf, not the shards. Autograd then never visits the shards (the Prefetcher
    writes their .grad), so it never runs their post-accumulate-grad hooks early, before their
    gradient exists; finish_reduce_scatter runs them once it does, as FSDP2 does."""
    return torch.empty(0, requires_grad=any(shard.requires_grad for shard in state.shards))


def _after_forward(module: nn.Module, args: Any, output: Any) -> Any:
    state: ShardedParameters | None = module._sharded
    prefetcher: Prefetcher = module._prefetcher
    if state is not None:
        prefetcher.after_forward(state)
        _free_or_wait_for_backward(state, prefetcher, output)
    if prefetcher.root is module:
        prefetcher.end_forward()
    return module._mp_policy.cast_output(output)


def _free_or_wait_for_backward(
    state: ShardedParameters, prefetcher: Prefetcher, output: Any
) -> None:
    state.hold_shards()
    full = state.full  # this call's: a module called twice has one set per call
    waiting = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
    if not waiting or not torch.is_grad_enabled():
        state.free(full)
        return
    if state.reshard_after_forward:
        state.free(full)

    def before_backward(_: Any) -> None:
        # Full parameters back in the module for its backward: a checkpointed block's
        # recompute calls its forward again, which must find them there (_Unshard.backward
        # puts the shards back).
        prefetcher.unshard_for_backward(state, full)
        state.hold_full(full)

    torch.autograd.graph.register_multi_grad_hook(waiting, before_backward, mode="any")
