"""fully_shard's prefetch: each unit's all-gather issued one unit ahead, each reduce-scatter left
in flight behind, so that the communication thread moves bytes while autograd computes.

    forward   unit i computes while unit i+1's all-gather travels
    backward  unit i computes while unit i-1's all-gather and unit i+1's reduce-scatter travel;
              the end of backward waits for the last reduce-scatter

"Next" comes from the order the units ran in the previous forward: their pre-forward order for
the forward, their post-forward order reversed for the backward (a parent's output gets its
gradient before its children's do): the two orders torch's FSDP2 uses. A unit's explicit list
(`set_modules_to_forward_prefetch`, `set_modules_to_backward_prefetch`) replaces "the next one"
for that unit, as in torch. The first step has no previous order: it gathers on demand.

Memory: a chain of units with reshard_after_forward=True holds at most two units' full
parameters at once: the one computing and the one arriving (and its parents', gathered until
their own forward ends). Without prefetch, one. Beside them, while a gather travels, its
receives: W-1 pieces the size of the group's largest unit's, 1/W of a unit each (units.py says
why a receive needs that room).

Why, in backward, the gather of the unit after next is issued at the end of a unit's backward,
before its reduce-scatter, rather than when the next unit's backward begins: one communication
thread runs every collective in issue order (torch's FSDP2 has a stream for each kind). Issued
after the reduce-scatter, the gather would wait behind it, and the next unit's backward would
wait for both; issued before, it arrives first, and the reduce-scatter travels while that
backward computes. Each gather's messages carry its unit's number, so that every rank checks
that all gather the same unit (units.py) at no round trip more.

Bits: a prefetched gather moves the same shards as one issued on demand, and a reduce-scatter
finished later adds the same values into `.grad` as autograd would have: the same bits. A
gather issued and never used (the order changed) is waited for and dropped at the end of its
forward or backward, so that no stale parameters outlive an optimizer step.
"""

from __future__ import annotations

from enum import Enum

import torch
from torch import nn
from torch.autograd import Variable

from miniddp.observe.events import NO_OBSERVER, Observer
from miniddp.sharding.sharded_parameters import InFlight, ShardedParameters


class TrainingState(Enum):
    """Where the root stands in a step, in FSDP2's word for it: which order prefetch follows."""

    IDLE = "idle"  # between steps, or a unit called on its own: gather on demand, record nothing
    FORWARD = "forward"  # inside the root's forward
    BACKWARD = "backward"  # from the first unit's backward to autograd's end of backward


class Prefetcher:
    """One per root (the unit whose forward encloses the others'), shared by all its units.

    `enabled=False` (the benchmark's switch): every collective is waited for as soon as it is
    issued, as fully_shard did before prefetching; the same bits, none of the overlap.

    Its `observer` (NO_OBSERVER until an instrument attaches one, as MiniDDP's) hears each
    unit's compute and collectives, for miniddp/sharding/unit_lanes.py to draw: `_note_unit`
    is the one place."""

    def __init__(self, root: nn.Module, enabled: bool = True) -> None:
        self.observer: Observer = NO_OBSERVER
        self.root = root
        self.enabled = enabled
        self.state = TrainingState.IDLE
        self.forward_order: list[ShardedParameters] = []  # the previous forward's
        self.backward_order: list[ShardedParameters] = []
        self._pre: list[ShardedParameters] = []  # this forward's, as it runs
        self._post: list[ShardedParameters] = []
        self._position = 0  # how many units this forward (or backward) has gathered so far
        self._positions: dict[int, int] = {}  # id(unit) -> its position in this backward
        self._gathers: dict[int, tuple[ShardedParameters, InFlight]] = {}  # in flight
        self._reducing: tuple[ShardedParameters, InFlight] | None = None

    def units_gathering(self) -> list[ShardedParameters]:
        """The units whose all-gather is in flight (their full parameters are being filled)."""
        return [unit for unit, _ in self._gathers.values()]

    def full_bytes(self) -> int:
        """Bytes of full parameters that exist now: in a unit's tensors, or arriving in an
        all-gather's buffer. What "at most two units at once" bounds."""
        units = {id(m._sharded): m._sharded for m in self.root.modules() if _holds(m)}
        held = sum(t.untyped_storage().nbytes() for u in units.values() for t in u.full)
        return held + sum(gathering.output.nbytes for _, gathering in self._gathers.values())

    def begin_forward(self) -> None:
        self._drop_unused()  # left by a forward that raised
        self.state, self._position, self._pre, self._post = TrainingState.FORWARD, 0, [], []

    def unshard_for_forward(self, unit: ShardedParameters) -> list[torch.Tensor]:
        """`unit`'s full parameters (gathered ahead, or now); then the next unit's gather."""
        full = self._take(unit)
        if self.state is TrainingState.FORWARD:
            self._pre.append(unit)
            if self.enabled:
                self._prefetch(self._after(unit, self._position, self.forward_order, "forward"))
            self._position += 1
        self._note_unit("forward", "start", unit)
        return full

    def after_forward(self, unit: ShardedParameters) -> None:
        self._note_unit("forward", "end", unit)
        if self.state is TrainingState.FORWARD:
            self._post.append(unit)

    def end_forward(self) -> None:
        self._drop_unused()
        self.forward_order, self.backward_order = self._pre, self._post[::-1]
        self.state = TrainingState.IDLE

    def unshard_for_backward(self, unit: ShardedParameters, full: list[torch.Tensor]) -> None:
        """Before `unit`'s backward: refill the tensors its forward saved, unless
        reshard_after_forward=False kept them; then the next unit's gather."""
        self._begin_backward()
        if unit.is_freed(full):
            unit.refill(full, self._take(unit))
        self._positions[id(unit)] = self._position
        if self.enabled:
            self._prefetch(self._after(unit, self._position, self.backward_order, "backward"))
        self._position += 1
        self._note_unit("backward", "start", unit)

    def reduce_after_backward(self, unit: ShardedParameters, grads: list[torch.Tensor]) -> None:
        """After `unit`'s backward: issue the next unit's prefetch (see the module docstring
        for why here), finish the previous reduce-scatter, and start this one's."""
        self._note_unit("backward", "end", unit)
        self._begin_backward()
        if self.enabled:
            position = self._positions.get(id(unit), -1) + 1
            if position < len(self.backward_order):
                upcoming = self.backward_order[position]
                self._prefetch(self._after(upcoming, position, self.backward_order, "backward"))
        self._finish_reducing()  # at most one in flight: its full-size buffer is freed here
        reducing = unit.start_reduce_scatter(grads)
        self._note_unit("reduce-scatter", "start", unit, reducing)
        self._reducing = (unit, reducing)
        if not self.enabled:
            self._finish_reducing()

    def end_backward(self) -> None:
        """Queued on autograd's engine by the first unit's backward: runs once it ends."""
        self._finish_reducing()
        self._drop_unused()
        self.state = TrainingState.IDLE

    def _begin_backward(self) -> None:
        if self.state is not TrainingState.BACKWARD:
            self.state, self._position, self._positions = TrainingState.BACKWARD, 0, {}
            Variable._execution_engine.queue_callback(self.end_backward)

    def _after(
        self, unit: ShardedParameters, position: int, order: list[ShardedParameters], phase: str
    ) -> list[ShardedParameters]:
        """The units to gather once `unit`, the position-th of this pass, has its own."""
        explicit = unit.forward_prefetch if phase == "forward" else unit.backward_prefetch
        if explicit is not None:
            return explicit
        if position + 1 < len(order) and order[position] is unit:  # the same order as before
            return [order[position + 1]]
        return []

    def _prefetch(self, units: list[ShardedParameters]) -> None:
        for unit in units:
            if id(unit) in self._gathers:
                continue
            if self.state is TrainingState.BACKWARD and not unit.reshard_after_forward:
                continue  # its full parameters were kept: nothing to gather
            gathering = self._start_gather(unit)
            gathering.what += ", prefetched"  # what a dead rank's error will name
            self._gathers[id(unit)] = (unit, gathering)

    def _take(self, unit: ShardedParameters) -> list[torch.Tensor]:
        _, gathering = self._gathers.pop(id(unit), (unit, None))
        return unit.finish_gather(gathering or self._start_gather(unit))

    def _start_gather(self, unit: ShardedParameters) -> InFlight:
        gathering = unit.start_gather()
        self._note_unit("all-gather", "start", unit, gathering)
        return gathering

    def _finish_reducing(self) -> None:
        if self._reducing is not None:
            unit, reducing = self._reducing
            self._reducing = None
            unit.finish_reduce_scatter(reducing)

    def _note_unit(
        self, lane: str, edge: str, unit: ShardedParameters, issued: InFlight | None = None
    ) -> None:
        """The timeline's hook: `lane` ("forward", "backward", "all-gather", "reduce-scatter")
        starts or ends for `unit`. A collective `issued` ends when it completes, noted on the
        thread that completes it. Nobody watching: one check, nothing allocated."""
        if self.observer is NO_OBSERVER:
            return
        self.observer.note(lane, f"{edge} {unit.number}")
        if issued is not None:
            self.observer.note_when_done(issued.work, lane, f"end {unit.number}")

    def _drop_unused(self) -> None:
        """Wait for gathers nobody used (every rank issued them: every rank waits), and drop."""
        while self._gathers:
            _, (unit, gathering) = self._gathers.popitem()
            unit.finish_gather(gathering)


def _holds(module: nn.Module) -> bool:
    return getattr(module, "_sharded", None) is not None
