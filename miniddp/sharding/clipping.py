"""Gradient clipping across shards: the one place where sharding stops being invisible.

`torch.nn.utils.clip_grad_norm_(params, max_norm)` computes the norm of the gradients it is
given and scales them by min(1, max_norm / norm). Under DDP and ZeRO-1 every rank holds every
averaged gradient, so each rank computes the true norm, and all clip alike. Under ZeRO-2
(`reduce_scatter_hook`) a rank holds only the gradients it owns, and under `fully_shard` only its
shard of each: each rank computes the norm of *its part*, clips by a factor of its own, and the
replicas drift apart while nothing complains.

The true norm is a sum over ranks. For p < inf,

    ||g||_p = ( sum over ranks r of  sum over the gradients r holds alone of  ||g_i||_p^p )^(1/p)

so each rank computes the p-th power of its part's norm, one all-reduce adds them, and the
p-th root is taken on every rank: the same total, the same factor, everywhere. For p = inf the
all-reduce takes the maximum instead. Gradients that every rank holds (DDP's, or parameters no
sharding stage manages) must be counted once, not W times: their part is computed locally, the
same on every rank, and added after the all-reduce. Under ZeRO-1, where the gradients are
replicated but each parameter has an owner, each is counted on its owner only (the same sum).

    loss.backward()
    miniddp.sharding.clip_grad_norm_(model.parameters(), max_norm=1.0)   # the true norm
    optimizer.step()

Same signature and return value as torch's (its ZeRO and FSDP1 offered a `clip_grad_norm_`
method for the same reason). A model that no sharding stage touched costs no communication,
and the result is torch's `clip_grad_norm_` bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from miniddp.job.faults import wait_for


@dataclass(frozen=True)
class Spread:
    """How a parameter's gradient is spread over the ranks of `group`: held by `owner` alone
    (ZeRO), or, with owner None, each rank holding a different piece (a fully_shard shard)."""

    group: dist.ProcessGroup | None
    owner: int | None = None

    def counted_here(self) -> bool:
        return self.owner is None or self.owner == dist.get_rank(self.group)


_SPREAD: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> its Spread


def mark_spread(param: torch.Tensor, spread: Spread) -> None:
    """Called by the sharding stages for every parameter they manage."""
    _SPREAD[param] = spread


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of `parameters` by their total norm over every rank, and return that
    norm (the same tensor on every rank). Under ZeRO-2 or fully_shard a collective: call it on
    every rank, with the same parameters."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm_type = float(norm_type)
    spread = [(p, _SPREAD[p]) for p in params if p in _SPREAD]
    replicated = [p.grad for p in params if p not in _SPREAD and p.grad is not None]
    if not spread:
        total = torch.nn.utils.get_total_norm(replicated, norm_type, error_if_nonfinite, foreach)
    else:
        total = _total_over_ranks(spread, replicated, norm_type, foreach)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} of the gradients is non-finite ({total}), "
                "so it cannot clip them. Pass error_if_nonfinite=False to clip anyway."
            )
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total


def _total_over_ranks(
    spread: list[tuple[torch.Tensor, Spread]],
    replicated: list[torch.Tensor],
    norm_type: float,
    foreach: bool | None,
) -> torch.Tensor:
    groups = {id(s.group): s.group for _, s in spread}
    if len(groups) > 1:
        raise ValueError(
            "clip_grad_norm_ got parameters sharded over different process groups; clip each "
            "group's parameters separately, or shard them over one group"
        )
    [group] = groups.values()
    mine = [p.grad for p, s in spread if p.grad is not None and s.counted_here()]
    like = spread[0][0]  # the same on every rank: the all-reduce needs one dtype everywhere
    local = _norm(mine, norm_type, foreach, like)
    kept = _norm(replicated, norm_type, foreach, like)
    if math.isinf(norm_type):
        reduce = dist.ReduceOp.MAX
    else:
        local, kept = local.pow(norm_type), kept.pow(norm_type)
        reduce = dist.ReduceOp.SUM
    wait_for(
        dist.all_reduce(local, op=reduce, group=group, async_op=True),
        f"all-reduce of the gradients' norm of order {norm_type:g} (clip_grad_norm_)",
        group,
    )
    if math.isinf(norm_type):
        return torch.maximum(local, kept)
    return (local + kept).pow(1.0 / norm_type)


def _norm(
    grads: list[torch.Tensor], norm_type: float, foreach: bool | None, like: torch.Tensor
) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=like.dtype, device=like.device)
    return torch.nn.utils.get_total_norm(grads, norm_type, False, foreach).to(like.dtype)
