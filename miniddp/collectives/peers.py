"""How the algorithms talk: point-to-point messages between the ranks of one collective call.

Every algorithm in this package (naive.py, tree.py, doubling.py, ring.py) is a pattern of
`dist.isend` / `dist.irecv` calls, and every one of those calls goes through a `Peers`. That one
door is what lets chapter 01 (tutorials/01_collectives.py) watch the algorithms: `Peers` counts
each message's bytes in `traffic` (section 4, "Steps and bytes, counted") and, inside a
`record_messages()` block, logs who sent what to whom at which step (sections 1 to 3 print those
logs step by step).

Below `Peers` sit the few things every algorithm shares: how each `ReduceOp` folds one rank's
values into another's, and one reusable receive buffer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

# Our messages carry their own tag, so that a user's own dist.send/recv between the same ranks
# (tag 0 by default) is never taken for one of ours.
MESSAGE_TAG = 7_000


@dataclass
class Traffic:
    """What this process sent and received through these collectives since the last `reset()`.

    Counted as each message is posted; for an async collective, read it after `wait()`.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0

    def reset(self) -> None:
        for field in fields(self):
            setattr(self, field.name, 0)


traffic = Traffic()


@dataclass(frozen=True)
class Message:
    """One message, as its sender logged it inside `record_messages()`. Ranks are global."""

    collective: str  # e.g. "all_reduce/ring"
    step: int  # 1-based; the messages of one step travel at the same time
    src: int
    dst: int
    what: str  # e.g. "chunk 2"
    nbytes: int


_message_log: list[Message] | None = None


@contextmanager
def record_messages() -> Iterator[list[Message]]:
    """Log every message this process sends in collectives issued inside the block.

    An async collective logs as it runs: `wait()` for it before reading the list.
    """
    global _message_log
    previous, _message_log = _message_log, []
    try:
        yield _message_log
    finally:
        _message_log = previous


class Peers:
    """The ranks taking part in one collective call, and the only way its algorithms talk.

    Algorithms think in group ranks 0..W-1; messages go to global ranks, as torch.distributed's
    point-to-point calls expect.
    """

    def __init__(self, group: ProcessGroup | None, collective: str) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "No process group: launch with torchrun and call miniddp.init_distributed() "
                "(or torch.distributed.init_process_group) before any collective."
            )
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("this rank is not a member of the group it called a collective on")
        self.global_ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self.size = len(self.global_ranks)
        self.collective = collective
        self.log = _message_log  # captured now: the collective may run after the block ends

    def group_rank_of(self, global_rank: int) -> int:
        if global_rank not in self.global_ranks:
            raise ValueError(f"rank {global_rank} is not in the group {self.global_ranks}")
        return self.global_ranks.index(global_rank)

    def relative(self, root: int) -> int:
        """Position counted from the root: trees are drawn as if the root were rank 0."""
        return (self.rank - root) % self.size

    def absolute(self, relative_rank: int, root: int) -> int:
        return (relative_rank + root) % self.size

    def receive(self, src: int, buffer: torch.Tensor) -> dist.Work | None:
        """Post a receive from group rank `src` into `buffer`, and return without waiting.

        Empty tensors travel as no message at all: both sides know the sizes, so both skip.
        """
        if not buffer.numel():
            return None
        traffic.bytes_received += buffer.numel() * buffer.element_size()
        traffic.messages_received += 1
        source = self.global_ranks[src]
        wire = on_the_wire(buffer, self.group, incoming=True)
        return landing(dist.irecv(wire, source, group=self.group, tag=MESSAGE_TAG), wire, buffer)

    def send(self, step: int, dst: int, buffer: torch.Tensor, what: str) -> dist.Work | None:
        """Post a send of `buffer` to group rank `dst`, and return without waiting."""
        if not buffer.numel():
            return None
        nbytes = buffer.numel() * buffer.element_size()
        traffic.bytes_sent += nbytes
        traffic.messages_sent += 1
        target = self.global_ranks[dst]
        if self.log is not None:
            me = self.global_ranks[self.rank]
            self.log.append(Message(self.collective, step, me, target, what, nbytes))
        wire = on_the_wire(buffer, self.group, incoming=False)
        return dist.isend(wire, target, group=self.group, tag=MESSAGE_TAG)

    def exchange(
        self,
        step: int,
        sends: Sequence[tuple[int, torch.Tensor, str]] = (),
        receives: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> None:
        """One step: post every receive and every send, then wait for all of them.

        Posting both before waiting matters: gloo sends only into a receive the other side has
        posted, so two ranks that each waited on a send to the other would wait forever.
        """
        posted = [self.receive(src, buffer) for src, buffer in receives]
        posted += [self.send(step, dst, buffer, what) for dst, buffer, what in sends]
        wait_all(*posted)


def on_the_wire(tensor: torch.Tensor, group: ProcessGroup | None, incoming: bool) -> torch.Tensor:
    """The tensor a message travels in: `tensor` itself, except for a GPU tensor on gloo, whose
    send and receive hand the tensor's address straight to the TCP transport (a GPU address
    aborts the process: "writev: Bad address"). gloo's collectives copy GPU tensors through host
    memory themselves; for its point-to-point calls we do: a send goes out from a host copy, a
    receive lands in a host buffer and is copied to the GPU when waited for (`landing`)."""
    if tensor.device.type == "cpu" or dist.get_backend(group) != dist.Backend.GLOO:
        return tensor
    return torch.empty_like(tensor, device="cpu") if incoming else tensor.cpu()


def landing(work: dist.Work, wire: torch.Tensor, tensor: torch.Tensor) -> dist.Work:
    """The receive `work` into `wire`, such that waiting for it leaves the message in `tensor`."""
    return work if wire is tensor else _CopiedOnArrival(work, wire, tensor)


class _CopiedOnArrival:
    """A receive into a host buffer, waited for as a `dist.Work`: the wait also copies the
    message to the GPU tensor it was meant for."""

    def __init__(self, work: dist.Work, host: torch.Tensor, tensor: torch.Tensor) -> None:
        self.work, self.host, self.tensor = work, host, tensor

    def wait(self, timeout=None) -> bool:
        arrived = self.work.wait() if timeout is None else self.work.wait(timeout)
        if arrived:
            self.tensor.copy_(self.host)
        return arrived

    def is_completed(self) -> bool:
        return self.work.is_completed()


def wait_all(*works: dist.Work | None) -> None:
    """Wait for posted sends and receives; None stands for an empty message that never left."""
    for work in works:
        if work is not None:
            work.wait()


# How each op folds one rank's values into another's, in place. AVG is a SUM divided by W once at
# the end, and needs a floating dtype: an integer mean would have to round.
COMBINE = {
    ReduceOp.SUM: torch.add,
    ReduceOp.AVG: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.BAND: torch.bitwise_and,
    ReduceOp.BOR: torch.bitwise_or,
    ReduceOp.BXOR: torch.bitwise_xor,
}
INTEGER_ONLY = frozenset((ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR))


def finish_average(tensor: torch.Tensor, op: ReduceOp.RedOpType, world_size: int) -> None:
    """The one division of an AVG, where a complete sum first exists."""
    if op == ReduceOp.AVG:
        tensor.div_(world_size)


_scratch_buffers: dict[torch.device, torch.Tensor] = {}


def scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A receive buffer, reused from call to call: a fresh 64 MiB tensor costs thousands of page
    faults each time. Collectives run one at a time, so one buffer (per device) serves them all;
    it keeps the largest size asked for."""
    nbytes = numel * dtype.itemsize
    buffer = _scratch_buffers.get(device)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _scratch_buffers[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buffer[:nbytes].view(dtype)
