"""Where each rank is, written where every other rank can read it: the process group's store.

gloo's connections carry the collectives; when one cannot finish, they cannot carry the
explanation too. The store can: a key-value server (or file) that every rank reaches directly,
whatever happened to the others. Each rank writes under its own number R:

    waiting/R     "P|what"        R waits on its collective #P (posted once that one is late)
    report/R      "P|what"        R gave up on its collective #P (or on a meeting point)
    fault         "R"             the first rank that gave up: everyone else stops waiting
    met/M/R       "point"         R arrived at its M-th meeting point, e.g. "cleanup()"
    exited/R      "N|how|crash"   R stopped after finishing N collectives, through cleanup() or
                                  by its process ending; the exception that ended it, if any
    exits         a count of exit notes, so that a waiting rank reads one key, not W

"#P" counts the collectives a rank finished through `wait_for`: ranks running the same code
agree on it, so each can tell where another one is relative to itself. While collectives finish
in time no note is written or read.
"""

from __future__ import annotations

import atexit
import re
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

KEY_PREFIX = "miniddp-faults"


@dataclass(frozen=True)
class Note:
    """A rank's position and what it does there: #12, "all-reduce of bucket 0 (1,284 bytes)"."""

    position: int
    what: str

    @classmethod
    def parse(cls, text: str) -> Note:
        position, what = text.split("|", 1)
        return cls(int(position), what)

    def __str__(self) -> str:
        return f"{self.position}|{self.what}"


@dataclass(frozen=True)
class ExitNote:
    finished: int  # collectives the rank finished before it stopped
    by_cleanup: bool  # it called cleanup(); otherwise its process ended without it
    crash: str  # "ValueError: ..." if an exception ended the process, else ""


@dataclass
class Board:
    """One process's view of one process group's notes, and how far this rank has got."""

    store: dist.Store | None  # None once the group was shut down cleanly
    rank: int
    world_size: int
    timeout: timedelta  # the process group's: how long a silent rank is waited for
    # gloo's Work can be waited for 0.1 s at a time; NCCL's tears the job down on the first miss
    timed_waits: bool
    finished: int = 0  # collectives this rank completed through wait_for
    meetings: int = 0  # meeting points this rank passed
    broken: bool = False  # a collective or meeting failed here: the group is unusable

    @property
    def position(self) -> int:
        """The number of the collective this rank waits on, or will issue next."""
        return self.finished + 1

    def others(self) -> list[int]:
        return [rank for rank in range(self.world_size) if rank != self.rank]

    def key(self, *parts: object) -> str:
        return "/".join([KEY_PREFIX, *map(str, parts)])

    def post(self, kind: str, note: Note) -> None:
        self.store.set(self.key(kind, self.rank), str(note))

    def read(self, kind: str, rank: int) -> Note | None:
        text = self._get(self.key(kind, rank))
        return None if text is None else Note.parse(text)

    def arrive(self, point: str) -> None:
        self.store.set(self.key("met", self.meetings, self.rank), point)

    def arrived_at(self, rank: int) -> str | None:
        """Where `rank` arrived for this rank's current meeting, if it has."""
        return self._get(self.key("met", self.meetings, rank))

    def raise_fault_flag(self) -> None:
        if not self.store.check([self.key("fault")]):
            self.store.set(self.key("fault"), str(self.rank))

    def fault_flagged_by(self) -> int | None:
        text = self._get(self.key("fault"))
        return None if text is None else int(text)

    def anyone_exited(self) -> bool:
        return self.store.add(self.key("exits"), 0) > 0  # one counter: the common case is cheap

    def exit_note(self, rank: int) -> ExitNote | None:
        text = self._get(self.key("exited", rank))
        if text is None:
            return None
        finished, how, crash = text.split("|", 2)
        return ExitNote(int(finished), how == "cleanup", crash)

    def post_exit(self, by_cleanup: bool) -> None:
        how = "cleanup" if by_cleanup else "exit"
        self.store.set(self.key("exited", self.rank), f"{self.finished}|{how}|{_crash()}")
        self.store.add(self.key("exits"), 1)

    def _get(self, key: str) -> str | None:
        # get() of a missing key would block until the store's timeout: check first.
        return self.store.get(key).decode() if self.store.check([key]) else None


_BOARDS: dict[Any, Board] = {}


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


def board_of(group: dist.ProcessGroup | None) -> Board:
    """This process's board for `group` (the default group if None), made on first use."""
    group = group or dist.group.WORLD
    board = _BOARDS.get(group)
    if board is None:
        board = _BOARDS[group] = Board(
            store=group.get_group_store(),
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
            timeout=collective_timeout(group),
            timed_waits=dist.get_backend(group) == "gloo",
        )
        atexit.register(_post_exit_at_interpreter_exit, board)
    return board


def boards() -> list[Board]:
    return list(_BOARDS.values())


def any_broken() -> bool:
    """Has a collective or a meeting point failed in this process (so one may be in flight)?"""
    return any(board.broken for board in _BOARDS.values())


def forget_boards() -> None:
    """Drop every group's board, store included: called when the process group is destroyed,
    so nothing touches a dead group's store while the interpreter shuts down."""
    for board in _BOARDS.values():
        atexit.unregister(_post_exit_at_interpreter_exit)
        board.store = None
    _BOARDS.clear()


def _post_exit_at_interpreter_exit(board: Board) -> None:
    """Tell the others how far this rank got (os._exit and kills skip this: they hear that from
    gloo, as a closed connection)."""
    if board.store is None:
        return  # the group was shut down cleanly: nobody is waiting for this rank
    try:
        board.store.set_timeout(timedelta(seconds=2))  # never hold up an exit for long
        board.post_exit(by_cleanup=False)
    except Exception:
        pass  # the store may already be gone; the others will say "posted nothing"


def _crash() -> str:
    """The exception that is ending this process, if one is, or that the script is handling
    as it calls cleanup() (`except ...: cleanup()`, after a pipeline stage raised, say).

    Python keeps the exception that ended the main script in `sys.last_value` before it runs
    the atexit handlers, whichever way the process group was started; so no `sys.excepthook`
    has to be installed, by `init_distributed` or anyone else.
    """
    error = getattr(sys, "last_value", None) or sys.exc_info()[1]
    return "" if error is None else f"{type(error).__name__}: {first_line(error)}"


def first_line(error: BaseException) -> str:
    """gloo's "[.../pair.cc:537] Read error [...]: Connection reset by peer. This is typically..."
    becomes "Read error [...]: Connection reset by peer": the first sentence, without the path."""
    text = re.sub(r"^\[[^\]]+:\d+\]\s*", "", str(error).strip())
    text = text.splitlines()[0] if text else type(error).__name__
    return text.split(". ", 1)[0].rstrip(".")
