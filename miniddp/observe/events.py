"""What a DDP wrapper notes as a step happens, for the timeline (miniddp/observe/timeline.py)
to draw.

MiniDDP and the baselines it is compared with (miniddp/instruments/bench/baselines.py) note the same
events, so every design is drawn and measured the same way.
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
    """One moment in a step, recorded when `record_events()` is on (tutorials draw them)."""

    time: float
    kind: str  # forward, backward, hook, ready, launch, reduced, wait, sync, rebuild
    name: str


class EventRecorder:
    """`record_events()`, `events` and `event_listeners` for a DDP wrapper.

    Off by default, and then `_note` is one check and allocates nothing.
    """

    def _start_event_log(self) -> None:
        self.events: list[Event] | None = None
        self._recording = False
        # Called with every Event as it happens (timeline.py uses this for profiler spans).
        self.event_listeners: list[Callable[[Event], None]] = []

    @property
    def _observed(self) -> bool:
        return self._recording or bool(self.event_listeners)

    def record_events(self, enabled: bool = True) -> None:
        """Start recording a fresh timeline into `events`, or stop (the list is kept).

        Kinds, in the order a synced step produces them: forward start/end, backward start,
        hook (one per parameter, in gradient-ready order), ready and launch (per bucket),
        reduced (per bucket, from the communication thread), backward end, wait (per bucket),
        sync end. Times are `time.perf_counter()` seconds.
        """
        if enabled:
            self.events = []
        self._recording = enabled

    def _note(self, kind: str, name: str) -> None:
        if not (self._recording or self.event_listeners):
            return  # the common case: one check, nothing allocated
        event = Event(time.perf_counter(), kind, name)
        events = self.events
        if self._recording and events is not None:
            events.append(event)
        for listener in self.event_listeners:
            listener(event)

    def _note_when_backward_starts(self, output: Any) -> None:
        """Note "backward start" when the first gradient reaches the forward's output."""
        for tensor in tree_leaves(output):  # tensors in (nested) tuples, lists and dicts
            if torch.is_tensor(tensor) and tensor.requires_grad:
                tensor.register_hook(lambda _: self._note("backward", "start"))
                return

    def _note_when_done(self, pending: Any, name: str) -> None:
        """While events are observed, note "reduced" when an async collective (a Work or a
        future) completes: on gloo's thread, where the timeline's communication lane ends."""
        if self._observed:
            future = pending.get_future() if hasattr(pending, "get_future") else pending
            future.add_done_callback(lambda _: self._note("reduced", name))
