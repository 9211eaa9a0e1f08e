"""Exercise 9 (chapter 11): ZeRO-1, each rank keeping the optimizer state of its share only.

Fill in the TODOs, then check your class against torch's own ZeroRedundancyOptimizer:

    python -m pytest tests/test_sharding.py -x \\
        --zero1 tutorials/exercises/zero1.py:ZeroRedundancyOptimizer

They train small random models under MiniDDP on 2 and 3 ranks, once with
torch.distributed.optim.ZeroRedundancyOptimizer over AdamW and once with yours, and check that
the parameters are bit for bit torch's after every step, and that each rank keeps Adam's state
for exactly the parameters torch's partition gives it. An optimizer that keeps every state on
every rank gets the numbers right and fails there, naming the idea.

Stuck? Chapter 11 (tutorials/11_sharding.py), section 2, explains the idea and counts
the bytes it saves. Only once your own attempt passes, compare it with
miniddp/sharding/zero.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from miniddp.sharding import partition


class ZeroRedundancyOptimizer(Optimizer):
    """Wrap `optimizer_class` so that each rank keeps and steps only its partition's state.

    The protocol the tests drive, torch's: `ZeroRedundancyOptimizer(params, torch.optim.AdamW,
    lr=..., weight_decay=...)` over every parameter of the model, `step()` after MiniDDP's
    backward, `zero_grad()`; and `.optim`, this rank's local optimizer, whose `.state` the
    tests read to see whose Adam state this rank keeps.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[Optimizer],
        **defaults: Any,
    ) -> None:
        # Given: the whole model's parameter groups, as torch's keeps them (zero_grad and a
        # learning-rate scheduler see every parameter).
        super().__init__(list(params), defaults)
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        # TODO 1. What must hold: `self.optim` is an `optimizer_class` over this rank's share
        # of the parameters only, so that its state (Adam's two moments, 8 bytes per fp32
        # element) exists for that share alone. The shares must be torch's, for the bits and
        # for the state check: `partition(self.param_groups, self.world_size)` (miniddp.sharding)
        # gives each rank its copy of every group, holding the parameters it owns. Chapter 11
        # shows why any split computes the same update: AdamW is elementwise.
        self.optim: Optimizer | None = None

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """TODO 2. What must hold afterwards: every rank holds every parameter updated, as one
        AdamW over the whole model would leave it. This rank can update only its share (its
        `self.optim` knows no other state), so each updated parameter must then travel from
        the rank that owns it to all the others. Every rank must make the same collectives in
        the same order, whoever owns what."""
        raise NotImplementedError(
            "TODO exercise 9 (tutorials/exercises/zero1.py, chapter 11): step this rank's "
            "partition, then send each updated parameter from its owner to every rank"
        )


__all__ = ["ZeroRedundancyOptimizer", "partition"]
