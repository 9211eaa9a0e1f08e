"""static_graph=True: learn the backward pass once, then trust it (torch's meaning).

A parameter's hook normally marks its gradient ready the first time it fires. Under reentrant
activation checkpointing (`torch.utils.checkpoint(..., use_reentrant=True)`) a block's backward
runs as a separate, inner backward pass, and a block run twice (or a weight shared by two
checkpointed blocks) accumulates into `.grad` twice, so its hook fires twice: marking it ready at
the first would send half a gradient, so MiniDDP refuses ("got its gradient twice").

If the graph is the same every iteration, the fix is to count. The first synced backward only
counts each parameter's hooks and reduces nothing until it is over; then every bucket is
all-reduced at once (no overlap in that one step), and parameters that fired no hook on any rank
keep their `.grad` then and ever after. From the second backward on, a parameter is ready when its
hook has fired as many times as it did then, and one that fired none is ready at once (zeros).
The order in which the second backward finished its parameters, those that fire none last, is the
order the buckets are rebuilt from, before the third forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from miniddp.data_parallel.autograd_graph import ParameterUsage

GRAPH_CHANGED = (
    "the graph changed, which static_graph=True does not allow. Keep which parameters are "
    "used, and how often, the same every iteration, or construct MiniDDP without static_graph "
    "(with find_unused_parameters=True if some parameters go unused in some iterations)."
)
FINDS_UNUSED_ITSELF = (
    "static_graph=True finds unused parameters itself (in the first backward); "
    "find_unused_parameters=True is not needed with it."
)


class StaticGraph:
    """What MiniDDP(static_graph=True) holds: how many times each parameter's hook fires in one
    synced backward. The first synced backward counts; the later ones are checked against it."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.expected: list[int] | None = None  # None until the first synced backward is over
        self.used_on_any_rank: list[bool] | None = None  # also learnt in the first backward
        self._fired = [0] * len(names)

    @property
    def counting(self) -> bool:
        """True until the first synced backward is over: it only counts, and reduces at its end."""
        return self.expected is None

    def start_over(self) -> list[int]:
        """Forget this backward's counts; return the parameters the next one will not reach:
        those that fired no hook in the first backward."""
        self._fired = [0] * len(self.names)
        return [] if self.expected is None else [i for i, n in enumerate(self.expected) if not n]

    def last_hook(self, index: int) -> bool:
        """Count one hook; True when it is this parameter's last one in this backward."""
        self._fired[index] += 1
        if self.expected is None:
            return False
        if self._fired[index] > self.expected[index]:
            raise RuntimeError(
                f"The hook of '{self.names[index]}' fired {self._fired[index]} times in this "
                f"backward, but {self.expected[index]} times in the first one: {GRAPH_CHANGED}"
            )
        return self._fired[index] == self.expected[index]

    def first_backward_ends(
        self, usage: ParameterUsage, device: torch.device, group: Any, wait: Callable
    ) -> bool:
        """At the end of each synced backward: True if it was the first, which only counted
        hooks. Its counts become the expectation, and one all-reduce of `usage` learns which
        parameters some rank used (the others keep `.grad` as it is, every iteration)."""
        if not self.counting:
            return False
        self.expected = list(self._fired)
        for index, fired in enumerate(self.expected):
            if fired:
                usage.note(index)
        self.used_on_any_rank = usage.on_any_rank(device, group, wait)
        return True
