"""Meeting points: places in a script that every rank must reach, checked through the store.

`cleanup()` at the end of a script, `save_checkpoint` and `load_checkpoint` are not collectives
a user sees, but each needs every rank. Two classic mistakes break that: a rank that runs one
step more or fewer than the others, and `if rank == 0: save_checkpoint(...)`. Met with a gloo
barrier or collective, both hang until the process group's timeout (30 minutes by default),
then fail with a message that blames the wrong thing, or with none on the rank that moved on.

`meet(point)` posts "I am at `point`" in the store (notes.py) and waits until every rank has
posted the same. Meanwhile it looks, every 0.1 s at most, for signs that a rank never will:

    it arrived at another meeting point              (one rank saves, the other cleans up)
    it waits on a collective that this rank, being here, will never join: its collective
      #P, where P is this rank's own position        (one rank saves, the other trains on)
    it gave up on a collective, or it stopped        (a fault flag, a report, an exit note)

A rank waiting on a collective says so within 0.1 s (faults.py), so both sides know what
happened about a tenth of a second after the second one gets stuck, not at the timeout. A rank
that is merely busy (computing, or in a collective MiniDDP does not watch) is waited for until
the process group's timeout, as a barrier would; except at `cleanup()`.

At `cleanup()` a busy rank is waited for without a deadline. A rank there has finished its
collectives; if the busy one still had one to share, it would wait on it, post so, and the
meeting would fail at once, as above. So a rank that is merely absent is doing work of its own
(a final evaluation, rank 0 saving alone) and will come: `torch.distributed.
destroy_process_group()` would let this rank leave at once, and a deadline here would kill a
healthy job. One that dies on the way is torchrun's to notice: it stops the job when a worker
ends badly, and a rank that raises posts its exit note, which ends the wait here.
"""

from __future__ import annotations

import math
import sys
import time

import torch.distributed as dist

from miniddp.job.faults import POLL_S, SAME_STEPS, UNUSABLE, CollectiveFailed, describe_exit, ranks
from miniddp.job.notes import Board, Note, board_of, boards, first_line

FIRST_POLL_S = 0.005  # ranks usually arrive together: look again soon, then less and less often
CLEANUP = "cleanup()"


def meet(point: str, advice: str, group: dist.ProcessGroup | None = None) -> None:
    """Wait until every rank of `group` reaches `point` (e.g. "save_checkpoint()"); raise
    `CollectiveFailed` as soon as one is seen elsewhere, naming where, and ending with `advice`
    (how to call `point` correctly). A failure also tells the ranks waiting on a collective,
    through the fault flag, so that they stop waiting too."""
    board = board_of(group)
    try:
        _meet(board, point, advice)
    except CollectiveFailed:
        board.broken = True
        if point != CLEANUP:  # a rank in cleanup() already said so in its exit note
            board.post("report", Note(board.position, point))
            board.raise_fault_flag()
        raise


def leave_together(group: dist.ProcessGroup | None = None) -> None:
    """What `cleanup()` waits for: every rank of `group` done with its collectives.

    First this rank posts its exit note (how many collectives it finished): a rank still
    waiting on a collective from this one then learns at once that it will never come
    (faults.py names "different numbers of steps"). Then it meets the others at "cleanup()".
    A rank whose process already ended after as many collectives counts as arrived: nobody
    waits for it anyway.
    """
    for board in boards() or [board_of(group)]:
        board.post_exit(by_cleanup=True)
    handling = sys.exc_info()[1]  # `except ...: cleanup()`: this rank left mid-step
    advice = (
        f"This rank left a step with {type(handling).__name__}: {first_line(handling)}, while "
        "the others were still in it: fix that error."
        if handling is not None
        else f"The ranks ran different numbers of steps: {SAME_STEPS}."
    )
    meet(CLEANUP, advice, group)
    _rank_0_leaves_last(board_of(group))


def _rank_0_leaves_last(board: Board) -> None:
    """Without torchrun's agent (ranks started by hand, or by srun) the store every meeting
    goes through lives in rank 0's process. A rank that has seen everyone arrive may leave while
    another is still reading that rank 0 arrived; were rank 0 to exit first, that read would
    fail ("Connection reset by peer") in a healthy job. So each rank says it is through, and
    rank 0 leaves once every other rank has said so, or has ended (it counted as arrived)."""
    board.store.set(board.key("left", board.meetings, board.rank), "")
    if board.rank != 0:
        return
    through = {rank: board.key("left", board.meetings, rank) for rank in board.others()}
    deadline = time.monotonic() + board.timeout.total_seconds()
    pause = FIRST_POLL_S
    while through and time.monotonic() < deadline:
        for rank, key in list(through.items()):
            note = board.exit_note(rank)
            if board.store.check([key]) or (note is not None and not note.by_cleanup):
                del through[rank]
        if through:
            time.sleep(pause)
            pause = min(2 * pause, POLL_S)


def tell_the_others(word_on: str, word: str, group: dist.ProcessGroup | None = None) -> None:
    """Post `word` (e.g. "" for "the checkpoint is written", or why not) for whichever ranks
    wait on `word_on` in `hear_from`; this rank does not wait for them, nor need they come."""
    board = board_of(group)
    board.store.set(board.key("word", word_on), word)


def hear_from(rank: int, word_on: str, advice: str, group: dist.ProcessGroup | None = None) -> str:
    """Wait for `rank`'s word on `word_on` (`tell_the_others`), and return it; raise
    `CollectiveFailed` as soon as `rank` is seen elsewhere (at a meeting point, waiting on a
    collective that this rank, being here, will not join, or stopped), ending with `advice`.
    Unlike `meet`, only this rank waits: the speaker goes on without knowing who listened."""
    board = board_of(group)
    key = board.key("word", word_on)
    seconds = board.timeout.total_seconds()
    deadline = time.monotonic() + seconds
    pause = FIRST_POLL_S
    while not board.store.check([key]):
        where = _where_is(board, rank, word_on)
        if not where and board.fault_flagged_by() is not None:
            where = f"a fault was flagged by rank {board.fault_flagged_by()}"
        if not where and time.monotonic() > deadline:
            where = (
                f"said nothing within the process group's timeout ({seconds:g} s), and is not "
                "waiting on a collective that MiniDDP watches: its process died, or it is "
                "stuck or busy elsewhere"
            )
        if where:
            board.broken = True
            lines = [
                f"{word_on} on rank {board.rank} cannot go on: it waits for rank {rank}'s word.",
                f"  rank {rank}: {where}",
                f"  {advice}",
                f"  {UNUSABLE}",
            ]
            raise CollectiveFailed("\n".join(lines), word_on, [rank])
        time.sleep(pause)
        pause = min(2 * pause, POLL_S)
    return board.store.get(key).decode()


def _meet(board: Board, point: str, advice: str) -> None:
    board.arrive(point)
    arrived: set[int] = set()
    patience = Patience(board, point, wait_for_the_busy=point == CLEANUP)
    pause = FIRST_POLL_S
    while True:
        elsewhere: dict[int, str] = {}
        for rank in board.others():
            if rank in arrived:
                continue
            where = _where_is(board, rank, point)
            if where is None:
                arrived.add(rank)
            elif where:
                elsewhere[rank] = where
        if len(arrived) == board.world_size - 1:
            board.meetings += 1
            return
        flagged_by = board.fault_flagged_by()
        timed_out = patience.ran_out(set(board.others()) - arrived)
        if elsewhere or flagged_by is not None or timed_out:
            raise _failure(board, point, advice, arrived, elsewhere, timed_out)
        time.sleep(pause)
        pause = min(2 * pause, POLL_S)


class Patience:
    """How long a meeting waits for ranks that may still come: the process group's timeout, or,
    at cleanup(), for as long as they are busy, saying once that it waits."""

    def __init__(self, board: Board, point: str, wait_for_the_busy: bool) -> None:
        self.board, self.point, self.wait_for_the_busy = board, point, wait_for_the_busy
        self.deadline = time.monotonic() + board.timeout.total_seconds()

    def ran_out(self, absent: set[int]) -> bool:
        if time.monotonic() <= self.deadline:
            return False
        if not self.wait_for_the_busy:
            return True
        print(
            f"{self.point} on rank {self.board.rank}: waiting for {ranks(sorted(absent))}, "
            f"busy outside any collective for over {self.board.timeout.total_seconds():g} s "
            "(the process group's timeout); every collective is done, so this waits for "
            "as long as it takes.",
            file=sys.stderr,
            flush=True,
        )
        self.deadline = math.inf  # said once; from now on, no deadline
        return False


def _where_is(board: Board, rank: int, point: str) -> str | None:
    """None if `rank` arrived at `point`; where it is instead if it never will; "" if it may
    still come."""
    at = board.arrived_at(rank)
    if at == point:
        return None
    if at is not None:
        return f"arrived at {at} instead"
    report = board.read("report", rank)
    if report is not None:
        return f"waited on collective #{report.position}, {report.what}, and gave up"
    exit_note = board.exit_note(rank)
    if exit_note is not None:
        if point == CLEANUP and exit_note.finished == board.finished:
            return None  # it ended where cleanup() would have met it
        return describe_exit(exit_note)
    waiting = board.read("waiting", rank)
    if waiting is not None and waiting.position == board.position:
        return f"waits on collective #{waiting.position}, {waiting.what}"
    return ""  # not here yet: computing, or behind on collectives this rank has finished


def _failure(
    board: Board,
    point: str,
    advice: str,
    arrived: set[int],
    elsewhere: dict[int, str],
    timed_out: bool,
) -> CollectiveFailed:
    missing = [rank for rank in board.others() if rank not in arrived]
    lines = [f"{point} on rank {board.rank} cannot go on: {ranks(missing)} will not reach it."]
    seconds = board.timeout.total_seconds()
    for rank in missing:
        where = elsewhere.get(rank) or (
            f"did not arrive within the process group's timeout ({seconds:g} s), and is not "
            "waiting on a collective that MiniDDP watches: it is busy, stuck, or in a "
            "collective of its own"
            if timed_out
            else "has not arrived yet"
        )
        lines.append(f"  rank {rank}: {where}")
    lines.append(
        f"  rank {board.rank} (this one): finished {board.finished} collectives, then reached "
        f"{point}"
    )
    lines.append(f"  {advice}")
    if point != CLEANUP:  # cleanup() ends the group anyway
        lines.append(f"  {UNUSABLE}")
    return CollectiveFailed("\n".join(lines), point, missing)
