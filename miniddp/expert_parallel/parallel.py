"""Expert parallelism: each rank of the group holds E/ep of the experts, and the tokens travel.

    parallelize_module(moe.experts, mesh["ep"], ExpertParallel())   # or a process group
    # (miniddp.tensor_parallel's parallelize_module: any object with this `apply` is a style)

Each of the ep ranks keeps `torch.chunk(w, ep, 0)[rank]` of w1, w2 and w3: experts
[rank E/ep, (rank+1) E/ep). Every rank routes its own tokens, and the router stays whole on
every rank (a replica). A forward then goes (Lepikhin et al. 2020, GShard):

    1. count      this rank's rows for each of the E experts (sorted by expert already, so the
                  rows for rank d are one contiguous piece: d's experts' rows)
    2. exchange   the counts, by an all-to-all of E/ep numbers to each rank: now every rank
                  knows how many rows each rank will send each of its experts
    3. dispatch   the all-to-all of the rows (uneven pieces, some empty)
    4. compute    regroup what arrived (from rank 0 expert 0, rank 0 expert 1, ... rank 1 expert
                  0 ...) by expert, then by source rank, and run the local experts
    5. combine    undo the regrouping, and all-to-all the outputs back to where the rows came
                  from; MoE (moe.py) weighs them by the router's weights

Both all-to-alls are `all_to_all_single_autograd`, so backward runs them in reverse: the
gradient of the combine is the dispatch's all-to-all, and the dispatch's the combine's.

Dropless, it is one process applying the same MoE to the whole batch (the ranks' tokens in rank
order), bit for bit: each expert sees the same rows in the same order (source rank, then token)
and runs the same matmul on them, so its output and its weights' gradients are the same bits.
The router's gradient is each rank's part of the sum over the whole batch: summed over ranks it
is one process's within rounding (a sum in another order).

A hazard of this CPU, which the tests respect: a matmul of fewer than 4 rows is not bit for bit
the same rows inside a larger one (measured at every inner dimension from 16 to 512; the issue
saw 1 row at 256 and above elsewhere). It bites where the rows a matmul sees differ between the
two settings: the router's gate, which sees this rank's N tokens here and the whole batch on one
process (so keep N >= 4 per rank to compare bits), and capacity per group below. The experts
never: they see the same rows in both.

Capacity applies to each rank's own tokens, before the dispatch, as DeepSpeed's MoE does: with
factor c, rank r lets each expert take ceil(c N_r k / E) of its rows. So it equals one process
applying the MoE to each rank's tokens in turn (capacity per group), and a rank needs nobody's
counts to decide what to drop. A global capacity, ceil(c N k / E) per expert shared by all the
ranks, would drop fewer: a rank that crowds an expert could use the slots other ranks left
empty, where per rank each rank's overflow is dropped however empty the expert is elsewhere
(the issue's field check measured up to 15 more drops per rank at W = 2). It would also need
every rank's counts, and an order across ranks, before any rank could drop a row.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from miniddp.collectives import all_to_all_single, all_to_all_single_autograd
from miniddp.expert_parallel.experts import Compute, GroupedExperts, LocalDispatch
from miniddp.job.env import size_and_rank_in
from miniddp.placement import TensorShard, mark


class AllToAllDispatch:
    """Steps 1 to 5 of the module docstring, over `group`, for `local` experts a rank."""

    def __init__(self, group: dist.ProcessGroup, local: int) -> None:
        self.group, self.local = group, local
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def __call__(self, compute: Compute, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        received = torch.empty_like(counts)
        all_to_all_single(received, counts, group=self.group)  # 2. exchange the counts
        received = received.view(self.size, self.local)  # [source rank, local expert]
        sends = counts.view(self.size, self.local).sum(1).tolist()
        arrives = received.sum(1).tolist()
        arrived = all_to_all_single_autograd(rows, arrives, sends, self.group)  # 3. dispatch
        source = torch.arange(self.size, device=counts.device).repeat_interleave(received.sum(1))
        expert = torch.arange(self.local, device=counts.device).repeat(self.size)
        expert = expert.repeat_interleave(received.view(-1))
        by_expert = torch.argsort(expert * self.size + source, stable=True)  # 4. regroup
        outputs = compute(arrived[by_expert], received.sum(0))
        back = outputs[torch.argsort(by_expert)]
        return all_to_all_single_autograd(back, sends, arrives, self.group)  # 5. combine


class ExpertParallel:
    """Keep this rank's E/ep experts of a GroupedExperts, and dispatch to the group's ranks
    (torchtitan's name). A style of miniddp.tensor_parallel's `parallelize_module`."""

    def apply(self, module: nn.Module, group: dist.ProcessGroup | None, name: str) -> nn.Module:
        size, rank = size_and_rank_in(
            group, "expert-parallel", 'give each rank its own group, e.g. mesh["ep"]'
        )
        if not isinstance(module, GroupedExperts):
            raise TypeError(
                f"ExpertParallel splits a GroupedExperts (an MoE's .experts), but "
                f"{name or 'the module'} is a {type(module).__name__}"
            )
        if not isinstance(module.dispatch, LocalDispatch):
            raise ValueError(f"{name or 'the module'} is already expert-parallel")
        if module.num_experts % size:
            raise ValueError(
                f"{module.num_experts} experts cannot be split evenly over {size} "
                f"expert-parallel ranks: choose a number of experts that {size} divides, or an "
                f"ep group whose size divides {module.num_experts}"
            )
        group = group if group is not None else dist.group.WORLD
        for role in ("w1", "w2", "w3"):
            full = getattr(module, role)
            shard = nn.Parameter(torch.chunk(full.detach(), size, 0)[rank].clone())
            # chunk(full, ep, 0)[rank], for checkpoints and clipping, as a TP shard is, but
            # along the expert axis: the experts are replicated over tp
            mark(shard, tensor=TensorShard(group, 0, axis="expert"))
            setattr(module, role, shard)
        module.dispatch = AllToAllDispatch(group, module.num_experts // size)
        return module

    def __repr__(self) -> str:
        return "ExpertParallel()"
