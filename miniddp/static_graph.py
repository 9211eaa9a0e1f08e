"""static_graph=True: learn the backward pass once, then trust it (torch's meaning).

A parameter's hook normally marks its gradient ready the first time it fires. Under reentrant
activation checkpointing (`torch.utils.checkpoint(..., use_reentrant=True)`) a block's backward
runs as a separate, inner backward pass, and a block run twice (or a weight shared by two
checkpointed blocks) accumulates into `.grad` twice, so its hook fires twice: marking it ready at
the first would send half a gradient, so MiniDDP refuses ("got its gradient twice").

If the graph is the same every iteration, the fix is to count. The first synced backward only
counts each parameter's hooks and reduces nothing until it is over; then every bucket is
all-reduced at once (no overlap in that one step), and parameters that fired no hook on any rank
keep their `.grad`. From the second backward on, a parameter is ready when its hook has fired as
many times as it did then, and a parameter that fired none is ready at once, contributing zeros.
The order in which that second backward finished its parameters is the order the buckets are
rebuilt from, before the third forward.
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
        self._fired = [0] * len(names)

    @property
    def recording(self) -> bool:
        return self.expected is None

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

    def end_backward(self, usage: ParameterUsage) -> bool:
        """The synced backward is over. Return whether it was the first one, whose counts are
        now the expectation, and note in `usage` which parameters it used on this rank."""
        if self.expected is not None:
            return False
        self.expected = list(self._fired)
        for index, fired in enumerate(self.expected):
            if fired:
                usage.note(index)
        return True


class MayHaveStaticGraph:
    """`static_graph=True` at construction, or `_set_static_graph()` before training."""

    _static_graph: HookCounts | None = None

    @property
    def static_graph(self) -> bool:
        return self._static_graph is not None

    def _static_graph_start_over(self) -> list[int]:
        return [] if self._static_graph is None else self._static_graph.start_over()

    def _static_graph_first_backward_ends(self) -> bool:
        """True at the end of static_graph's first synced backward, which only counted hooks:
        every parameter is then marked ready at once, and those no rank used keep `.grad`."""
        return self._static_graph is not None and self._static_graph.end_backward(self._usage)

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
