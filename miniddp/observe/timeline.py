"""Timelines: what happened in each step, drawn, and how much communication hid behind compute.

MiniDDP (and the baselines in `miniddp/instruments/bench/baselines.py`) note events to the
observer an instrument attaches (miniddp/observe/events.py): forward start/end, backward start,
a hook per parameter, ready/launch/reduced/wait per bucket, backward end and sync end. This
module turns those instants into spans on two lanes per rank:

    compute         forward, backward, then the wait for the last all-reduces (and copy-back)
    communication   one span per bucket, from its launch to its all-reduce's completion

and summary numbers, which answer the question this project exists for: how much of the
communication ran while backward was still computing? miniddp/instruments/timeline_views.py shows
the same steps as an ASCII timeline, a Chrome trace (Perfetto, chrome://tracing) and a
matplotlib figure.

    with recording(ddp) as events:            # opt in; off by default and free when off
        ddp(x).sum().backward()
    steps = gather(split_steps(events, rank)) # every rank's steps, on every rank
    print(summarize(steps[0]))                # and timeline_views.ascii_timeline(steps)

While recording, the same spans also go through `torch.profiler.record_function`, so a
torch.profiler trace shows "miniddp: bucket 3" beside gloo's own `gloo:all_reduce` events.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from miniddp.observe.events import Event, Observer, Recorder

COMPUTE = "compute"
COMM = "communication"
PROFILER_PREFIX = "miniddp: "


class Observed(Protocol):
    """What `recording()` needs: an `observer` to swap (MiniDDP, the rungs and the baselines,
    fully_shard's prefetcher, a pipeline schedule)."""

    observer: Observer


@dataclass(frozen=True)
class Span:
    """Something that lasted: forward, backward, the final wait, or one bucket's all-reduce."""

    lane: str  # COMPUTE or COMM
    name: str  # "forward", "backward", "wait", "bucket 3"
    start: float  # seconds, time.perf_counter()
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Mark:
    """An instant: a parameter's hook, a bucket becoming ready, a bucket rebuild."""

    time: float
    kind: str
    name: str


@dataclass(frozen=True)
class StepTimeline:
    """One rank's step, from its forward's start to the moment gradients were averaged."""

    rank: int
    step: int
    spans: tuple[Span, ...]
    marks: tuple[Mark, ...]

    @property
    def start(self) -> float:
        return min([s.start for s in self.spans] + [m.time for m in self.marks])

    @property
    def end(self) -> float:
        return max([s.end for s in self.spans] + [m.time for m in self.marks])

    def span(self, name: str) -> Span | None:
        return next((s for s in self.spans if s.name == name), None)

    @property
    def buckets(self) -> list[Span]:
        return [s for s in self.spans if s.lane == COMM]


@dataclass(frozen=True)
class Summary:
    """One step's numbers, in seconds. `overlap` is NaN when nothing was communicated.

    comm_s counts wall time with at least one all-reduce in flight (two buckets in flight at
    once count once); overlapped_s + exposed_s = comm_s when nothing is sent before backward.
    """

    step_s: float  # forward start -> gradients averaged
    backward_s: float
    comm_s: float
    overlapped_s: float  # communication while backward was still computing
    exposed_s: float  # communication after backward ended: nothing left to hide it behind
    tail_s: float  # backward end -> gradients averaged: what the step pays after backward

    @property
    def overlap(self) -> float:
        return self.overlapped_s / self.comm_s if self.comm_s > 0 else math.nan


def split_steps(events: Iterable[Event], rank: int = 0) -> list[StepTimeline]:
    """Cut one rank's events into steps (a step starts at each forward) and pair them into spans.

    A bucket's all-reduce ends at the first of "reduced" (stamped on gloo's thread once it holds
    Python's lock, so it can be late) and "wait" (the main thread saw it done): a completed
    all-reduce can't finish after someone saw it finished.
    """
    steps: list[_StepBuilder] = []
    pending: list[Mark] = []  # a rebuild happens just before the forward it belongs to
    for event in sorted(events, key=lambda e: e.time):
        if (event.kind, event.name) == ("forward", "start"):
            steps.append(_StepBuilder(len(steps), pending))
            pending = []
        if not steps or event.kind == "rebuild":
            pending.append(Mark(event.time, event.kind, event.name))
        elif event.kind == "reduced":
            # Completion can be noted after the next step began; it belongs to its launch.
            owner = next((s for s in reversed(steps) if s.awaits(event.name)), steps[-1])
            owner.add(event)
        else:
            steps[-1].add(event)
    return [step.build(rank) for step in steps]


class _StepBuilder:
    def __init__(self, step: int, marks: list[Mark]) -> None:
        self.step = step
        self.marks = list(marks)
        self.times: dict[tuple[str, str], float] = {}
        self.launched: dict[str, float] = {}

    def awaits(self, name: str) -> bool:
        return name in self.launched and ("reduced", name) not in self.times

    def add(self, event: Event) -> None:
        if event.kind == "launch":
            self.launched[event.name] = event.time
        if event.kind in ("hook", "ready", "rebuild"):
            self.marks.append(Mark(event.time, event.kind, event.name))
        else:
            self.times.setdefault((event.kind, event.name), event.time)

    def build(self, rank: int) -> StepTimeline:
        times = self.times
        spans = []
        for name, start_key, end_key in (
            ("forward", ("forward", "start"), ("forward", "end")),
            ("backward", ("backward", "start"), ("backward", "end")),
            ("wait", ("backward", "end"), ("sync", "end")),
        ):
            if start_key in times and end_key in times:
                spans.append(Span(COMPUTE, name, times[start_key], times[end_key]))
        for name, launched in self.launched.items():
            ends = [times[key] for key in (("reduced", name), ("wait", name)) if key in times]
            if ends:
                spans.append(Span(COMM, name, launched, max(launched, min(ends))))
        return StepTimeline(rank, self.step, tuple(spans), tuple(self.marks))


def summarize(step: StepTimeline) -> Summary:
    """The numbers for one step (see `Summary`)."""
    backward = step.span("backward")
    comm = union_of_intervals((s.start, s.end) for s in step.buckets)
    comm_s = sum((end - start for start, end in comm), 0.0)
    if backward is None:  # no synced backward (e.g. inside no_sync): nothing to overlap with
        return Summary(step.end - step.start, 0.0, comm_s, 0.0, comm_s, 0.0)
    overlapped = sum((_overlap(span, (backward.start, backward.end)) for span in comm), 0.0)
    exposed = sum((_overlap(span, (backward.end, math.inf)) for span in comm), 0.0)
    wait = step.span("wait")
    return Summary(
        step_s=step.end - step.start,
        backward_s=backward.duration,
        comm_s=comm_s,
        overlapped_s=overlapped,
        exposed_s=exposed,
        tail_s=wait.duration if wait else 0.0,
    )


def union_of_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping intervals merged: the time covered by at least one (buckets in flight)."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def gather(steps: list[StepTimeline]) -> list[StepTimeline]:
    """Every rank's steps, on every rank (a collective: every rank must call it).

    Times are `time.perf_counter()`, which on Linux reads CLOCK_MONOTONIC: one clock for every
    process on a machine, so ranks on one host line up without any correction.
    """
    if not dist.is_initialized():
        return list(steps)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, steps)
    return [step for rank_steps in everyone for step in rank_steps]


@contextmanager
def recording(model: Observed, profiler_spans: bool = True) -> Iterator[list[Event]]:
    """Record `model`'s events inside the block; yields the (growing) list of events.

    A `Recorder` is `model.observer` inside the block; afterwards the observer it had is back
    (NO_OBSERVER: the hot path is back to one empty call per point). With `profiler_spans`,
    every span also becomes a `torch.profiler.record_function` range.
    """
    spans = ProfilerSpans() if profiler_spans else None
    recorder = Recorder() if spans is None else Recorder(spans)
    previous, model.observer = model.observer, recorder
    try:
        yield recorder.events
    finally:
        model.observer = previous
        if spans is not None:
            spans.close_all()


class ProfilerSpans:
    """An event listener that mirrors the spans as `torch.profiler.record_function` ranges.

    Every range opens and closes on the training thread. A bucket's range runs from its launch
    to the end of the final wait for it: the all-reduce's own work shows up beside it as gloo's
    `gloo:all_reduce` events on gloo's threads. (Closing a range from gloo's thread when the
    sum completes would be more precise, but with torch 2.13 on CPU that corrupted the
    profiler's heap and crashed the process at exit.) Bucket ranges overlap one another on the
    training thread's track, which Perfetto may draw imperfectly; `chrome_trace` below gives
    each bucket in flight a row of its own.
    """

    BRACKETS = {
        ("forward", "start"): ("open", "forward"),
        ("forward", "end"): ("close", "forward"),
        ("backward", "start"): ("open", "backward"),
        ("backward", "end"): ("close", "backward"),
        ("sync", "end"): ("close", "wait"),
    }

    def __init__(self) -> None:
        self._open: dict[str, torch.profiler.record_function] = {}

    def __call__(self, event: Event) -> None:
        key = (event.kind, event.name)
        if key == ("forward", "start"):
            self.close_all()  # anything left open by a backward that raised
        action, name = self.BRACKETS.get(key, ("", ""))
        if action == "open":
            self._open[name] = self._enter(name)
        elif action == "close" and name in self._open:
            self._open.pop(name).__exit__(None, None, None)
        if key == ("backward", "end"):
            self._open["wait"] = self._enter("wait")
        elif event.kind == "launch":
            self._open[event.name] = self._enter(event.name)
        elif event.kind == "wait" and event.name in self._open:
            self._open.pop(event.name).__exit__(None, None, None)

    @staticmethod
    def _enter(name: str) -> torch.profiler.record_function:
        span = torch.profiler.record_function(PROFILER_PREFIX + name)
        span.__enter__()
        return span

    def close_all(self) -> None:
        while self._open:
            self._open.popitem()[1].__exit__(None, None, None)
