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

import warnings

from miniddp.layout import initial_layout
from miniddp.model_checks import ParameterUsage


class HookCounts:
    """How many times each parameter's hook fires in one synced backward; the first counts."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.expected: list[int] | None = None  # None until the first synced backward is over
        self.used_on_any_rank: list[bool] | None = None  # also learnt in the first backward
        self._fired = [0] * len(names)

    def start_over(self) -> list[int]:
        """Forget this backward's counts; return the parameters the next one will not reach."""
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
                f"backward, but {self.expected[index]} times in the first one: the graph "
                "changed, which static_graph=True does not allow. Keep which parameters are "
                "used, and how often, the same every iteration, or drop static_graph."
            )
        return self._fired[index] == self.expected[index]

    def remember(self, usage: ParameterUsage) -> None:
        """The first synced backward is over: its counts become the expectation. Note in
        `usage` which parameters it used on this rank."""
        self.expected = list(self._fired)
        for index, fired in enumerate(self.expected):
            if fired:
                usage.note(index)


class MayHaveStaticGraph:
    """`static_graph=True` at construction, or `_set_static_graph()` before training."""

    _static_graph: HookCounts | None = None

    @property
    def static_graph(self) -> bool:
        return self._static_graph is not None

    def _static_graph_start_over(self) -> list[int]:
        """Between backwards: the parameters the next one will not reach. They fire no hook, so
        they go last in the order the buckets are rebuilt from, in index order (as in torch)."""
        if self._static_graph is None:
            return []
        unused = self._static_graph.start_over()
        order = self._layout.ready_order
        if order and not self._layout.has_rebuilt:
            order.extend(i for i in unused if i not in order)
        return unused

    def _static_graph_first_backward_ends(self) -> bool:
        """At the end of each synced backward: True if it was static_graph's first, which only
        counted hooks. Its counts become the expectation, and one all-reduce learns which
        parameters some rank used (the others keep `.grad` as it is, every iteration)."""
        counts = self._static_graph
        if counts is None or counts.expected is not None:
            return False
        counts.remember(self._usage)
        device = self.params[0].device
        counts.used_on_any_rank = self._usage.on_any_rank(device, self.process_group, self._wait)
        return True

    def _static_graph_used(self) -> list[bool] | None:
        return None if self._static_graph is None else self._static_graph.used_on_any_rank

    def _set_static_graph(self) -> None:
        """Declare the graph static: torch's name, for code written against torch's DDP."""
        if self._static_graph is not None:
            warnings.warn("static_graph is already True; nothing to do.", stacklevel=2)
            return
        if self.all_reduce_count:
            raise RuntimeError("Set static_graph before the first backward pass, not after.")
        if self.find_unused_parameters:
            warnings.warn(
                "static_graph=True finds unused parameters itself (in the first backward); "
                "find_unused_parameters=True is not needed with it.",
                stacklevel=2,
            )
            # As in torch: the first backward finds them, and buckets start as one, then rebuild.
            self.find_unused_parameters = False
            layout = self._layout
            layout.has_rebuilt = False
            layout.build(initial_layout(self.params, layout.first_cap, layout.cap, False))
        self._static_graph = HookCounts(self.param_names)
