"""ZeRO-1: each rank keeps the optimizer state of its own share of the parameters, and only that.

Data parallelism keeps W identical copies of everything; Adam's two states (8 bytes per fp32
parameter element, twice the parameters themselves) are the largest of them. ZeRO stage 1
(Rajbhandari et al., 2020) notices that every rank computes the *same* update from the same
averaged gradients, so the update can be split: rank r steps only the parameters it owns,
keeping Adam states for those alone (8Ψ/W instead of 8Ψ), then every rank sends its updated
parameters to the others. Training is unchanged, bit for bit: Adam's update is elementwise,
so who computes an element does not change its value.

    optimizer = miniddp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)

Used exactly like torch.distributed.optim.ZeroRedundancyOptimizer, with its partition: within
each parameter group, parameters sorted by size (largest first, stable), each given to the rank
that owns the fewest elements so far (the lowest such rank on a tie). The updated parameters
travel in one all-gather of MiniDDP's ring (torch broadcasts each one): each rank's share,
flattened and padded to the largest share, so every rank sends (W-1)·max_share elements.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

import miniddp.collectives as collectives
from miniddp.job.env import HOW_TO_LAUNCH
from miniddp.job.faults import wait_for
from miniddp.job.meet import meet
from miniddp.placement import DataShard, mark
from miniddp.same_model import verify_same_model_on_every_rank


def partition(param_groups: list[dict[str, Any]], world_size: int) -> list[list[dict[str, Any]]]:
    """torch's sorted-greedy partition: for each rank, its copy of every group, holding only the
    parameters it owns. Balancing runs over all groups together."""
    per_rank: list[list[dict[str, Any]]] = [[] for _ in range(world_size)]
    owned = [0] * world_size
    for group in param_groups:
        mine: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        for param in sorted(group["params"], key=lambda p: p.numel(), reverse=True):
            rank = owned.index(min(owned))
            mine[rank].append(param)
            owned[rank] += param.numel()
        for rank, params in enumerate(mine):
            per_rank[rank].append({**group, "params": params})
    return per_rank


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Wrap `optimizer_class` so that each rank keeps and steps only its partition's state.

    `param_groups` lists every parameter (as torch's does: schedulers and `zero_grad` see the
    whole model); `optim` is this rank's local optimizer over its partition. `step()` runs the
    local step, then all-gathers the updated parameters. Call `consolidate_state_dict(to)` on
    every rank before `state_dict()` on rank `to`. Joinable, as torch's is: under
    `Join([model, optimizer])` a rank out of batches keeps stepping (see StepsWhileOthersTrain).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[Optimizer],
        *,
        process_group: dist.ProcessGroup | None = None,
        **defaults: Any,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(f"ZeroRedundancyOptimizer needs a process group. {HOW_TO_LAUNCH}")
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors or of parameter groups")
        params = list(params)
        if not params:
            raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
        self._initialized = False
        super().__init__(params, defaults)
        Joinable.__init__(self)
        self._check_one_kind()
        every = self._every_param()
        named = [(f"parameter {i}", p) for i, p in enumerate(every)]
        verify_same_model_on_every_rank(named, {"groups": len(self.param_groups)}, process_group)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.partition = partition(self.param_groups, self.world_size)
        self.optim = optimizer_class(self.partition[self.rank], **defaults)
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)
        self._all_state_dicts: dict[int, dict[str, Any]] | None = None
        self._remember_owners()
        self._initialized = True

    def _check_one_kind(self) -> None:
        every = self._every_param()
        kinds = {(p.dtype, p.device) for p in every}
        if len(kinds) > 1 or any(p.is_sparse for p in every):
            raise ValueError(
                f"ZeroRedundancyOptimizer needs every parameter dense, of one dtype on one "
                f"device (they travel in one flat tensor); got {sorted(map(str, kinds))}. Give "
                "each dtype its own ZeroRedundancyOptimizer."
            )

    def _remember_owners(self) -> None:
        """Who steps what; clip_grad_norm_ counts each gradient on its owner only."""
        self._owner = {}
        for rank, groups in enumerate(self.partition):
            for param in (p for g in groups for p in g["params"]):
                self._owner[id(param)] = rank
                mark(param, data=DataShard(self.process_group, owner=rank))

    def owner_of(self, param: torch.Tensor) -> int:
        """The group rank that steps `param` and keeps its state."""
        if id(param) not in self._owner:
            raise ValueError(
                f"a parameter of shape {tuple(param.shape)} was not given to this "
                "ZeroRedundancyOptimizer: build it over every parameter the DDP reduces"
            )
        return self._owner[id(param)]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, as torch's does: the partition is recomputed over every group, which
        leaves the earlier groups' parameters where they were (the greedy walks the groups in
        order, and the new group comes last), so only this rank's share of the new group joins
        its local optimizer. Call it on every rank, with the same group."""
        super().add_param_group(param_group)
        if not getattr(self, "_initialized", False):
            return  # Optimizer.__init__ adding the constructor's groups
        self._check_one_kind()
        self.partition = partition(self.param_groups, self.world_size)
        self.optim.add_param_group(self.partition[self.rank][-1])
        self._remember_owners()

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step this rank's partition, then share the updated parameters with every rank."""
        Join.notify_join_context(self)  # under Join: only its first joinable communicates
        _copy_hyperparameters(self.param_groups, self.optim.param_groups)  # a scheduler's lr
        loss = self.optim.step() if closure is None else self.optim.step(closure)
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)
        self._share_updated_parameters()
        return loss

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return StepsWhileOthersTrain(self)

    @property
    def join_device(self) -> torch.device:
        return self._every_param()[0].device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def _share_updated_parameters(self) -> None:
        """One all-gather: rank r's share, flattened, lands in slot r of everyone's buffer."""
        shares = [[p for g in groups for p in g["params"]] for groups in self.partition]
        longest = max(sum(p.numel() for p in share) for share in shares)
        like = self._every_param()[0]
        mine = torch.zeros(longest, dtype=like.dtype, device=like.device)
        if shares[self.rank]:
            mine[: sum(p.numel() for p in shares[self.rank])] = torch.cat(
                [p.detach().reshape(-1) for p in shares[self.rank]]
            )
        gathered = torch.empty(self.world_size * longest, dtype=like.dtype, device=like.device)
        work = collectives.all_gather_into_tensor(
            gathered, mine, group=self.process_group, async_op=True
        )
        what = f"all-gather of the updated parameters ({gathered.nbytes:,} bytes, ZeRO)"
        wait_for(work.get_future(), what, self.process_group)
        with torch.no_grad():
            for rank, share in enumerate(shares):
                if rank == self.rank or not share:
                    continue
                slot = gathered[rank * longest :]
                flats = slot[: sum(p.numel() for p in share)].split([p.numel() for p in share])
                torch._foreach_copy_(share, [f.view_as(p) for f, p in zip(flats, share)])

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's state on group rank `to` (call on every rank).

        The ranks meet first (miniddp/job/meet.py). `if rank == 0:
        optimizer.consolidate_state_dict()` is the natural slip, as each rank holds a share of
        the state: rank 0 would wait in the gather until the process group's timeout while the
        others waited in their next step. Now both sides raise `CollectiveFailed` at once,
        each naming what the other is doing."""
        advice = (
            f"Call optimizer.consolidate_state_dict(to={to}) on every rank, not only on the one "
            "that saves: each rank holds a share of the optimizer state."
        )
        meet("consolidate_state_dict()", advice, self.process_group)
        _copy_hyperparameters(self.param_groups, self.optim.param_groups)
        index_of = {id(p): i for i, p in enumerate(self._every_param())}
        local = {index_of[id(p)]: _to_cpu(s) for p, s in self.optim.state.items()}
        gathered: list[Any] | None = [None] * self.world_size if self.rank == to else None
        global_to = dist.get_global_rank(self.process_group or dist.group.WORLD, to)
        dist.gather_object(local, gathered, dst=global_to, group=self.process_group)
        self._all_state_dicts = None
        if gathered is not None:
            self._all_state_dicts = {i: s for shard in gathered for i, s in shard.items()}

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state, in a plain optimizer's format (parameters by index
        over all groups): what `torch.optim.AdamW(model.parameters()).state_dict()` holds."""
        if self._all_state_dicts is None:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. Call "
                f"consolidate_state_dict(to={self.rank}) on every rank first."
            )
        groups, start = [], 0
        for group in self.param_groups:
            indices = list(range(start, start + len(group["params"])))
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": indices})
            start += len(indices)
        return {"state": dict(sorted(self._all_state_dicts.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `state_dict()` on every rank; each keeps its own partition's state."""
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(
                f"the state dict has {len(state_dict['param_groups'])} parameter groups and "
                f"this optimizer {len(self.param_groups)}: it belongs to another setup"
            )
        _copy_hyperparameters(state_dict["param_groups"], self.param_groups)
        index_of = {id(p): i for i, p in enumerate(self._every_param())}
        local_groups, local_state, position = [], {}, 0
        for mine, group in zip(self.partition[self.rank], self.param_groups):
            indices = []
            for param in mine["params"]:
                if index_of[id(param)] in state_dict["state"]:
                    local_state[position] = copy.deepcopy(state_dict["state"][index_of[id(param)]])
                indices.append(position)
                position += 1
            settings = {k: v for k, v in group.items() if k != "params"}
            local_groups.append({**settings, "params": indices})
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})

    def _every_param(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]


class StepsWhileOthersTrain(JoinHook):
    """A joined rank's part in each step the others still take: its own step, with the
    gradients it last had, and so its share in the all-gather, as torch's ZeRO join hook does.
    (Put the DDP first in `Join([model, optimizer])`: its shadows come before the step.)"""

    def __init__(self, optimizer: ZeroRedundancyOptimizer) -> None:
        self.optimizer = optimizer

    def main_hook(self) -> None:
        self.optimizer.step()


def _copy_hyperparameters(source: list[dict[str, Any]], target: list[dict[str, Any]]) -> None:
    """Everything but the parameters: lr, betas, weight decay, ..."""
    for src, dst in zip(source, target):
        dst.update({k: v for k, v in src.items() if k != "params"})


def _to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in state.items()}
