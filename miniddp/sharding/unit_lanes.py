"""fully_shard's step as lanes: when each unit computed, and when its collectives were in flight.

    with recording(model) as recorded:            # the root; off by default, and free when off
        model(x).sum().backward()
    step = unit_timeline(recorded.events)         # three lanes of spans
    summarize(step).overlap                       # the share of communication hidden by compute
    recorded.peak_full_bytes                      # the most full parameters alive at once

The lanes, as the Prefetcher notes them (prefetch.py, `_note_unit`):

    compute          "forward 2", "backward 2": from the unit's parameters in place (and the
                     next gather issued) to its forward's end, or to its gradients' arrival
    all-gather       "all-gather 2": from its issue to its completion (on the link's thread)
    reduce-scatter   "reduce-scatter 2": the same (under HSDP, to the end of the all-reduce
                     over the replicas that follows it)

Communication overlaps when it is in flight while some unit computes; the rest is exposed:

    overlap = |comm ∩ compute| / |comm|,   comm and compute each the union of their lane's spans

A step records each unit's gather twice (forward, backward): an end pairs with the earliest
start of its lane and unit still open, since one lane's collectives complete in issue order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

from miniddp.observe.events import Event
from miniddp.observe.timeline import COMPUTE, Span, StepTimeline, union_of_intervals
from miniddp.observe.timeline import recording as _recording

ALL_GATHER, REDUCE_SCATTER = "all-gather", "reduce-scatter"
LANES = (COMPUTE, ALL_GATHER, REDUCE_SCATTER)
LANE_OF = {"forward": COMPUTE, "backward": COMPUTE, ALL_GATHER: ALL_GATHER}
LANE_OF[REDUCE_SCATTER] = REDUCE_SCATTER


@dataclass
class Recorded:
    events: list[Event]
    peak_full_bytes: int = 0  # the most bytes of full parameters alive as a unit began computing


@contextmanager
def recording(root: nn.Module) -> Iterator[Recorded]:
    """Record the units of fully_shard'ed `root` (the outermost call) inside the block, and
    the bytes of full parameters alive (Prefetcher.full_bytes) each time a unit starts to
    compute: the most there are, since only a unit's start gathers or issues a gather."""
    prefetcher = getattr(root, "_prefetcher", None)
    if prefetcher is None or prefetcher.root is not root:
        raise ValueError(
            f"{type(root).__name__} is not the root of a fully_shard'ed model: record the "
            "module whose fully_shard call came last (its forward encloses the others')"
        )

    def measure(event: Event) -> None:
        if event.kind in ("forward", "backward") and event.name.startswith("start"):
            recorded.peak_full_bytes = max(recorded.peak_full_bytes, prefetcher.full_bytes())

    with _recording(prefetcher, profiler_spans=False) as events:
        recorded = Recorded(events)
        prefetcher.observer.listeners.append(measure)  # the Recorder `_recording` attached
        yield recorded


def unit_timeline(events: Sequence[Event], rank: int = 0) -> StepTimeline:
    """One recorded step's spans, on the lanes above (a span left open is dropped)."""
    opened: dict[tuple[str, str], list[float]] = {}
    spans = []
    for event in sorted(events, key=lambda e: e.time):
        edge, unit = event.name.split()
        key = (event.kind, unit)
        if edge == "start":
            opened.setdefault(key, []).append(event.time)
        elif opened.get(key):
            name = f"{event.kind} {unit}"
            spans.append(Span(LANE_OF[event.kind], name, opened[key].pop(0), event.time))
    return StepTimeline(rank, 0, tuple(sorted(spans, key=lambda s: s.start)), ())


@dataclass(frozen=True)
class UnitSummary:
    """One step's numbers, in seconds; `overlap` is NaN when nothing was communicated."""

    step_s: float  # the first span's start to the last one's end
    compute_s: float  # some unit computing
    comm_s: float  # some collective in flight (two at once count once)
    hidden_s: float  # of which while some unit computed
    idle_s: float  # neither: casts and copies around collectives, threads waking up

    @property
    def exposed_s(self) -> float:
        return self.comm_s - self.hidden_s

    @property
    def overlap(self) -> float:
        return self.hidden_s / self.comm_s if self.comm_s > 0 else math.nan


def summarize(step: StepTimeline) -> UnitSummary:
    compute = union_of_intervals((s.start, s.end) for s in step.spans if s.lane == COMPUTE)
    comm = union_of_intervals((s.start, s.end) for s in step.spans if s.lane != COMPUTE)
    busy = union_of_intervals((s.start, s.end) for s in step.spans)
    hidden = sum(
        max(0.0, min(a_end, b_end) - max(a_start, b_start))
        for a_start, a_end in comm
        for b_start, b_end in compute
    )
    step_s = step.end - step.start if step.spans else 0.0
    return UnitSummary(
        step_s=step_s,
        compute_s=sum(end - start for start, end in compute),
        comm_s=sum(end - start for start, end in comm),
        hidden_s=hidden,
        idle_s=step_s - sum(end - start for start, end in busy),
    )
