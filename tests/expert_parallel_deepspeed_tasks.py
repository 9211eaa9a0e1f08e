"""What the ranks run for tests/test_expert_parallel_deepspeed.py: our MoE and DeepSpeed's,
configured alike with the same weights (miniddp/instruments/bench/deepspeed_moe.py), on the same
tokens.

Every rank builds the same MoE (one seed) and the same whole batch. On one process each rank
compares the two layers on the whole batch by itself; at ep_size = W both layers split their
experts over the W ranks and each rank routes its own tokens, `torch.chunk(batch, W)[rank]`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from miniddp.expert_parallel import ExpertParallel, MoE
from miniddp.instruments.bench.deepspeed_moe import deepspeed_like, deepspeed_on_gloo
from miniddp.tensor_parallel import parallelize_module


@dataclass(frozen=True)
class Spec:
    top_k: int
    expert_parallel: bool  # False: each rank one process on the whole batch
    capacity_factor: float = 1.0  # dyadic, so both capacities are exact (see the test)
    dim: int = 16
    hidden_dim: int = 24
    num_experts: int = 4
    tokens: int = 32  # per rank
    seed: int = 0


def their_routing(theirs: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """DeepSpeed's gate on x: (N, k) expert of each choice, -1 where capacity dropped it; and
    its capacity. The gate is the same call its layer makes (sparse routes), and draws nothing
    at random with the configuration used."""
    _, capacity, _, experts, _, _, _ = theirs.deepspeed_moe.gate(x, None, True)
    return experts.T.long(), int(capacity)


def compare(spec: Spec) -> dict[str, object]:
    """Our MoE against DeepSpeed's on this rank's tokens: routing, outputs, aux loss, counts."""
    deepspeed_on_gloo()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(spec.seed)
    ours = MoE(
        spec.dim,
        spec.hidden_dim,
        spec.num_experts,
        spec.top_k,
        capacity_factor=spec.capacity_factor,
        aux_loss_coef=1.0,
    )
    batch = torch.randn(world_size * spec.tokens, spec.dim)
    ep_size = world_size if spec.expert_parallel else 1
    theirs = deepspeed_like(ours, ep_size)
    one_process = MoE(spec.dim, spec.hidden_dim, spec.num_experts, spec.top_k, aux_loss_coef=1.0)
    one_process.load_state_dict(ours.state_dict())
    x = batch
    if spec.expert_parallel:
        parallelize_module(ours.experts, dist.group.WORLD, ExpertParallel())
        x = batch.chunk(world_size)[rank]

    with torch.no_grad():
        routing = ours.router(x)
        kept = ours.within_capacity(routing.experts)
        our_routes = torch.where(kept, routing.experts, -1)
        their_routes, their_capacity = their_routing(theirs, x)
        their_kept = their_routes >= 0
        y_theirs, l_aux, exp_counts = theirs(x)
        y_ours = ours(x)
        if spec.top_k == 1:  # their drop order, handed to ours: the same outputs?
            ours.within_capacity = lambda choices: their_kept
            y_comparable = ours(x)
            del ours.within_capacity
        else:  # their weights renormalised over the kept choices, ours over both chosen:
            # a token that kept one choice weighs it by 1 there, by its weight here
            kept_weight = (routing.weights * kept).sum(1, keepdim=True)
            one_kept = kept.sum(1, keepdim=True) == 1
            y_comparable = torch.where(one_kept, y_ours / kept_weight, y_ours)
        one_process(x)  # this rank's tokens alone, for DeepSpeed's per-rank aux loss
    probs = routing.probs.mean(0)
    first = torch.bincount(routing.experts[:, 0], minlength=spec.num_experts) / len(x)
    their_counts = exp_counts.clone()
    if spec.expert_parallel:
        dist.all_reduce(their_counts)
    return {
        "capacity": (
            their_capacity,
            math.ceil(spec.capacity_factor * len(x) * spec.top_k / spec.num_experts),
        ),
        "dropped": int((~kept).sum()),
        "one of two dropped": int((kept.sum(1) == 1).sum()) if spec.top_k == 2 else None,
        "chosen alike": torch.equal(routing.experts[their_kept], their_routes[their_kept]),
        "kept per expert alike": torch.equal(
            torch.bincount(our_routes[kept], minlength=spec.num_experts),
            torch.bincount(their_routes[their_kept], minlength=spec.num_experts),
        ),
        "routes alike": torch.equal(our_routes, their_routes),
        "y, the difference undone": (y_theirs - y_comparable).abs().max().item(),
        "y": (y_theirs - y_ours).abs().max().item(),
        "their l_aux": l_aux.item(),
        "our aux, global": ours.aux_loss.item(),
        "our aux, this rank's tokens": one_process.aux_loss.item(),
        "E sum P f(first choices)": (spec.num_experts * (probs * first).sum()).item(),
        "counts alike": torch.equal(their_counts.long(), ours.tokens_per_expert),
    }
