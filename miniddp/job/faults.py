"""When a collective cannot finish: say which one, and which ranks are missing.

A collective finishes only when every rank joins it. If one rank has died, stalled, or gone on to
other work, the others wait, and gloo eventually says "Connection reset by peer [127.0.0.1]:38112"
(a peer's process ended) or "Timed out waiting 300000ms for recv operation" (a peer is alive but
silent, which takes the process group's whole timeout to notice). Both are true, and neither names
the collective or the rank.

`wait_for(work, what)` waits like `work.wait()` (or a future's `wait()`). When the collective
fails or times out, the ranks still alive compare notes through the process group's store, a
key-value server every rank reaches without going through gloo's connections (the notes are
listed in notes.py):

    a rank that gives up posts what it was waiting on, and raises a flag
    a rank that stops (cleanup(), or its process ends) posts how many collectives it finished,
    and its exception if any
    a rank still waiting on a late collective says so, and looks every 0.1 s for the flag, or
    for a rank that stopped before joining, and joins in
    after a short grace period, a rank that posted nothing is named as missing

Every survivor then raises `CollectiveFailed`, for example

    all-reduce of bucket 0 (1,284 bytes) could not finish on rank 0: rank 1 is missing.
      rank 1: posted nothing within 1 s, and a connection closed: most likely its process died
      abruptly (killed, crashed, os._exit)
      rank 0: waiting on it, as collective #6
      First sign: the collective failed: Read error [127.0.0.1]:49536: Connection reset by peer.

A pipeline's sends and receives are not collectives (ranks run different numbers of them):
`wait_for_transfer` waits for one without counting it, and listens for the same notes.

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
callback must take Python's lock on gloo's thread before gloo moves on to the next collective
(what that costs: docs/PERFORMANCE.md).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from functools import partial
from queue import SimpleQueue
from typing import Any

import torch
import torch.distributed as dist

from miniddp.collectives.comm_thread import Work as MiniWork
from miniddp.job.notes import Board, ExitNote, Note, board_of, collective_timeout, first_line

__all__ = ["CollectiveFailed", "collective_timeout", "future_of", "wait_for", "wait_for_transfer"]

REPORT_GRACE_S = 1.0  # how long survivors wait to hear from every other rank
GLOO_FAILED = "the collective failed: "  # the first sign when gloo's own wait raised
POLL_S = 0.1  # while a collective is late: how often to look for another rank's fault flag
SAME_STEPS = "give every rank the same number of batches, e.g. with DistributedSampler"
UNUSABLE = (
    "The process group cannot be used after this: end the process (torchrun then stops the "
    "job, or restarts it with --max-restarts)."
)


class CollectiveFailed(RuntimeError):
    """A collective could not finish; the message names it and the ranks that did not join."""

    def __init__(self, message: str, collective: str, missing_ranks: list[int]) -> None:
        super().__init__(message)
        self.collective = collective
        self.missing_ranks = missing_ranks


def wait_for(
    pending: dist.Work | MiniWork | torch.futures.Future,
    what: str,
    group: dist.ProcessGroup | None = None,
) -> Any:
    """Wait for an async collective and return its future's value, like
    `work.get_future().wait()`; but a collective that cannot finish raises `CollectiveFailed`
    naming `what` (e.g. "all-reduce of bucket 2 (1,048,576 bytes)") and the missing ranks.

    Every rank must route the same collectives through it, in the same order: the count of
    collectives finished is how ranks tell each other where they are.
    """
    board = board_of(group)
    future = future_of(pending)
    timed_wait = isinstance(pending, dist.Work) and board.timed_waits
    try:
        if not future.done():
            _wait_listening_for_faults(board, pending if timed_wait else future, what)
        result = future.wait()
    except CollectiveFailed:
        raise
    except RuntimeError as error:  # gloo: a peer's connection closed, or the timeout passed
        raise _diagnose(board, what, f"{GLOO_FAILED}{first_line(error)}") from error
    board.finished += 1
    return result


def wait_for_transfer(
    work: dist.Work, what: str, peer: int, group: dist.ProcessGroup | None
) -> None:
    """Wait for a point-to-point send or receive with `peer` (its rank in `group`), like
    `work.wait()`; but a peer that stopped without sending it, or a rank that gave up, raises
    `CollectiveFailed` naming `what` ("the receive of activation 3 from stage 1") within
    POLL_S + REPORT_GRACE_S, not after the process group's timeout.

    A transfer is not a collective: it is not counted (ranks run different numbers of them)
    and posts no "waiting" note (a note has no transfer's number to be matched by). And a gloo
    receive cannot be waited for POLL_S at a time: a timed wait that runs out closes the
    connection ("Application timeout caused pair closure"). So a helper thread (_Blocker)
    blocks in gloo's own `wait()` (in C++, the GIL released) while this one listens to the
    store: for the fault flag, or for the peer's exit note (it called cleanup() or its process
    ended, say after its stage raised). A peer that stopped after its last send is no fault:
    the transfer gets REPORT_GRACE_S more to arrive before this rank gives up."""
    board = board_of(group)
    if not board.timed_waits:  # NCCL: its wait tears the job down at the timeout anyway
        try:
            work.wait()
        except RuntimeError as error:
            raise _diagnose(board, what, f"{GLOO_FAILED}{first_line(error)}") from error
        return
    done, failure = _Blocker.hand(work)
    while not done.wait(POLL_S):
        cause = _news_of_a_fault(board, only=peer)
        if cause is not None and not done.wait(REPORT_GRACE_S):
            raise _diagnose(board, what, cause)
    if failure:
        raise _diagnose(board, what, f"{GLOO_FAILED}{first_line(failure[0])}") from failure[0]


class _Blocker:
    """The thread that blocks in gloo's `wait()` for wait_for_transfer, one transfer at a time
    (its caller waits for each before handing the next). One thread for the process, not one per
    transfer: starting a thread costs several times the hand-over (about 330 us against 80 us
    measured here on a busy machine). A transfer given up on leaves its thread blocked until
    gloo's timeout; the next transfer then gets a thread of its own."""

    current: _Blocker | None = None

    def __init__(self) -> None:
        self.idle = True
        self.requests: SimpleQueue = SimpleQueue()
        threading.Thread(target=self._run, name="miniddp-transfer-wait", daemon=True).start()

    @classmethod
    def hand(cls, work: dist.Work) -> tuple[threading.Event, list[RuntimeError]]:
        """Start blocking on `work`: the event is set when it finished, the list then holds
        what it raised (a peer's connection closed, or the timeout passed)."""
        if cls.current is None or not cls.current.idle:
            cls.current = cls()
        cls.current.idle = False
        done, failure = threading.Event(), []
        cls.current.requests.put((work, done, failure))
        return done, failure

    def _run(self) -> None:
        while True:
            work, done, failure = self.requests.get()
            try:
                work.wait()
            except RuntimeError as error:
                failure.append(error)
            self.idle = True
            done.set()


def future_of(pending: dist.Work | MiniWork | torch.futures.Future) -> torch.futures.Future:
    """The future of an async collective's `Work`, torch's or `miniddp.collectives`' (or the
    future itself)."""
    return pending.get_future() if isinstance(pending, (dist.Work, MiniWork)) else pending


def _wait_listening_for_faults(
    board: Board, pending: dist.Work | torch.futures.Future, what: str
) -> None:
    """Block until `pending` completes, the store shows it never will, or the timeout passes."""
    if isinstance(pending, dist.Work):
        finished_within = partial(_work_finished_within, pending)
    else:
        done = threading.Event()
        pending.add_done_callback(lambda _: done.set())
        finished_within = done.wait
    deadline = time.monotonic() + board.timeout.total_seconds()
    said_late = False
    while not finished_within(POLL_S):
        if not said_late:  # a rank waiting at a meeting point (meet.py) reads this
            board.post("waiting", Note(board.position, what))
            said_late = True
        cause = _news_of_a_fault(board)
        if cause is not None:
            raise _diagnose(board, what, cause)
        if time.monotonic() > deadline:
            seconds = board.timeout.total_seconds()
            raise _diagnose(board, what, f"it timed out after {seconds:g} s")


def _work_finished_within(work: dist.Work, seconds: float) -> bool:
    """Has `work` completed, well or badly, within `seconds`? gloo's timed wait raises
    "Operation timed out!" when the time is up, and the collective may complete a moment later,
    before `is_completed()` is asked. So a raise is never a verdict: a completed work's own
    outcome (its sum, or the peer's closed connection) comes from the caller's `future.wait()`,
    and an unfinished one is merely late. The timed wait does not spoil the work."""
    try:
        return work.wait(timeout=timedelta(seconds=seconds))
    except RuntimeError:
        return work.is_completed()


def _news_of_a_fault(board: Board, only: int | None = None) -> str | None:
    """Has another rank given up, or has a rank (`only` that one, if given) stopped without
    joining this collective?"""
    flagged_by = board.fault_flagged_by()
    if flagged_by is not None:
        return f"rank {flagged_by} gave up first"
    if not board.anyone_exited():
        return None
    for rank in board.others() if only is None else [only]:
        note = board.exit_note(rank)
        # A rank that stopped after finishing this collective is no fault: its share is sent.
        if note is not None and note.finished <= board.finished:
            return _stopped_without_joining(rank, note)
    return None


def _stopped_without_joining(rank: int, note: ExitNote) -> str:
    who = f"rank {rank} called cleanup()" if note.by_cleanup else f"rank {rank}'s process ended"
    return f"{who} without joining it"


def _diagnose(board: Board, what: str, cause: str) -> CollectiveFailed:
    """Post where this rank is, hear from the others, and build the error every survivor raises."""
    position = board.position
    board.broken = True
    try:
        board.post("report", Note(position, what))
        board.raise_fault_flag()
        reports, exits = _hear_from_everyone(board)
    except Exception as store_error:  # the store's host may be gone too
        return CollectiveFailed(
            f"{what} could not finish on rank {board.rank} ({cause}), and the store where ranks "
            f"leave word for each other is unreachable too ({first_line(store_error)}): the "
            "process hosting it has most likely died (in multi-node launches, rank 0's)",
            what,
            [],
        )
    missing = [rank for rank in range(board.world_size) if rank not in reports]
    # gloo's error ("Connection closed by peer") names no rank; an exit note says which one
    # stopped before this collective, and that is the first sign worth reading.
    stopped = [r for r, note in sorted(exits.items()) if note.finished <= position]
    if stopped and cause.startswith(GLOO_FAILED):
        gloo_said = cause.removeprefix(GLOO_FAILED)
        cause = f"{_stopped_without_joining(stopped[0], exits[stopped[0]])} (gloo: {gloo_said})"
    lines = [f"{what} could not finish on rank {board.rank}: {_name_ranks(missing)}."]
    for rank in missing:
        lines.append(f"  rank {rank}: {_why_missing(exits.get(rank), position, cause)}")
    same, elsewhere = [], []
    for rank, report in sorted(reports.items()):
        if report == Note(position, what):
            same.append(rank)
        else:
            elsewhere.append(f"  rank {rank}: waiting on #{report.position}, {report.what}")
    lines.append(f"  {ranks(same)}: waiting on it, as collective #{position}")
    if elsewhere:
        lines += elsewhere
        lines.append("  The ranks are out of step: they issued different collectives.")
    lines.append(f"  First sign: {cause}.")
    if "timed out" in cause.lower():
        lines.append("  The timeout is the process group's: init_distributed(timeout=...) sets it.")
    lines.append(f"  {UNUSABLE}")
    return CollectiveFailed("\n".join(lines), what, missing)


def _hear_from_everyone(board: Board) -> tuple[dict[int, Note], dict[int, ExitNote]]:
    """Collect each rank's report (where it is stuck) or exit note, for up to REPORT_GRACE_S."""
    reports: dict[int, Note] = {}
    exits: dict[int, ExitNote] = {}
    deadline = time.monotonic() + REPORT_GRACE_S
    while True:
        for rank in range(board.world_size):
            if rank in reports or rank in exits:
                continue
            report = board.read("report", rank)
            if report is not None:
                reports[rank] = report
            elif (note := board.exit_note(rank)) is not None:
                exits[rank] = note
        if len(reports) + len(exits) == board.world_size or time.monotonic() > deadline:
            return reports, exits
        time.sleep(POLL_S / 2)


def _why_missing(note: ExitNote | None, position: int, cause: str) -> str:
    if note is None:
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
    if note.crash:
        return describe_exit(note)
    return (
        f"{describe_exit(note)}, while this rank waits for collective #{position}: the ranks "
        f"ran different numbers of steps ({SAME_STEPS})"
    )


def describe_exit(note: ExitNote) -> str:
    """Says how a rank stopped, e.g. "its process ended with ValueError: ..., after finishing 4
    collectives"."""
    if note.crash and note.by_cleanup:
        return (
            f"it called cleanup() while handling {note.crash}, after finishing {note.finished} "
            "collectives"
        )
    if note.crash:
        return f"its process ended with {note.crash}, after finishing {note.finished} collectives"
    if note.by_cleanup:
        return f"it finished after {note.finished} collectives and called cleanup()"
    return f"its process ended normally after finishing {note.finished} collectives"


def _name_ranks(missing: list[int]) -> str:
    if not missing:
        return "every rank reported in, so none is missing; see below for where each one was"
    verb = "is" if len(missing) == 1 else "are"
    return f"{ranks(missing)} {verb} missing"


def ranks(numbers: list[int]) -> str:
    """Names ranks: "rank 1", "ranks 0, 2", or "no rank"."""
    if not numbers:
        return "no rank"
    return f"rank {numbers[0]}" if len(numbers) == 1 else f"ranks {', '.join(map(str, numbers))}"
