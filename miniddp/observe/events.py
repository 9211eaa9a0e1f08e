"""What a step's moments are, and who hears them: the observer a core class holds.

MiniDDP, fully_shard's prefetcher and the pipeline schedule each hold an `observer` and call it
at named points: `note(kind, name)` as something happens, `note_when_done(pending, ...)` for a
collective that completes later on gloo's thread, `note_when_backward_starts(output)`. What they
hold until an instrument says otherwise is `NO_OBSERVER`, whose methods do nothing, so a step
nobody watches costs one attribute lookup and an empty call per point. The instruments (the
timelines, the figures, the benchmarks, the chapters) attach one from outside:

    recorder = ddp.observer = Recorder()      # or, for a block: with recording(ddp) as events:
    ddp(x).sum().backward()                   # (miniddp/observe/timeline.py)
    ddp.observer = NO_OBSERVER                # recorder.events keeps what was noted

The ladder's rungs (miniddp/steps/) keep `EventRecorder`, a mixin with `_note(...)`: each rung's
text is frozen, printed by the chapters and diffed against its neighbours, and the mixin keeps a
rung's noting to one short call. It notes through the same `observer`, so an instrument
attaches to a rung exactly as it does to MiniDDP. The core holds an observer instead of mixing
the recorder in because what the core a learner reads carries is the one attribute, not an
instrument's state (an event list, listeners, a recording flag).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class Event:
    """One moment in a step, as a `Recorder` keeps it (tutorials draw them)."""

    time: float  # time.perf_counter() seconds
    kind: str  # forward, backward, hook, ready, launch, reduced, wait, sync, rebuild, ...
    name: str


class Observer:
    """The points a core class calls as a step happens. This one ignores them all: it is
    `NO_OBSERVER`, what every core holds until an instrument attaches a `Recorder`.

    MiniDDP's kinds, in the order a synced step produces them: forward start/end, backward
    start, hook (one per parameter, in gradient-ready order), ready and launch (per bucket),
    reduced (per bucket, from the communication thread), backward end, wait (per bucket), sync
    end. The prefetcher's and the schedule's are in their files (sharding/prefetch.py,
    pipeline/schedule.py)."""

    def note(self, kind: str, name: str) -> None:
        """`kind` happened to `name` just now."""

    def note_when_done(self, pending: Any, kind: str, name: str) -> None:
        """Note `kind name` when the asynchronous collective `pending` (a Work or a future)
        completes: on the thread that completes it, where a communication lane ends."""

    def note_when_backward_starts(self, output: Any) -> None:
        """Note "backward start" when the first gradient reaches the forward's `output`."""


NO_OBSERVER = Observer()


class Recorder(Observer):
    """Keeps every moment noted in `events`, and hands each to the `listeners` as it happens
    (timeline.py's profiler spans, unit_lanes.py's memory probe)."""

    def __init__(self, *listeners: Callable[[Event], None]) -> None:
        self.events: list[Event] = []
        self.listeners = list(listeners)

    def note(self, kind: str, name: str) -> None:
        event = Event(time.perf_counter(), kind, name)
        self.events.append(event)
        for listener in self.listeners:
            listener(event)

    def note_when_done(self, pending: Any, kind: str, name: str) -> None:
        future = pending.get_future() if hasattr(pending, "get_future") else pending
        future.add_done_callback(lambda _: self.note(kind, name))

    def note_when_backward_starts(self, output: Any) -> None:
        for tensor in tree_leaves(output):  # tensors in (nested) tuples, lists and dicts
            if torch.is_tensor(tensor) and tensor.requires_grad:
                tensor.register_hook(lambda _: self.note("backward", "start"))
                return


class EventRecorder:
    """The rungs' mixin (see the module docstring): `_note(kind, name)` and its two timed
    cousins, each a call on `self.observer`, which `_start_event_log()` sets to NO_OBSERVER."""

    def _start_event_log(self) -> None:
        self.observer: Observer = NO_OBSERVER

    @property
    def _observed(self) -> bool:
        return self.observer is not NO_OBSERVER

    def _note(self, kind: str, name: str) -> None:
        self.observer.note(kind, name)

    def _note_when_backward_starts(self, output: Any) -> None:
        self.observer.note_when_backward_starts(output)

    def _note_when_done(self, pending: Any, name: str) -> None:
        self.observer.note_when_done(pending, "reduced", name)
