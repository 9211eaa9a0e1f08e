"""The simulated link as a process group: gloo underneath, the link's time on top.

`LinkGroup` is a `dist.ProcessGroup` written in Python, as torch's own tests write one
(torch/testing/_internal/distributed/multi_threaded_pg.py), registered as the backend "link".
Each operation runs for real on a gloo group of the same ranks (so the sums are right), and the
Work it returns completes at the later of gloo's completion and the link's delivery, the model of
miniddp/observe/link.py:

    collective:  due = when the link is next free + alpha + wire_bytes / bandwidth
    send:        issued only at that due time, with bytes = the tensor's; a receive is untouched

Because torch calls a process group's methods from C++ as well as from Python, everything that
talks over the group crosses the link: `dist.all_reduce` and its kin, torch's DDP's reducer (no
comm hook), torch's pipelining's sends, DTensor's functional collectives. Nothing in `dist` is
replaced.

`simulated_link(link)` (the context manager every bench and chapter uses) makes a LinkGroup over
all ranks and makes it the default group for the block: code that passes no group, and every
group made inside the block (a DeviceMesh's, say), crosses the link. Groups made before the block
do not: make the model's groups inside it, or inside `link_groups()`, whose groups cross
whichever link a `simulated_link` block inside it names (none outside those).
"""

from __future__ import annotations

import heapq
import itertools
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import _create_work_from_future

from miniddp.observe.link import Link, TwoSpeed, wire_bytes

BACKEND = "link"
now = time.perf_counter  # one clock for the queues and the delivering threads


class LinkQueue:
    """One rank's link: transfers go one at a time, in issue order. One issued at `now` starts
    when the link is free (at once, or when the one before arrives), and takes link.seconds."""

    def __init__(self, link: Link) -> None:
        self.link, self.free_at = link, -math.inf

    def deliver_at(self, now: float, wire_bytes: float) -> float:
        """Put a transfer on the wire; return when it arrives."""
        start = max(now, self.free_at)
        self.free_at = start + self.link.seconds(wire_bytes)
        return self.free_at


class Deliveries:
    """A thread that completes each LinkWork's future at its delivery time, sleeping between."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()  # ties keep issue order
        self._changed = threading.Condition()
        self._stopping = False
        self.thread = threading.Thread(target=self._serve, name="miniddp-link", daemon=True)
        self.thread.start()

    def at(self, when: float, deliver: Callable[[], None]) -> None:
        with self._changed:
            if not self._stopping:
                heapq.heappush(self._due, (when, next(self._order), deliver))
                self._changed.notify()
                return
        deliver()  # the link is being taken away: nothing is held back any more

    def stop(self, timeout: float = 10.0) -> None:
        """Deliver everything still held, at once, and end. Nothing is left waiting, and the
        thread is not killed at exit inside torch's C++ (which can abort the process)."""
        with self._changed:
            self._stopping = True
            self._changed.notify()
        self.thread.join(timeout)

    def _serve(self) -> None:
        while True:
            with self._changed:
                while not self._stopping:
                    wait = self._due[0][0] - time.perf_counter() if self._due else None
                    if wait is not None and wait <= 0:
                        break
                    self._changed.wait(wait)
                if not self._due:
                    return  # stopping, with nothing held
                _, _, deliver = heapq.heappop(self._due)
            deliver()


@dataclass
class Crossing:
    """One operation this rank put on a LinkGroup while `Wire.recording` was a list: an
    all-reduce (`end`: when it completed, the link's delivery included) or a send (`end`:
    None, only its issue is seen). `group`: the LinkGroup's name."""

    kind: str
    group: str
    elements: int
    nbytes: int
    start: float
    end: float | None = None


class Wire:
    """One rank's simulated network while a `simulated_link` block lasts: per speed (two for a
    TwoSpeed), a queue for collectives and one for sends, and the threads that deliver on time.
    Sends keep their own queues, as a link's two directions: a collective's bytes go both ways
    at once, a send's only out. With no link (None), every operation goes straight to gloo."""

    def __init__(self, link: Link | TwoSpeed | None) -> None:
        self.deliveries = Deliveries()
        self.sends: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(2)]
        self.traffic: list[tuple[str, float]] = []  # (operation, wire bytes): what crossed
        self.recording: list[Crossing] | None = None  # an instrument's log, while it is a list
        for sends in self.sends:  # a thread a speed: one link's sends never wait for the other's
            threading.Thread(target=_issue_sends, args=(sends,), daemon=True).start()
        self.use(link)

    def use(self, link: Link | TwoSpeed | None) -> None:
        """From now on, cross `link`, on empty queues (None: the bare machine)."""
        self.link = link
        speeds = (link.inside, link.across) if isinstance(link, TwoSpeed) else (link,)
        self.collective_queues = [LinkQueue(speed) for speed in speeds if speed is not None]
        self.send_queues = [LinkQueue(speed) for speed in speeds if speed is not None]

    def speed_of(self, global_ranks: list[int]) -> int:
        """1 (`across`) for ranks on two nodes of a TwoSpeed, else 0 (`inside`, or the link)."""
        if isinstance(self.link, TwoSpeed):
            return len({rank // self.link.ranks_per_node for rank in global_ranks}) > 1
        return 0

    def record(self, kind: str, group: str, tensors: list[torch.Tensor]) -> Crossing | None:
        """Log one all-reduce or send while `recording`; None otherwise."""
        if self.recording is None:
            return None
        elements = sum(tensor.numel() for tensor in tensors)
        crossing = Crossing(kind, group, elements, sum(map(_nbytes, tensors)), now())
        self.recording.append(crossing)
        return crossing

    def collective(self, name: str, nbytes: int, global_ranks: list[int], run: Callable):
        """Run gloo's `run()` now; its Work completes no sooner than the link delivers."""
        size = len(global_ranks)
        wire = wire_bytes(name, nbytes, size)
        self.traffic.append((name, wire))
        if self.link is None:
            return run()
        due = self.collective_queues[self.speed_of(global_ranks)].deliver_at(now(), wire)
        due = due if size > 1 else -math.inf
        real = _future_of(run())
        future: torch.futures.Future = torch.futures.Future()

        def deliver() -> None:
            try:
                future.set_result(real.value())
            except Exception as error:  # gloo failed: so does the link
                future.set_exception(error)

        real.add_done_callback(lambda _: self.deliveries.at(due, deliver))
        return _create_work_from_future(future)

    def send(self, nbytes: int, pair: list[int], run: Callable):
        """Issue gloo's send between the global ranks `pair` at the time the link would have
        carried it (a FIFO thread per speed: a queue's dues only grow, so a pair's messages keep
        their order)."""
        self.traffic.append(("send", float(nbytes)))
        if self.link is None:
            return run()
        speed = self.speed_of(pair)
        due = self.send_queues[speed].deliver_at(now(), nbytes)
        future: torch.futures.Future = torch.futures.Future()
        self.sends[speed].put((due, run, future))
        return _create_work_from_future(future)

    def close(self) -> None:
        self.deliveries.stop()


def _issue_sends(sends: queue.SimpleQueue) -> None:
    """Issue each send at its due time; a thread then waits for gloo to finish it."""
    while True:
        due, run, future = sends.get()
        time.sleep(max(0.0, due - now()))
        try:
            work = run()
        except Exception as error:  # gloo refused it: the sender's wait raises
            future.set_exception(error)
            continue
        threading.Thread(target=_complete, args=(work, future), daemon=True).start()


def _future_of(work: dist.Work) -> torch.futures.Future:
    """The Work's future; gloo's reduce-scatter has none, so a thread waits for it instead."""
    try:
        return work.get_future()
    except RuntimeError:
        future: torch.futures.Future = torch.futures.Future()
        threading.Thread(target=_complete, args=(work, future), daemon=True).start()
        return future


def _complete(work: dist.Work, future: torch.futures.Future) -> None:
    try:
        work.wait()
        future.set_result([])
    except Exception as error:  # the real send failed: so does the simulated one
        future.set_exception(error)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class LinkGroup(dist.ProcessGroup):
    """A process group whose every operation runs on `gloo` and is timed by `wire`."""

    def __init__(
        self, gloo: dist.ProcessGroup, wire: Wire, global_ranks: list[int], store: dist.Store
    ) -> None:
        super().__init__(gloo.rank(), gloo.size())
        self.gloo, self.wire, self.global_ranks, self._store = gloo, wire, global_ranks, store

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    def get_group_store(self) -> dist.Store:  # where MiniDDP's ranks post their fault notes
        return self._store

    def _set_group_name(self, name: str) -> None:  # a Python group keeps its own name
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def _collective(self, name: str, nbytes: int, run: Callable) -> dist.Work:
        return self.wire.collective(name, nbytes, self.global_ranks, run)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.AllreduceOptions()
        run = lambda: self.gloo.allreduce(tensors, opts)  # noqa: E731
        crossing = self.wire.record("all_reduce", self.group_name, tensors)
        work = self._collective("all_reduce", sum(map(_nbytes, tensors)), run)
        if crossing is not None:  # done when its future is, the link's delay included
            work.get_future().add_done_callback(lambda _: setattr(crossing, "end", now()))
        return work

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.AllreduceCoalescedOptions()
        run = lambda: self.gloo.allreduce_coalesced(tensors, opts)  # noqa: E731
        return self._collective("all_reduce", sum(map(_nbytes, tensors)), run)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.BroadcastOptions()
        run = lambda: self.gloo.broadcast(tensors, opts)  # noqa: E731
        return self._collective("broadcast", sum(map(_nbytes, tensors)), run)

    def allgather(self, outputs: list, inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.AllgatherOptions()
        run = lambda: self.gloo.allgather(outputs, inputs, opts)  # noqa: E731
        return self._collective("all_gather", sum(map(_nbytes, inputs)), run)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None):
        opts = opts or dist.AllgatherOptions()
        run = lambda: self.gloo._allgather_base(output, input, opts)  # noqa: E731
        return self._collective("all_gather", _nbytes(input), run)

    def reduce_scatter(self, outputs: list, inputs: list, opts: Any = None) -> dist.Work:
        opts = opts or dist.ReduceScatterOptions()
        run = lambda: self.gloo.reduce_scatter(outputs, inputs, opts)  # noqa: E731
        return self._collective("reduce_scatter", sum(map(_nbytes, outputs)), run)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None):
        opts = opts or dist.ReduceScatterOptions()
        run = lambda: self.gloo._reduce_scatter_base(output, input, opts)  # noqa: E731
        return self._collective("reduce_scatter", _nbytes(output), run)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts: Any = None):
        opts = opts or dist.AllToAllOptions()
        run = lambda: self.gloo.alltoall_base(output, input, output_splits, input_splits, opts)  # noqa: E731
        return self._collective("all_to_all", _nbytes(input), run)

    def alltoall(self, outputs: list, inputs: list, opts: Any = None) -> dist.Work:
        opts = opts or dist.AllToAllOptions()
        run = lambda: self.gloo.alltoall(outputs, inputs, opts)  # noqa: E731
        return self._collective("all_to_all", sum(map(_nbytes, inputs)), run)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts or dist.ReduceOptions()
        run = lambda: self.gloo.reduce(tensors, opts)  # noqa: E731
        return self._collective("reduce", sum(map(_nbytes, tensors)), run)

    def scatter(self, outputs: list, inputs: list, opts: Any = None) -> dist.Work:
        opts = opts or dist.ScatterOptions()
        run = lambda: self.gloo.scatter(outputs, inputs, opts)  # noqa: E731
        return self._collective("scatter", self.size() * sum(map(_nbytes, outputs)), run)

    def gather(self, outputs: list, inputs: list, opts: Any = None) -> dist.Work:
        opts = opts or dist.GatherOptions()
        run = lambda: self.gloo.gather(outputs, inputs, opts)  # noqa: E731
        return self._collective("gather", self.size() * sum(map(_nbytes, inputs)), run)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self.gloo.barrier(opts or dist.BarrierOptions())

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        self.wire.record("send", self.group_name, tensors)
        pair = [self.global_ranks[self.rank()], self.global_ranks[dst]]
        run = lambda: self.gloo.send(tensors, dst, tag)  # noqa: E731
        return self.wire.send(sum(map(_nbytes, tensors)), pair, run)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        return self.gloo.recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> dist.Work:
        return self.gloo.recv_anysource(tensors, tag)

    def __repr__(self) -> str:
        return f"LinkGroup(rank {self.rank()} of {self.size()}, {self.wire.link})"


_installing: list[Wire] = []  # the wire of the block being entered, for the backend's creator


def _create_link_group(options: Any, _backend_options: Any) -> LinkGroup:
    """Backend "link"'s creator: torch calls it for every group made with that backend."""
    if not _installing:
        raise RuntimeError(
            'The "link" backend is made by miniddp.instruments.link_group.simulated_link(link); '
            "create groups with it inside that block, not with init_process_group directly."
        )
    gloo = dist.ProcessGroupGloo(
        options.store, options.group_rank, options.group_size, options.timeout
    )
    ranks = list(options.global_ranks_in_group)
    return LinkGroup(gloo, _installing[-1], ranks, options.store)


dist.Backend.register_backend(BACKEND, _create_link_group, extended_api=True, devices=["cpu"])


def active_wire() -> Wire | None:
    """The wire of the `simulated_link` block this process is in, if any."""
    return _installing[-1] if _installing else None


@contextmanager
def simulated_link(link: Link | TwoSpeed | None) -> Iterator[Link | TwoSpeed | None]:
    """Inside the block, the default group is a LinkGroup over every rank, crossing `link`
    (None: the bare machine, nothing changes). Every rank must enter it, with the same link:
    making the group is itself collective. Nested in another block, it makes no group: the
    groups made in the outer block cross `link` until the inner one ends, which lets a
    benchmark alternate the bare machine and a link on the same model, step by step."""
    if not _installing:
        if link is None:
            yield None
            return
        with link_groups(), simulated_link(link):
            yield link
        return
    wire = _installing[-1]
    before = wire.link
    wire.use(link)
    try:
        yield link
    finally:
        wire.use(before)


@contextmanager
def link_groups() -> Iterator[Wire]:
    """Inside, the default group, and every group made in the block (a DeviceMesh's), is a
    LinkGroup, on the bare machine until a `simulated_link(link)` block inside says otherwise.
    Make a model's groups in here to time it both ways, step by step."""
    if _installing:
        raise RuntimeError("link_groups() is already active; its groups are LinkGroups already")
    world = c10d._get_default_group()
    wire = Wire(None)
    _installing.append(wire)
    try:
        group = dist.new_group(backend=BACKEND)
        c10d._world.default_pg = group
        try:
            yield wire
        finally:
            c10d._world.default_pg = world
            dist.destroy_process_group(group)
    finally:
        _installing.pop()
        wire.close()
