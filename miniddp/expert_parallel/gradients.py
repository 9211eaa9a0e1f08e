"""Expert parallelism beside data parallelism: which gradients are summed over which ranks.

On a (dp, ep) mesh every rank routes its own tokens, and each expert lives on dp ranks, one in
each ep group. After backward:

    a replicated parameter (the router, anything outside the experts) has on each rank the
        gradient of that rank's tokens only: the whole batch's is the sum over all dp x ep ranks
    an expert weight already has the gradient of every token its ep group sent it (the
        combine's all-to-all brought their gradients home); what is missing are the other ep
        groups' tokens, held by the ranks with the same experts: the sum over the
        expert-data-parallel group (mesh["dp"], the ranks that differ only in dp)

Summing over the ep group instead would add different experts' gradients together, and
summing over all ranks would count each token's expert gradient in the wrong place.

The convention is the sum's: each rank's loss is its share of the whole batch's, its tokens'
losses divided by the whole batch's token count (not its own), and the MoE's aux_loss is already
a share (router.py). Then the sums are one process's gradients on the whole batch.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from miniddp.collectives import all_reduce
from miniddp.expert_parallel.experts import GroupedExperts


def all_reduce_gradients(
    model: nn.Module,
    *,
    data_parallel_group: dist.ProcessGroup | None,
    expert_data_parallel_group: dist.ProcessGroup | None,
) -> None:
    """Sum the experts' gradients over `expert_data_parallel_group` and every other gradient
    over `data_parallel_group` (every rank that routes: dp x ep), in place."""
    experts = {
        id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()
    }
    for param in model.parameters():
        if param.grad is not None:
            expert = id(param) in experts
            group = expert_data_parallel_group if expert else data_parallel_group
            all_reduce(param.grad, group=group)
