"""The communication thread: collectives run one at a time, in the order they were issued.

Chapter 01 (tutorials/01_collectives.py) shows it in section 5, "Async": four all-reduces issued
with `async_op=True` return at once, the caller computes meanwhile, and they finish in issue
order. MiniDDP relies on it through `miniddp.data_parallel.default_hooks.all_reduce_hook`:
backward goes on computing while a full bucket's all-reduce travels.

Every collective in this package, blocking or not, goes through `submit`; `_InIssueOrder` says
why there is a thread, why the order, and why it is stopped at exit.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from queue import SimpleQueue

import torch


class Work:
    """The handle an `async_op=True` collective returns, shaped like torch.distributed's Work:
    `wait()` returns once the result is in place (or re-raises what the collective raised), and
    `get_future()` is a `torch.futures.Future` whose value is the list of output tensors."""

    def __init__(self, result: list[torch.Tensor]) -> None:
        self.result = result
        self._future: torch.futures.Future = torch.futures.Future()

    def wait(self) -> bool:
        """Block until done. Not from a future's callback: those run on the communication
        thread, which would then wait for itself."""
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future


class _InIssueOrder:
    """Runs this process's collectives one at a time, in the order they were issued: an async
    one on the communication thread, a blocking one on its caller's thread, when its turn comes.

    Why a thread: `async_op=True` must return at once so that the caller (DDP's backward) keeps
    computing while the messages travel. NCCL gets this from a CUDA stream: the host enqueues a
    collective's kernel on a communication stream and moves on, and the GPU runs that stream's
    kernels one after another, beside the compute stream. The communication thread is that
    stream: a first-in-first-out queue of collectives, run beside the caller. The sends and
    receives release Python's GIL while they wait, and so do torch's reductions.

    Why in issue order, one at a time: messages carry no collective id (all share one tag). A
    message finds the right receive only because every rank runs the same collectives in the same
    order, one at a time, and gloo delivers the messages between two ranks in the order they were
    sent, to receives in the order they were posted. So the k-th collective's messages can only
    meet the k-th collective's receives, however many are in flight. (NCCL has the same rule:
    every rank must issue collectives in the same order.)

    Why blocking ones run on the caller's thread: handing a job to another thread and being woken
    when it is done cost about 100 us on a busy 2-core machine, as much as a small all-reduce.
    Each collective takes a ticket when issued; ticket t runs once t collectives have finished,
    on whichever thread it belongs to, so the order is the same either way.

    Why it is stopped at exit: it is a daemon thread, so a program never has to stop it, but
    Python kills a daemon thread wherever it is when the interpreter shuts down. Killed inside
    torch's C++ (completing a Work's future just after `wait()` returned, say), it took the whole
    process down with "terminate called without an active exception" in about one run in three.
    So at exit it finishes what it is doing first, and ends.
    """

    def __init__(self) -> None:
        self._turn = threading.Condition()
        self._issued = 0
        self._finished = 0
        self._queue: SimpleQueue[tuple[int, Callable[[], None], Work] | None] = SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="miniddp-comm", daemon=True)
        self.thread.start()

    def run(
        self, job: Callable[[], None], result: list[torch.Tensor], async_op: bool
    ) -> Work | None:
        """Run `job` in its turn: async, return a Work at once; blocking, return when done."""
        if not async_op and threading.current_thread() is self.thread:
            raise RuntimeError(
                "A blocking collective was issued from a future's callback, which runs on the "
                "communication thread: it would wait for itself. Pass async_op=True there."
            )
        with self._turn:
            ticket = self._issued
            self._issued += 1
            if async_op:
                work = Work(result)
                self._queue.put((ticket, job, work))  # under the lock: the queue stays in order
                return work
        self._run_in_turn(ticket, job, work=None)
        return None

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            self._run_in_turn(*item)

    def stop(self, timeout: float) -> None:
        """Let the thread finish the collectives already issued, then end it."""
        self._queue.put(None)
        self.thread.join(timeout)

    def _run_in_turn(self, ticket: int, job: Callable[[], None], work: Work | None) -> None:
        with self._turn:
            self._turn.wait_for(lambda: self._finished == ticket)
        failure = None
        try:
            with torch.no_grad():  # collectives are not differentiable, and may write into leaves
                job()
        except Exception as exc:
            if work is None:
                raise  # a blocking call's caller gets it directly
            failure = exc  # an async one's, from wait(); the thread serves on
        finally:
            with self._turn:
                self._finished += 1
                self._turn.notify_all()
        # Completed after the turn has passed on: a callback may issue the next collective.
        if work is not None and failure is None:
            work.get_future().set_result(work.result)
        elif work is not None:
            work.get_future().set_exception(failure)


_in_issue_order: _InIssueOrder | None = None
_start_lock = threading.Lock()
# How long exit waits for async collectives still running: a stuck one must not hang the exit.
STOP_TIMEOUT_SECONDS = 10.0


def submit(job: Callable[[], None], result: list[torch.Tensor], async_op: bool) -> Work | None:
    """Run `job` in its turn (see `_InIssueOrder.run`), starting the thread on first use; it is
    stopped at exit."""
    global _in_issue_order
    with _start_lock:
        if _in_issue_order is None:
            _in_issue_order = _InIssueOrder()
            atexit.register(_stop_communication_thread)
    return _in_issue_order.run(job, result, async_op)


def _stop_communication_thread() -> None:
    global _in_issue_order
    with _start_lock:
        stopping, _in_issue_order = _in_issue_order, None  # a later collective starts a new one
    if stopping is not None:
        stopping.stop(STOP_TIMEOUT_SECONDS)
