"""The router: which experts each token goes to, with what weight, and the load-balancing loss.

A linear gate scores every expert for every token, softmax turns the scores into probabilities
p[t, i], and each token keeps its top k experts. With k > 1 the k kept probabilities are
renormalised to sum to 1 (Mixtral, Qwen3-MoE): the weights a token's expert outputs are mixed
with. With k = 1 the weight is the probability itself (Switch), so the gate still gets a
gradient through it.

Tie-breaking: experts of equal probability are ranked by their index, the lower first. torch's
`topk` promises no order among ties, so the ranking is a stable descending sort instead: one
process and every rank of an expert-parallel group, given the same row, choose the same experts.

The Switch load-balancing loss (Fedus et al. 2021, eq. 4), over T tokens each choosing k:

    aux = E * sum_i f_i * P_i,    f_i = (choices of expert i) / (T k),    P_i = sum_t p[t, i] / T

f is the share of the choices each expert got (a count: no gradient), P the mean probability
the router gave it (differentiable). Both are distributions over the E experts, so aux is 1
when routing is uniform and grows as the load concentrates; its gradient pushes probability away
from the experts that get the most tokens. The caller adds it, times the MoE's coefficient, to
the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class Routing:
    """The router's decision for N tokens: probs (N, E), and per token its k experts (N, k),
    best first, and their weights (N, k)."""

    probs: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor


class Router(nn.Module):
    """gate: a bias-free linear layer dim -> num_experts; top_k experts per token."""

    def __init__(self, dim: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> Routing:
        probs = F.softmax(self.gate(x), dim=-1)
        ranked, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
        weights, experts = ranked[:, : self.top_k], experts[:, : self.top_k]
        if self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(probs, experts, weights)


def load_balancing_loss(
    probs: torch.Tensor, choices: torch.Tensor, total_probs: torch.Tensor, total_tokens: int
) -> torch.Tensor:
    """E * sum_i f_i P_i from the statistics of every token that was routed: `choices` (E,)
    counts and `total_probs` (E,) sums of p[t, i] over all of them, `total_tokens` of them.

    On one process those are this batch's own. Under expert parallelism they are summed over
    the group (Megatron's global auxiliary loss), and `probs` holds this rank's tokens only:
    P_i = (this rank's sum, with its gradient, + the other ranks' sum, a constant) / T. The
    value is the whole batch's loss, the same on every rank; its gradient on each rank is this
    rank's part of the whole batch's, so the router's gradients summed over the group are one
    process's. Each rank's own mean (f and P from its tokens only, averaged over ranks) is
    another number: 1.085 against the global 1.069 in the issue's measurement at W = 2,
    because sum_i f_i P_i is not linear in the batch.
    """
    num_experts = probs.shape[-1]
    if total_tokens == 0:
        return probs.sum() * 0.0  # nobody routed anything: no load to balance
    own = probs.sum(dim=0)
    mean_probs = (own + (total_probs.to(own.dtype) - own).detach()) / total_tokens
    shares = choices.to(own.dtype) / choices.sum()
    return num_experts * (shares * mean_probs).sum()
