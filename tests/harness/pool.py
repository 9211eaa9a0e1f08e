"""A persistent group of worker ranks that the multi-process tests send work to.

Why a pool: starting a process group costs about 2 s for 2 ranks and 4 s for 4, nearly all of it
importing torch in every child. Paid per hypothesis example, that is the whole test budget. A
`RankPool` pays it once per world size and session; each task then takes milliseconds.

Why "spawn": a child forked from a process that already ran threaded torch code can inherit a
lock some other thread held, and deadlock.

Why a FileStore: each pool gets its own store file, so pools never meet on a port, and in this
sandbox a TCP store stalled ~5 s in about 1 of 17 starts while a file store never did.

The timeouts are layered so that the most informative one fires first:

    process-group timeout in the workers (60 s)   a collective a peer never joins raises there
    < task (120 s) and startup (90 s) timeouts    a rank that never answers gets the pool killed
    < the CI job's own limit                      so the suite always ends with a report

A pool that was killed, or whose worker died, is never reused: `RankPools.get` builds a new one.
After a task that raised, one all_reduce checks that the ranks are still in step (see
`_discard_if_out_of_step`); a pool that fails the check is killed as well.
Tasks are module-level functions (they travel by pickle) and should leave the process as they
found it, apart from the process group they share.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

PROCESS_GROUP_TIMEOUT_S = 60.0
TASK_TIMEOUT_S = 120.0
STARTUP_TIMEOUT_S = 90.0
GROUP_CHECK_TIMEOUT_S = 10.0
POLL_INTERVAL_S = 0.05
ORPHAN_CHECK_INTERVAL_S = 1.0
KILL_GRACE_S = 2.0
STOP = None


@dataclass(frozen=True)
class RankFailure:
    """What one rank raised: returned by `run_expecting_errors` in place of a result."""

    type_name: str
    message: str
    traceback: str


class RankError(AssertionError):
    """Some ranks raised. The message holds each one's traceback, so pytest shows them all."""

    def __init__(self, failures: dict[int, RankFailure]) -> None:
        self.failures = failures
        self.errors = {rank: (f.type_name, f.message) for rank, f in failures.items()}
        details = "\n".join(
            f"--- rank {rank} raised {f.type_name}: {f.message}\n{f.traceback}"
            for rank, f in sorted(failures.items())
        )
        super().__init__(f"ranks {sorted(failures)} raised:\n{details}")


class WorkerDied(RuntimeError):
    """A worker process exited (or was killed) instead of answering."""

    def __init__(self, exit_codes: dict[int, int | None]) -> None:
        self.exit_codes = exit_codes
        deaths = ", ".join(f"rank {rank} exit code {code}" for rank, code in exit_codes.items())
        super().__init__(f"worker died ({deaths}); the pool was discarded")


class PoolStartupError(RuntimeError):
    """The workers could not all join the process group."""


def _attempt(work: Callable[[], Any]) -> bytes:
    """Run `work` and pickle its outcome here, so an unpicklable result is reported, not lost.

    Plain pickle also sends tensors by value, not as shared-memory handles that torch's queue
    reducers would pass (and that need the sender alive until they are opened)."""
    try:
        return pickle.dumps(("ok", work()))
    except Exception as exc:
        return pickle.dumps(("error", traceback.format_exc(), type(exc).__name__, str(exc)))


def _decode(reply: bytes) -> Any:
    status, *payload = pickle.loads(reply)
    if status == "ok":
        return payload[0]
    formatted, type_name, message = payload
    return RankFailure(type_name, message, formatted)


def _join_group(rank: int, world_size: int, store_path: str) -> None:
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world_size),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
    )


def _call(task: bytes) -> Any:
    fn, args, kwargs = pickle.loads(task)
    return fn(*args, **kwargs)


def _exit_if_orphaned(parent_pid: int) -> None:
    """If pytest is killed, nobody will send STOP: leave on our own, even mid-task."""
    while os.getppid() == parent_pid:
        time.sleep(ORPHAN_CHECK_INTERVAL_S)
    os._exit(1)


def _worker(
    rank: int, world_size: int, store_path: str, tasks: Any, replies: Any, parent_pid: int
) -> None:
    # Ctrl-C reaches every process in the terminal; stopping the workers is the parent's job.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_if_orphaned, args=(parent_pid,), daemon=True).start()
    torch.set_num_threads(1)  # the ranks share a few cores; more threads only make them fight
    # Even if joining fails, stay until stopped: exiting now could be reported as a death
    # before the failure's traceback is read.
    replies.put((rank, 0, _attempt(functools.partial(_join_group, rank, world_size, store_path))))
    while (message := tasks.get()) is not STOP:
        task_id, task = message
        replies.put((rank, task_id, _attempt(functools.partial(_call, task))))
    if dist.is_initialized():
        dist.destroy_process_group()
    # Leave without the interpreter's shutdown: after a few hundred tasks its final garbage
    # collection took 5 s, which every pytest session then waited out. Nothing is left to
    # flush: every reply has been read.
    replies.close()
    replies.join_thread()
    os._exit(0)


def _rank_plus_one_sum() -> int:
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    return int(total.item())


class RankPool:
    """`world_size` spawned processes in one gloo group, running one task at a time on all."""

    def __init__(self, world_size: int, startup_timeout: float = STARTUP_TIMEOUT_S) -> None:
        context = mp.get_context("spawn")
        self.world_size = world_size
        self.alive = True
        self._store_dir = tempfile.mkdtemp(prefix=f"miniddp-pool{world_size}-")
        self._replies = context.Queue()
        self._tasks = [context.Queue() for _ in range(world_size)]
        self._last_task_id = 0
        store_path = os.path.join(self._store_dir, "store")
        self._processes = [
            context.Process(
                target=_worker,
                args=(rank, world_size, store_path, tasks, self._replies, os.getpid()),
                name=f"pool{world_size}-rank{rank}",
                daemon=True,
            )
            for rank, tasks in enumerate(self._tasks)
        ]
        for process in self._processes:
            process.start()
        try:
            for rank, outcome in self._answers(0, startup_timeout):
                if isinstance(outcome, RankFailure):  # the others would wait on it until timeout
                    self._kill()
                    raise RankError({rank: outcome})
        except (RankError, TimeoutError, WorkerDied) as exc:
            raise PoolStartupError(f"RankPool({world_size}) did not start: {exc}") from exc

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = TASK_TIMEOUT_S, **kwargs: Any
    ) -> list[Any]:
        """Call `fn(*args, **kwargs)` on every rank; return the results, indexed by rank."""
        outcomes = self.run_expecting_errors(fn, *args, timeout=timeout, **kwargs)
        failures = {rank: o for rank, o in enumerate(outcomes) if isinstance(o, RankFailure)}
        if failures:
            raise RankError(failures)
        return outcomes

    def run_expecting_errors(
        self, fn: Callable[..., Any], *args: Any, timeout: float = TASK_TIMEOUT_S, **kwargs: Any
    ) -> list[Any]:
        """Like `run`, but a rank that raised gives a `RankFailure` in its place."""
        outcomes = self._execute(fn, args, kwargs, timeout)
        if any(isinstance(outcome, RankFailure) for outcome in outcomes):
            self._discard_if_out_of_step()
        return outcomes

    def shutdown(self, timeout: float = 10.0) -> None:
        """Let the workers leave the process group, then make sure they are gone."""
        if self.alive:
            for tasks in self._tasks:
                tasks.put(STOP)
            deadline = time.monotonic() + timeout
            for process in self._processes:
                process.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _execute(
        self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float
    ) -> list[Any]:
        if not self.alive:
            raise RuntimeError(f"RankPool({self.world_size}) is dead; ask RankPools for a new one")
        task = pickle.dumps((fn, args, kwargs))  # fails here, clearly, for lambdas and closures
        self._last_task_id += 1
        for tasks in self._tasks:
            tasks.put((self._last_task_id, task))
        outcomes = dict(self._answers(self._last_task_id, timeout))
        return [outcomes[rank] for rank in range(self.world_size)]

    def _answers(self, task_id: int, timeout: float) -> Iterator[tuple[int, Any]]:
        """Yield (rank, result or RankFailure) as they arrive, watching for deaths and timeout."""
        deadline = time.monotonic() + timeout
        answered: set[int] = set()
        while len(answered) < self.world_size:
            try:
                rank, answered_id, reply = self._replies.get(timeout=POLL_INTERVAL_S)
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(self._processes) if not p.is_alive()}
                if dead:
                    self._kill()
                    raise WorkerDied(dead) from None
                if time.monotonic() > deadline:
                    silent = sorted(set(range(self.world_size)) - answered)
                    self._kill()
                    raise TimeoutError(
                        f"ranks {silent} of RankPool({self.world_size}) did not answer within "
                        f"{timeout:g} s; its processes were killed"
                    ) from None
                continue
            if answered_id == task_id:
                answered.add(rank)
                yield rank, _decode(reply)

    def _discard_if_out_of_step(self) -> None:
        """A task that failed part-way can leave the ranks at different collectives, and the next
        collective would hang or mix up data. One all_reduce tells; if it fails, kill the pool."""
        expected = self.world_size * (self.world_size + 1) // 2
        try:
            sums = self._execute(_rank_plus_one_sum, (), {}, GROUP_CHECK_TIMEOUT_S)
        except (TimeoutError, WorkerDied):
            return  # already killed
        if sums != [expected] * self.world_size:
            self._kill()

    def _kill(self) -> None:
        self.alive = False
        for process in self._processes:
            if process.is_alive():
                process.terminate()
        for process in self._processes:
            process.join(KILL_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join()
        for channel in [*self._tasks, self._replies]:
            channel.cancel_join_thread()  # nobody will read what is left; don't wait on it at exit
            channel.close()
        shutil.rmtree(self._store_dir, ignore_errors=True)


class RankPools:
    """One live pool per world size, started on first use and replaced once it has died."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = RankPool(world_size)
        return pool

    def shutdown(self) -> None:
        for pool in self._pools.values():
            pool.shutdown()
        self._pools.clear()
