"""Timelines: what happened in each step, drawn, and how much communication hid behind compute.

MiniDDP (and the baselines in `miniddp/baselines.py`) note events while `record_events()` is on:
forward start/end, backward start, a hook per parameter, ready/launch/reduced/wait per bucket,
backward end and sync end. This module turns those instants into spans on two lanes per rank:

    compute         forward, backward, then the wait for the last all-reduces (and copy-back)
    communication   one span per bucket, from its launch to its all-reduce's completion

and shows them three ways: an ASCII timeline for the terminal, a Chrome trace (Perfetto,
chrome://tracing) merged across ranks, and summary numbers. The summary answers the question
this project exists for: how much of the communication ran while backward was still computing?

    with recording(ddp):                      # opt in; off by default and free when off
        ddp(x).sum().backward()
    steps = gather(split_steps(ddp.events, rank))   # every rank's steps, on every rank
    print(ascii_timeline(steps)); print(summarize(steps[0]))

While recording, the same spans also go through `torch.profiler.record_function`, so a
torch.profiler trace shows "miniddp: bucket 3" beside gloo's own `gloo:all_reduce` events.
"""

from __future__ import annotations

import json
import math
import string
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from miniddp.events import Event

COMPUTE = "compute"
COMM = "communication"
PROFILER_PREFIX = "miniddp: "


class Recordable(Protocol):
    """What `recording()` needs: MiniDDP has it, and so do the baselines."""

    events: list[Event] | None
    event_listeners: list

    def record_events(self, enabled: bool = True) -> None: ...


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
    comm = _union((s.start, s.end) for s in step.buckets)
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


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
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
def recording(model: Recordable, profiler_spans: bool = True) -> Iterator[list[Event]]:
    """Record `model`'s events inside the block; yields the (growing) list of events.

    With `profiler_spans`, every span also becomes a `torch.profiler.record_function` range.
    Afterwards recording is off and `event_listeners` is as it was: the hot path is back to
    one `if` per event.
    """
    spans = ProfilerSpans() if profiler_spans else None
    model.record_events(True)
    if spans is not None:
        model.event_listeners.append(spans)
    try:
        assert model.events is not None
        yield model.events
    finally:
        if spans is not None:
            model.event_listeners.remove(spans)
            spans.close_all()
        model.record_events(False)


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


BUCKET_LABELS = string.digits + string.ascii_lowercase + string.ascii_uppercase
COMPUTE_LABELS = {"forward": "f", "backward": "b", "wait": "w"}


def _label(span: Span) -> str:
    if span.lane == COMPUTE:
        return COMPUTE_LABELS.get(span.name, "?")
    index = int(span.name.split()[-1]) if span.name.split()[-1].isdigit() else 0
    return BUCKET_LABELS[index % len(BUCKET_LABELS)]


def ascii_timeline(steps: Sequence[StepTimeline], width: int = 96) -> str:
    """Draw steps on a shared time axis: a compute and a communication lane per rank and step.

    Compute: f forward, b backward, w waiting for the last all-reduces after backward.
    Communication: the bucket's index (0-9, then a-z, A-Z); where several buckets are in flight,
    the oldest, which is the one gloo works on: launches are queued in order.
    """
    if not steps:
        return "(no steps recorded)"
    t0 = min(step.start for step in steps)
    total = max(step.end for step in steps) - t0 or 1e-9
    cell = total / width
    several_steps = len({step.step for step in steps}) > 1
    names = {
        id(step): f"rank {step.rank}" + (f" step {step.step}" if several_steps else "")
        for step in steps
    }
    lane_width = max(len(COMPUTE), len(COMM))  # lane names in full
    indent = max(map(len, names.values())) + lane_width + 2
    lines = [f"{'':{indent}}|0 ms{f'{total * 1e3:.2f} ms':>{width - 4}}|"]
    for step in sorted(steps, key=lambda s: (s.step, s.rank)):
        for lane in (COMPUTE, COMM):
            spans = [s for s in step.spans if s.lane == lane]
            row = "".join(_cell(spans, t0 + i * cell, t0 + (i + 1) * cell) for i in range(width))
            who = names[id(step)] if lane == COMPUTE else ""
            lines.append(f"{who:<{indent - lane_width - 2}} {lane:<{lane_width}} |{row}|")
    lines.append(
        f"{'':{indent}} f forward, b backward, w wait after backward; 0-9a-z: bucket index"
    )
    return "\n".join(lines)


def _cell(spans: list[Span], start: float, end: float) -> str:
    middle = (start + end) / 2
    in_flight = [s for s in spans if s.start <= middle < s.end]
    touching = in_flight or [s for s in spans if s.start < end and s.end > start]
    if not touching:
        return " "
    return _label(min(touching, key=lambda s: s.start))


def chrome_trace(steps: Sequence[StepTimeline]) -> dict[str, Any]:
    """The steps as a Chrome trace (JSON object format): one process per rank, threads for
    compute and communication. Buckets in flight at the same time go on separate rows, since
    a trace viewer needs the spans on one thread to nest."""
    t0 = min((step.start for step in steps), default=0.0)

    def micros(seconds: float) -> float:
        return round((seconds - t0) * 1e6, 3)

    trace: list[dict[str, Any]] = []
    rows_of_rank: dict[int, list[float]] = {}
    for step in steps:
        pid = step.rank
        if pid not in rows_of_rank:
            rows_of_rank[pid] = []
            trace.append(_meta("process_name", pid, 0, f"rank {pid}"))
            trace.append(_meta("process_sort_index", pid, 0, pid))
            trace.append(_meta("thread_name", pid, 0, COMPUTE))
        rows = rows_of_rank[pid]
        for span in sorted(step.spans, key=lambda s: s.start):
            tid = 0
            if span.lane == COMM:
                row = next((i for i, free_at in enumerate(rows) if free_at <= span.start), None)
                if row is None:
                    row = len(rows)
                    rows.append(0.0)
                    suffix = f" {row + 1}" if row else ""
                    trace.append(_meta("thread_name", pid, row + 1, COMM + suffix))
                rows[row] = span.end
                tid = row + 1
            trace.append(
                {
                    "name": span.name,
                    "cat": span.lane,
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "ts": micros(span.start),
                    "dur": round(span.duration * 1e6, 3),
                    "args": {"step": step.step},
                }
            )
        for mark in step.marks:
            trace.append(
                {
                    "name": f"{mark.kind} {mark.name}",
                    "cat": mark.kind,
                    "ph": "i",
                    "s": "t",
                    "pid": pid,
                    "tid": 0,
                    "ts": micros(mark.time),
                    "args": {"step": step.step},
                }
            )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def _meta(name: str, pid: int, tid: int, value: Any) -> dict[str, Any]:
    key = "sort_index" if name.endswith("sort_index") else "name"
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def write_chrome_trace(steps: Sequence[StepTimeline], path: str | Path) -> Path:
    """Write the merged trace; open it at ui.perfetto.dev or chrome://tracing."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(steps)))
    return path


def plot(steps: Sequence[StepTimeline], path: str | Path, title: str = "") -> Path:
    """Save the timeline as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(12, 0.5 + 0.9 * len(steps)))
    draw(axes, steps)
    axes.set_title(title)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def draw(axes: Any, steps: Sequence[StepTimeline], t0: float | None = None) -> None:
    """Draw the steps' lanes on matplotlib `axes`, in ms from `t0` (default: the first start)."""
    t0 = min(step.start for step in steps) if t0 is None else t0
    lanes = [(step, lane) for step in steps for lane in (COMPUTE, COMM)]
    colors = {"forward": "tab:blue", "backward": "tab:green", "wait": "tab:red"}
    for row, (step, lane) in enumerate(lanes):
        for span in (s for s in step.spans if s.lane == lane):
            color = colors.get(span.name, "tab:orange" if _label(span) in "02468" else "tab:brown")
            start_ms = (span.start - t0) * 1e3
            axes.broken_barh([(start_ms, span.duration * 1e3)], (row - 0.4, 0.8), color=color)
            if lane == COMM:
                axes.text(start_ms, row, _label(span), va="center", fontsize=7)
    axes.set_yticks(range(len(lanes)))
    axes.set_yticklabels([f"rank {s.rank} step {s.step} {lane}" for s, lane in lanes])
    axes.invert_yaxis()
    axes.set_xlabel("ms")
