"""DeepSpeed-MoE's layer configured as one of our MoEs, with its weights: the other implementation
`bench ep` times ours against and tests/test_expert_parallel_deepspeed.py checks ours against.

    deepspeed = deepspeed_on_gloo()       # None where it is not installed
    theirs = deepspeed_like(moe, ep_size)  # before ExpertParallel splits moe's experts
    y, l_aux, exp_counts = theirs(x)

Configured alike means every switch that would make it compute something else is off: no
Random Token Selection (use_rts=False), no Gumbel-sampled second expert
(top2_2nd_expert_sampling=False), no noise on the gate, no minimum capacity (min_capacity=0,
where DeepSpeed's default is 4), the same capacity factor in training and evaluation. What stays
different, and cannot be switched off, the test's docstring lists.

Its experts are a ModuleList of E/ep_size copies of one module (deepspeed.moe.experts.Experts):
`SwiGLU` below computes what one of our stacked experts computes, and the copies get our
expert weights, rank r of the ep group holding experts [r E/ep, (r+1) E/ep), as ExpertParallel
keeps them.

DeepSpeed's `init_distributed` JIT-compiles a shared-memory all-reduce on CPU (its
ShareMemCommBuilder), which had not finished after minutes on the shared 2-core machine this was
written on: `deepspeed_on_gloo` turns that op off, so DeepSpeed's collectives go to the gloo
process group already made, as ours do.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from miniddp.expert_parallel import MoE


class SwiGLU(nn.Module):
    """One expert as DeepSpeed takes it (a module it copies E/ep times): GroupedExperts' maths."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def deepspeed_on_gloo() -> ModuleType | None:
    """DeepSpeed imported for the CPU, its collectives on torch's process group (if one is made)
    without the shared-memory op (see above); None where it is not installed."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError:
        return None
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    if dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def deepspeed_like(moe: MoE, ep_size: int = 1) -> nn.Module:
    """DeepSpeed's MoE layer with `moe`'s router and (whole, not yet split) experts, its experts
    split over ep groups of `ep_size` ranks (DeepSpeed's groups: consecutive ranks)."""
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    if moe.top_k > 2:
        raise ValueError(f"DeepSpeed's MoE gates top-1 and top-2, not top-{moe.top_k}")
    if moe.capacity_factor is None:
        raise ValueError(
            "DeepSpeed's dropless mode (drop_tokens=False) is not configured here: give the MoE "
            "a capacity_factor"
        )
    experts = moe.experts
    if experts.w1.shape[0] != moe.num_experts:
        raise ValueError("deepspeed_like copies the whole experts: call it before ExpertParallel")
    dim, hidden = experts.w1.shape[2], experts.w1.shape[1]
    theirs = DeepSpeedMoE(
        hidden_size=dim,
        expert=SwiGLU(dim, hidden),
        num_experts=moe.num_experts,
        ep_size=ep_size,
        k=moe.top_k,
        capacity_factor=moe.capacity_factor,
        eval_capacity_factor=moe.capacity_factor,
        min_capacity=0,
        noisy_gate_policy=None,
        drop_tokens=True,
        use_rts=False,
        top2_2nd_expert_sampling=False,
    )
    layer = theirs.deepspeed_moe
    ep_rank = 0
    if ep_size > 1:
        theirs.set_deepspeed_parallelism()  # makes DeepSpeed's ep groups (on every rank)
        ep_rank = dist.get_rank(layer.ep_group)
    local = moe.num_experts // ep_size
    with torch.no_grad():
        layer.gate.wg.weight.copy_(moe.router.gate.weight)
        for i, expert in enumerate(layer.experts.deepspeed_experts):
            for role in ("w1", "w2", "w3"):
                getattr(expert, role).weight.copy_(getattr(experts, role)[ep_rank * local + i])
    return theirs
