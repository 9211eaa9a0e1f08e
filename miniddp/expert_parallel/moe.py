"""The mixture-of-experts layer: route, permute, (drop,) run the experts, combine.

    moe = MoE(dim, hidden_dim, num_experts, top_k)
    y = moe(x)                       # x (B, T, dim) or (N, dim); y the same shape
    loss = task_loss(y) + moe.aux_loss

For each of the N tokens the router (router.py) picks top_k experts and their weights (experts
of equal probability in the order of their index, the lower first: a stable sort). Each
(token, expert) pair is one row for the experts; the N k rows are sorted by expert with a
stable sort, so expert e sees its rows in token order, the same rows in the same order whether
one process holds the whole batch or an expert-parallel group holds it split by rank in rank
order. Then the experts (experts.py) run, their outputs go back to their (token, choice) place,
and each token's output is the weighted sum of its experts' outputs, choice 0 first:

    y[t] = sum_j weights[t, j] * expert_{experts[t, j]}(x[t])

Capacity (`capacity_factor`, GShard, Switch): with a factor c, an expert takes at most
C = ceil(c N k / E) rows of the N tokens routed here; without one (None) it takes them all
(dropless, as Megatron's and torchtitan's default). Which rows it keeps: every token's first
choice before any second choice, and within a choice, tokens in order (DeepSpeed's top-2
order, without its random priority). A choice past the expert's capacity is dropped: it adds
nothing to its token's output, and the weights of the token's kept choices are not raised to
make up for it. A token whose chosen experts are all full gets zeros from this layer; in a
transformer the residual connection carries it on unchanged.

After each forward:
    aux_loss           E * sum_i f_i P_i * aux_loss_coef (router.py), to add to the loss
    tokens_per_expert  (E,) how many tokens chose each expert (before any drop)
    dropped            how many (token, expert) choices capacity dropped

Under expert parallelism (parallel.py) all three are global: summed over every rank of the
group, the same numbers one process gets on the whole batch. Beside data parallelism, the ranks
that route are dp x ep, not the ep group alone: set `routing_group` to all of them (Megatron's
global auxiliary loss sums over every data-parallel rank too). Capacity, though, stays this
rank's: see parallel.py for why, and by how much that differs from a global one.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
import torch.distributed as dist
from torch import nn

from miniddp.collectives import all_reduce
from miniddp.expert_parallel.experts import GroupedExperts
from miniddp.expert_parallel.router import Router, load_balancing_loss


class MoE(nn.Module):
    """A router and `num_experts` SwiGLU experts; each token goes to `top_k` of them."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        *,
        capacity_factor: float | None = None,
        aux_loss_coef: float = 0.0,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"top_k must be between 1 and num_experts ({num_experts}): a token cannot "
                f"choose {top_k} different experts out of {num_experts}"
            )
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(
                f"capacity_factor must be > 0 (1.0: room for an even share), or None for no "
                f"drops; got {capacity_factor}"
            )
        self.dim, self.num_experts, self.top_k = dim, num_experts, top_k
        self.capacity_factor, self.aux_loss_coef = capacity_factor, aux_loss_coef
        self.router = Router(dim, num_experts, top_k)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.aux_loss = torch.zeros(())
        self.tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64)
        self.dropped = 0
        # Whose statistics the three sum: None, the experts' group (this process alone before
        # ExpertParallel, the ep group after it).
        self.routing_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim or x.dim() not in (2, 3):
            raise ValueError(
                f"MoE takes (B, T, {self.dim}) or (N, {self.dim}); got {tuple(x.shape)}"
            )
        tokens = x.reshape(-1, self.dim)
        routing = self.router(tokens)
        experts = routing.experts.reshape(-1)  # (N k,): token t's choice j at t k + j
        kept = self.within_capacity(routing.experts).reshape(-1).nonzero().squeeze(1)
        order = kept[torch.argsort(experts[kept], stable=True)]  # by expert, then token
        counts = torch.bincount(experts[kept], minlength=self.num_experts)
        outputs = self.experts(tokens[order // self.top_k], counts)
        placed = outputs.new_zeros((len(experts), self.dim)).index_copy(0, order, outputs)
        placed = placed.view(-1, self.top_k, self.dim)
        combined = placed[:, 0] * routing.weights[:, :1]
        for j in range(1, self.top_k):
            combined = combined + placed[:, j] * routing.weights[:, j : j + 1]
        self.record(routing.probs, routing.experts, dropped=len(experts) - len(kept))
        return combined.view(x.shape)

    def within_capacity(self, choices: torch.Tensor) -> torch.Tensor:
        """(N, k) bool: which choices fit. Slots are handed out choice by choice (all first
        choices, then all second ones), in token order within each: a choice's place in its
        expert's queue is the number of choices of that expert before it in that order."""
        if self.capacity_factor is None:
            return torch.ones_like(choices, dtype=torch.bool)
        tokens = choices.shape[0]
        # The factor as written: float(1.1) is 1.1000000000000000888, and c N k / E in floats
        # rounds some whole numbers up (55.000000000000007 at c = 1.1, N = 200, k = 1, E = 4,
        # so 56 slots, not 55); the decimal the user wrote, as an exact fraction, does not.
        factor = Fraction(repr(self.capacity_factor))
        capacity = math.ceil(factor * tokens * self.top_k / self.num_experts)
        one_hot = nn.functional.one_hot(choices.T.reshape(-1), self.num_experts)
        place = (one_hot.cumsum(0) * one_hot).sum(1) - 1  # 0-based, choice-major
        return (place < capacity).view(self.top_k, tokens).T

    def record(self, probs: torch.Tensor, choices: torch.Tensor, dropped: int) -> None:
        """aux_loss, tokens_per_expert and dropped, over every rank that routes: under expert
        parallelism one all-reduce (float64: the counts stay exact) sums the statistics."""
        chosen = torch.bincount(choices.reshape(-1), minlength=self.num_experts)
        totals = torch.cat(
            [
                chosen.double(),
                probs.detach().double().sum(0),
                torch.tensor([len(probs), dropped], dtype=torch.float64, device=probs.device),
            ]
        )
        group = self.routing_group or self.experts.dispatch.group
        if group is not None:
            all_reduce(totals, group=group)
        e = self.num_experts
        self.tokens_per_expert = totals[:e].round().long()
        self.dropped = int(totals[-1])
        loss = load_balancing_loss(probs, self.tokens_per_expert, totals[e:-2], int(totals[-2]))
        self.aux_loss = self.aux_loss_coef * loss
