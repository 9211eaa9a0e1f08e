"""The experts: E SwiGLU MLPs, their weights stacked on dim 0, run on tokens grouped by expert.

Expert e computes, for each row x routed to it (LLaMA's and Mixtral's feed-forward):

    SwiGLU_e(x) = (silu(x w1[e]^T) * (x w3[e]^T)) w2[e]^T

w1 and w3 are (E, hidden_dim, dim), w2 is (E, dim, hidden_dim): one tensor per role, stacked
over the experts, as torchtitan and Megatron's grouped GEMM hold them, so that expert
parallelism keeps `torch.chunk(w, ep, 0)[rank]` of each, the experts of one rank contiguous.

The input is every row routed here, sorted by expert, with `counts[e]` rows for expert e: one
matmul per expert on its rows. (`F.grouped_mm` does the same in one call, and on CPU gives the
same bits as these matmuls; the loop says what it does.) An expert that got no rows still runs,
on none: its weights then get a gradient of zeros, not None, like every other rank's.

Where the rows come from is not the experts' business: a `dispatch` object they hold brings
them. On one process it is `LocalDispatch`, which hands the rows straight over; ExpertParallel
(parallel.py) swaps in its all-to-all and keeps this rank's slice of the weights. The experts
compute the same thing either way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

# The experts' own computation: (rows sorted by expert, rows per expert) -> rows out.
Compute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class LocalDispatch:
    """One process: every expert is here, and so is every row."""

    group = None

    def __call__(self, compute: Compute, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return compute(rows, counts)


class GroupedExperts(nn.Module):
    """num_experts SwiGLU MLPs dim -> hidden_dim -> dim, stacked (see the module docstring)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        for weight, fan_in in ((self.w1, dim), (self.w3, dim), (self.w2, hidden_dim)):
            nn.init.uniform_(weight, -(fan_in**-0.5), fan_in**-0.5)  # nn.Linear's range
        self.dispatch: Callable[[Compute, torch.Tensor, torch.Tensor], torch.Tensor]
        self.dispatch = LocalDispatch()

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`rows` sorted by (global) expert, `counts[e]` of them for expert e -> their outputs,
        in the same order."""
        return self.dispatch(self.compute, rows, counts)

    def compute(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts held here on their rows: `counts[e]` for this module's e-th expert."""
        outputs = [
            (F.silu(x @ self.w1[e].T) * (x @ self.w3[e].T)) @ self.w2[e].T
            for e, x in enumerate(rows.split(counts.tolist()))
        ]
        return torch.cat(outputs)
