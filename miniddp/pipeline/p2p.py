"""The messages between neighbouring stages: activations forward, gradients backward.

A stage talks only to its two neighbours, by point-to-point send and receive on the pipeline's
process group. Two rules keep it from deadlocking, on gloo and on NCCL alike:

    sends never block the sender: each goes out asynchronously and is waited for at the end
    of the step (its tensor is kept alive until then);
    the sends an action produced go out in ONE batch (`dist.batch_isend_irecv`) with the
    receive the next action needs. On NCCL a batch runs its sends and receives together; issued
    one by one, stage s's send of an activation and stage s+1's send of a gradient could each
    wait for the other's receive forever (torch's Schedule1F1B fuses the same pairs).

A failed transfer goes through `miniddp.faults.wait_for`, the seam that names a dead or silent
peer, but a transfer is not waited for there the way a collective is, for two reasons:

    a timed `wait()` on a gloo receive does not merely time out, it fails the receive ("Timed
    out waiting 100ms for recv operation"), so a receive cannot be polled while listening for
    other ranks' fault flags; and gloo's send/recv `Work` has no future either;
    wait_for counts the collectives each rank finished, and ranks compare those counts to
    tell where each one is (and cleanup() to tell that all ran the same steps); stages run
    different numbers of transfers (a middle stage twice an end stage's), so counting them
    would set ranks apart that are in step.

So the stage blocks in gloo's own `work.wait()` (in C++, the GIL released: as cheap as torch's
wait), and only if it raises hands the error to `wait_for`, which says which rank is missing and
why. A dead peer shows at once, as its connection closes; a silent one after the group's timeout.

With several stages a rank (interleaving), two ranks exchange several streams (W = 2: rank 0
sends stage 0's activations AND stage 2's to rank 1), and the order one rank sends in need not
be the order the other receives in. So every transfer carries a tag naming what it is (the
kind, the stage, the microbatch): gloo and NCCL match a receive with the send of its own tag.

Shapes are not hard-coded: the first time a stage sends an activation it first sends a small
header (dtype, rank, sizes), and its neighbour allocates its receive buffer from it (`Header`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from miniddp.job.faults import wait_for

MAX_DIMS = 8  # the header has room for an activation of up to 8 dimensions
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)


def failed(error: Exception) -> torch.futures.Future:
    """A future that failed with `error`: what `wait_for` diagnoses."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_exception(error)
    return future


@dataclass(frozen=True)
class Header:
    """What a receiver must know to allocate an activation: its dtype and sizes."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @staticmethod
    def of(tensor: torch.Tensor) -> Header:
        return Header(tensor.dtype, tuple(tensor.shape))

    def encode(self, device: torch.device) -> torch.Tensor:
        if self.dtype not in DTYPES or len(self.shape) > MAX_DIMS:
            raise ValueError(
                f"a stage's output of dtype {self.dtype} and shape {self.shape} cannot be "
                f"described to the next stage: use one of {DTYPES} with at most {MAX_DIMS} "
                "dimensions, or give the next stage input_args (an example of its input)."
            )
        padded = [*self.shape, *[0] * (MAX_DIMS - len(self.shape))]
        codes = [DTYPES.index(self.dtype), len(self.shape), *padded]
        return torch.tensor(codes, dtype=torch.int64, device=device)

    @staticmethod
    def decode(codes: torch.Tensor) -> Header:
        dtype_code, ndim, *sizes = codes.tolist()
        return Header(DTYPES[dtype_code], tuple(sizes[:ndim]))

    @staticmethod
    def buffer(device: torch.device) -> torch.Tensor:
        return torch.empty(2 + MAX_DIMS, dtype=torch.int64, device=device)

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


@dataclass
class Transfer:
    """One send or receive: the tensor, the neighbour (a stage index, on rank `rank` of the
    group), what it carries, and its tag (the same at both ends, unique within a step)."""

    tensor: torch.Tensor
    peer: int
    what: str  # "activation 3", "gradient 3": for the events and a fault's message
    is_send: bool
    rank: int
    tag: int = 0

    @property
    def description(self) -> str:
        """ "the receive of gradient 3 from stage 2": what a fault's message names."""
        if self.is_send:
            return f"the send of {self.what} to stage {self.peer}"
        return f"the receive of {self.what} from stage {self.peer}"


class Mailbox:
    """One stage's sends and receives. `post(sends, receive)` launches them as one batch and
    returns the receive's work; `finish_sends()` waits for every send still in flight.

    `note(kind, name)` is the schedule's event recorder: it hears "send" when a send goes out,
    "idle" start/end around each wait for a receive, and "recv" when the data is here.
    """

    def __init__(self, group: dist.ProcessGroup | None, note: Callable[[str, str], None]) -> None:
        self.group = group
        self.note = note
        self._sends_in_flight: list[tuple[dist.Work, Transfer]] = []
        self.bytes_sent = 0  # every send's payload since the mailbox was made

    def post(self, sends: list[Transfer], receive: Transfer | None = None) -> dist.Work | None:
        transfers = [*sends, *([receive] if receive is not None else [])]
        if not transfers:
            return None
        ops = [
            dist.P2POp(
                dist.isend if t.is_send else dist.irecv,
                t.tensor,
                group=self.group,
                tag=t.tag,
                group_peer=t.rank,
            )
            for t in transfers
        ]
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as error:  # gloo sends at once: a dead peer can fail it right here
            what = " and ".join(t.description for t in transfers)
            wait_for(failed(error), what, self.group)  # raises, naming the missing peer
        for work, transfer in zip(works, transfers):
            if transfer.is_send:
                self._sends_in_flight.append((work, transfer))  # keeps the tensor alive
                self.bytes_sent += transfer.tensor.numel() * transfer.tensor.element_size()
                self.note("send", transfer.what)
        return works[-1] if receive is not None else None

    def wait_receive(self, work: dist.Work, transfer: Transfer) -> torch.Tensor:
        """Block until `transfer` has arrived; the time spent here is the stage's idle time."""
        self.note("idle", "start")
        self._wait(work, transfer.description)
        self.note("idle", "end")
        self.note("recv", transfer.what)
        return transfer.tensor

    def receive_now(self, receive: Transfer) -> torch.Tensor:
        return self.wait_receive(self.post([], receive), receive)

    def finish_sends(self) -> None:
        for work, transfer in self._sends_in_flight:
            self._wait(work, transfer.description)
        self._sends_in_flight.clear()

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait()  # in C++, without the GIL; gloo's own timeout applies
        except RuntimeError as error:  # a peer's connection closed, or the timeout passed
            wait_for(failed(error), what, self.group)  # raises, naming the missing peer
