"""When a collective cannot finish: say which one, and which ranks are missing.

A collective finishes only when every rank joins it. If one rank has died, stalled, or gone on to
other work, the others wait, and gloo eventually says "Connection reset by peer [127.0.0.1]:38112"
(a peer's process ended) or "Timed out waiting 300000ms for recv operation" (a peer is alive but
silent, which takes the process group's whole timeout to notice). Both are true, and neither names
the collective or the rank.

`wait_for(work, what)` waits like `work.wait()` (or a future's `wait()`). When the collective
fails or times out, the ranks still alive compare notes through the process group's store, a
key-value server every rank reaches without going through gloo's connections:

    a rank that gives up posts what it was waiting on, and raises a flag
    a rank whose process ends posts how many collectives it finished, and its exception if any
    a rank still waiting on a late collective looks every 0.1 s for the flag, or for a process
    that ended before joining, and joins in
    after a short grace period, a rank that posted nothing is named as missing

Every survivor then raises `CollectiveFailed`, for example

    all-reduce of bucket 0 (1,284 bytes) could not finish on rank 0: rank 1 is missing.
      rank 1: posted nothing within 1 s, and a connection closed: most likely its process died
      abruptly (killed, crashed, os._exit)
      rank 0: waiting on it, as collective #6
      First sign: the collective failed: Read error [127.0.0.1]:49536: Connection reset by peer.

If the store itself is gone (with several nodes, launch.sh gives each job a store hosted by
rank 0's process), the error still names the collective and says that the store went with it.

How long a silent rank is waited for is the process group's timeout, set where the group starts:
`init_distributed(timeout=timedelta(seconds=30))` or `init_process_group(..., timeout=...)`.
There is deliberately no second knob: a shorter MiniDDP timeout would abandon gloo mid-collective
anyway, and a longer one would never fire.

While collectives finish in time the store is never touched. Given gloo's `Work`, the wait
costs nothing extra: it blocks in torch's C++ for up to 0.1 s at a time, and gloo wakes it
directly. Given a future (a comm hook's), or NCCL's Work (whose timed wait aborts the
communicator when the time is up), it waits on an event that a callback sets; on gloo that
callback must take Python's lock on gloo's thread before gloo moves on to the next collective,
which cost 2-5% of a step that waits for 8 buckets in a row (chapter 04's model, paired runs).
"""

from __future__ import annotations

import atexit
import re
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

REPORT_GRACE_S = 1.0  # how long survivors wait to hear from every other rank
POLL_S = 0.1  # while a collective is late: how often to look for another rank's fault flag
KEY_PREFIX = "miniddp-faults"


class CollectiveFailed(RuntimeError):
    """A collective could not finish; the message names it and the ranks that did not join."""

    def __init__(self, message: str, collective: str, missing_ranks: list[int]) -> None:
        super().__init__(message)
        self.collective = collective
        self.missing_ranks = missing_ranks


@dataclass
class _Watch:
    """One process's view of one process group: its store, and how far this rank has got."""

    store: dist.Store | None  # None once the group was shut down cleanly
    rank: int
    world_size: int
    timeout: timedelta
    # gloo's Work can be waited for 0.1 s at a time; NCCL's tears the job down on the first miss
    timed_waits: bool
    finished: int = 0  # collectives this rank completed through wait_for
    crash: str | None = None  # the exception that is ending this process, if any

    def key(self, *parts: object) -> str:
        return "/".join([KEY_PREFIX, *map(str, parts)])


_WATCHES: dict[Any, _Watch] = {}


def collective_timeout(group: dist.ProcessGroup | None = None) -> timedelta:
    """The process group's timeout: how long a collective may wait for a silent rank."""
    group = group or dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            # `options._timeout` is private, but it is the only place the group keeps its timeout.
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return dist.default_pg_timeout


def wait_for(
    pending: dist.Work | torch.futures.Future,
    what: str,
    group: dist.ProcessGroup | None = None,
) -> Any:
    """Wait for an async collective and return its future's value, like
    `work.get_future().wait()`; but a collective that cannot finish raises `CollectiveFailed`
    naming `what` (e.g. "all-reduce of bucket 2 (1,048,576 bytes)") and the missing ranks.

    Every rank must route the same collectives through it, in the same order: the count of
    collectives finished is how ranks tell each other where they are.
    """
    watch = _watch(group)
    future = future_of(pending)
    timed_wait = isinstance(pending, dist.Work) and watch.timed_waits
    try:
        if not future.done():
            _wait_listening_for_faults(watch, pending if timed_wait else future, what)
        result = future.wait()
    except CollectiveFailed:
        raise
    except RuntimeError as error:  # gloo: a peer's connection closed, or the timeout passed
        raise _diagnose(watch, what, f"the collective failed: {_first_line(error)}") from error
    watch.finished += 1
    return result


def future_of(pending: dist.Work | torch.futures.Future) -> torch.futures.Future:
    """The future of an async collective's `Work` (or the future itself)."""
    return pending.get_future() if isinstance(pending, dist.Work) else pending


def _watch(group: dist.ProcessGroup | None) -> _Watch:
    group = group or dist.group.WORLD
    watch = _WATCHES.get(group)
    if watch is None:
        watch = _WATCHES[group] = _Watch(
            store=group.get_group_store(),
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
            timeout=collective_timeout(group),
            timed_waits=dist.get_backend(group) == "gloo",
        )
        atexit.register(_post_exit, watch)
        _record_crashes(watch)
    return watch


def _wait_listening_for_faults(
    watch: _Watch, pending: dist.Work | torch.futures.Future, what: str
) -> None:
    """Block until `pending` completes, the store shows it never will, or the timeout passes."""
    if isinstance(pending, dist.Work):
        finished_within = partial(_work_finished_within, pending)
    else:
        done = threading.Event()
        pending.add_done_callback(lambda _: done.set())
        finished_within = done.wait
    deadline = time.monotonic() + watch.timeout.total_seconds()
    while not finished_within(POLL_S):
        cause = _news_of_a_fault(watch)
        if cause is not None:
            raise _diagnose(watch, what, cause)
        if time.monotonic() > deadline:
            seconds = watch.timeout.total_seconds()
            raise _diagnose(watch, what, f"it timed out after {seconds:g} s")


def _work_finished_within(work: dist.Work, seconds: float) -> bool:
    try:
        return work.wait(timeout=timedelta(seconds=seconds))
    except RuntimeError:
        if work.is_completed():
            raise  # it failed: the caller diagnoses
        return False  # "Operation timed out!": merely late, so far


def _news_of_a_fault(watch: _Watch) -> str | None:
    """Has another rank given up, or has a process ended without joining this collective?"""
    if watch.store.check([watch.key("fault")]):
        flagged_by = watch.store.get(watch.key("fault")).decode()
        return f"rank {flagged_by} gave up on a collective first"
    if watch.store.add(watch.key("exits"), 0) == 0:  # one counter, so the common case is cheap
        return None
    for rank in range(watch.world_size):
        if rank != watch.rank and watch.store.check([watch.key("exited", rank)]):
            finished = int(watch.store.get(watch.key("exited", rank)).decode().split("|")[0])
            # A rank that ended after finishing this collective is no fault: its share is sent.
            if finished <= watch.finished:
                return f"rank {rank}'s process ended without joining it"
    return None


def _diagnose(watch: _Watch, what: str, cause: str) -> CollectiveFailed:
    """Post where this rank is, hear from the others, and build the error every survivor raises."""
    position = watch.finished + 1
    try:
        watch.store.set(watch.key("report", watch.rank), f"{position}|{what}")
        if not watch.store.check([watch.key("fault")]):
            watch.store.set(watch.key("fault"), str(watch.rank))
        reports, exits = _hear_from_everyone(watch)
    except Exception as store_error:  # the store's host may be gone too
        return CollectiveFailed(
            f"{what} could not finish on rank {watch.rank} ({cause}), and the store where ranks "
            f"leave word for each other is unreachable too ({_first_line(store_error)}): the "
            "process hosting it has most likely died (in multi-node launches, rank 0's)",
            what,
            [],
        )
    missing = [rank for rank in range(watch.world_size) if rank not in reports]
    lines = [f"{what} could not finish on rank {watch.rank}: {_name_ranks(missing)}."]
    for rank in missing:
        lines.append(f"  rank {rank}: {_why_missing(exits.get(rank), position, cause)}")
    same, elsewhere = [], []
    for rank, report in sorted(reports.items()):
        their_position, their_what = report.split("|", 1)
        if int(their_position) == position and their_what == what:
            same.append(rank)
        else:
            elsewhere.append(f"  rank {rank}: waiting on #{their_position}, {their_what}")
    lines.append(f"  {_ranks(same)}: waiting on it, as collective #{position}")
    if elsewhere:
        lines += elsewhere
        lines.append("  The ranks are out of step: they issued different collectives.")
    lines.append(f"  First sign: {cause}.")
    if "timed out" in cause.lower():
        lines.append("  The timeout is the process group's: init_distributed(timeout=...) sets it.")
    lines.append(
        "  The process group cannot be used after this: end the process (torchrun then stops the "
        "job, or restarts it with --max-restarts)."
    )
    return CollectiveFailed("\n".join(lines), what, missing)


def _hear_from_everyone(watch: _Watch) -> tuple[dict[int, str], dict[int, str]]:
    """Collect each rank's report (where it is stuck) or exit note, for up to REPORT_GRACE_S."""
    reports: dict[int, str] = {}
    exits: dict[int, str] = {}
    deadline = time.monotonic() + REPORT_GRACE_S
    while True:
        for rank in range(watch.world_size):
            if rank in reports or rank in exits:
                continue
            if watch.store.check([watch.key("report", rank)]):
                reports[rank] = watch.store.get(watch.key("report", rank)).decode()
            elif watch.store.check([watch.key("exited", rank)]):
                exits[rank] = watch.store.get(watch.key("exited", rank)).decode()
        if len(reports) + len(exits) == watch.world_size or time.monotonic() > deadline:
            return reports, exits
        time.sleep(POLL_S / 2)


def _why_missing(exit_note: str | None, position: int, cause: str) -> str:
    if exit_note is None:
        silent = f"posted nothing within {REPORT_GRACE_S:g} s"
        if "connection" in cause.lower():  # gloo: "Connection closed by peer", "reset by peer"
            return (
                f"{silent}, and a connection closed: most likely its process died abruptly "
                "(killed, crashed, os._exit)"
            )
        if "timed out" in cause.lower():
            return (
                f"{silent}, yet its connections stayed open: most likely it is alive but "
                "not taking part (stuck, sleeping, or waiting in a collective of its own)"
            )
        return f"{silent}: its process died abruptly, or it is stuck outside MiniDDP"
    finished, crash = exit_note.split("|", 1)
    if crash:
        return f"its process ended with {crash}, after finishing {finished} collectives"
    return (
        f"its process ended normally after finishing {finished} collectives, while this rank "
        f"waits for collective #{position}: the ranks ran different numbers of steps (give "
        "every rank the same number of batches, e.g. with DistributedSampler)"
    )


def forget_watches() -> None:
    """Drop every group's watch, store included: called when the process group is destroyed,
    so nothing touches a dead group's store while the interpreter shuts down."""
    for watch in _WATCHES.values():
        atexit.unregister(_post_exit)
        watch.store = None
    _WATCHES.clear()


def _post_exit(watch: _Watch) -> None:
    """At interpreter exit: tell the others how far this rank got (os._exit skips this)."""
    if watch.store is None:
        return  # the group was shut down cleanly: nobody is waiting for this rank
    try:
        watch.store.set_timeout(timedelta(seconds=2))  # never hold up an exit for long
        watch.store.set(watch.key("exited", watch.rank), f"{watch.finished}|{watch.crash or ''}")
        watch.store.add(watch.key("exits"), 1)
    except Exception:
        pass  # the store may already be gone; the others will say "posted nothing"


def _record_crashes(watch: _Watch) -> None:
    """Remember the exception that ends this process, so the exit note can name it."""
    previous = sys.excepthook

    def record_then_report(kind, value, traceback) -> None:
        watch.crash = f"{kind.__name__}: {_first_line(value)}"
        previous(kind, value, traceback)

    sys.excepthook = record_then_report


def _name_ranks(missing: list[int]) -> str:
    if not missing:
        return "every rank reported in, so none is missing; see below for where each one was"
    verb = "is" if len(missing) == 1 else "are"
    return f"{_ranks(missing)} {verb} missing"


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "no rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _first_line(error: BaseException) -> str:
    """gloo's "[.../pair.cc:537] Read error [...]: Connection reset by peer. This is typically..."
    becomes "Read error [...]: Connection reset by peer": the first sentence, without the path."""
    text = re.sub(r"^\[[^\]]+:\d+\]\s*", "", str(error).strip())
    text = text.splitlines()[0] if text else type(error).__name__
    return text.split(". ", 1)[0].rstrip(".")
