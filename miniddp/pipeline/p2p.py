"""The messages between neighbouring stages: activations forward, gradients backward.

A stage talks only to its two neighbours, by point-to-point send and receive on the pipeline's
process group. Two rules keep it from deadlocking, on gloo and on NCCL alike:

    sends never block the sender: each goes out asynchronously and is waited for at the end
    of the step (its tensor is kept alive until then);
    the sends an action produced go out in ONE batch (`dist.batch_isend_irecv`) with the
    receive the next action needs. On NCCL a batch runs its sends and receives together; issued
    one by one, stage s's send of an activation and stage s+1's send of a gradient could each
    wait for the other's receive forever (torch's Schedule1F1B fuses the same pairs).

A transfer is waited for through `miniddp.job.faults.wait_for_transfer`, the seam that names a
dead or silent peer, and not through `wait_for` as a collective is: wait_for counts the
collectives each rank finished, and ranks compare those counts to tell where each one is (and
cleanup() to tell that all ran the same steps); stages run different numbers of transfers (a
middle stage twice an end stage's), so counting them would set ranks apart that are in step.
While the stage waits (gloo's own `work.wait()`, on a helper thread), it listens to the store:
a peer that stopped (its stage raised, and its script called cleanup()) is named at once, on
both ranks, instead of after the group's timeout; a dead one shows as its connection closes.

With several stages a rank (interleaving), two ranks exchange several streams (W = 2: rank 0
sends stage 0's activations AND stage 2's to rank 1), and the order one rank sends in need not
be the order the other receives in. So every transfer carries a tag naming what it is (the
kind, the stage, the microbatch): gloo and NCCL match a receive with the send of its own tag.
Where two neighbouring stages share a rank (the V schedules' turn: stages W - 1 and W on rank
W - 1) nothing crosses a wire: the mailbox keeps the sent tensor under its tag, and the receive
copies it out, as torch's pipelining hands it over in memory.

What crosses a border is a tuple of tensors, as in torch's pipelining: a stage's output is a
tensor or a tuple of them (a hidden state and its mask), and the next stage is called with them
as its arguments, `submodule(*inputs)`. Each tensor is its own transfer. A floating-point one
carries a gradient back (zeros if the next stage did not use it); an integer or bool one (a
mask, token ids) travels forward only. Both ends read that from the dtype alone
(`carries_gradient`), so they agree without asking; each transfer's tag names the tensor's
place in the tuple.

Shapes are not hard-coded: the first time a stage sends an activation it first sends a small
header (the count, then each tensor's dtype and sizes), and its neighbour allocates its receive
buffers from it (`Header`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from miniddp.collectives.peers import landing, on_the_wire
from miniddp.job.faults import wait_for, wait_for_transfer

MAX_TENSORS = 8  # an activation is a tuple of at most 8 tensors ...
MAX_DIMS = 8  # ... each of up to 8 dimensions
DTYPES = (
    *(torch.float32, torch.float64, torch.float16, torch.bfloat16),
    *(torch.int64, torch.int32, torch.bool),
)
ENTRY = 2 + MAX_DIMS  # a tensor in the header: dtype, ndim, sizes


def as_tuple(value: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A stage's input or output as the tuple of tensors that crosses a border."""
    return value if isinstance(value, tuple) else (value,)


def carries_gradient(dtype: torch.dtype) -> bool:
    """Whether a gradient comes back for an entry of this dtype in an activation: autograd's own
    rule, only floating-point tensors can require grad."""
    return dtype.is_floating_point


def failed(error: Exception) -> torch.futures.Future:
    """A future that failed with `error`: what `wait_for` diagnoses."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_exception(error)
    return future


@dataclass(frozen=True)
class Header:
    """What a receiver must know to allocate an activation: each tensor's dtype and sizes."""

    entries: tuple[tuple[torch.dtype, tuple[int, ...]], ...]

    @staticmethod
    def of(tensors: tuple[torch.Tensor, ...]) -> Header:
        return Header(tuple((t.dtype, tuple(t.shape)) for t in tensors))

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(shape for _, shape in self.entries)

    def encode(self, device: torch.device) -> torch.Tensor:
        strange = [(d, s) for d, s in self.entries if d not in DTYPES or len(s) > MAX_DIMS]
        if strange or len(self.entries) > MAX_TENSORS:
            raise ValueError(
                f"a stage's output of {len(self.entries)} tensors (dtypes and shapes: "
                f"{list(self.entries)}) cannot be described to the next stage: use at most "
                f"{MAX_TENSORS} tensors of {DTYPES}, each of at most {MAX_DIMS} dimensions, "
                "or give the next stage input_args (an example of its input)."
            )
        codes = [len(self.entries)]
        for dtype, shape in self.entries:
            codes += [DTYPES.index(dtype), len(shape), *shape, *[0] * (MAX_DIMS - len(shape))]
        codes += [0] * (1 + ENTRY * MAX_TENSORS - len(codes))
        return torch.tensor(codes, dtype=torch.int64, device=device)

    @staticmethod
    def decode(codes: torch.Tensor) -> Header:
        count, *rest = codes.tolist()
        rows = [rest[k * ENTRY : (k + 1) * ENTRY] for k in range(count)]
        return Header(tuple((DTYPES[dtype], tuple(sizes[:ndim])) for dtype, ndim, *sizes in rows))

    @staticmethod
    def buffer(device: torch.device) -> torch.Tensor:
        return torch.empty(1 + ENTRY * MAX_TENSORS, dtype=torch.int64, device=device)

    def empty(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        return tuple(
            torch.empty(shape, dtype=dtype, device=device) for dtype, shape in self.entries
        )


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
    """One stage's sends and receives. `post(sends, receives)` launches them as one batch and
    returns the receives' works; `finish_sends()` waits for every send still in flight.

    `note(kind, name)` tells the schedule's observer (observe/events.py): it hears "send" when
    a send goes out, "idle" start/end around each wait for receives, and "recv" when the data
    is here.
    """

    def __init__(self, group: dist.ProcessGroup | None, note: Callable[[str, str], None]) -> None:
        self.group = group
        self.note = note
        self.rank = dist.get_rank(group)
        self._sends_in_flight: list[tuple[dist.Work, Transfer]] = []
        self._on_this_rank: dict[int, torch.Tensor] = {}  # sent to a stage here, by tag
        self.bytes_sent = 0  # every send's payload since the mailbox was made

    def post(self, sends: list[Transfer], receives: list[Transfer] = ()) -> list[dist.Work | None]:
        """Launch `sends` and `receives` as one batch; the receives' works (None: one from a
        stage on this rank, already here)."""
        for send in sends:
            if send.rank == self.rank:
                self._on_this_rank[send.tag] = send.tensor
        for receive in receives:
            if receive.rank == self.rank:
                receive.tensor.copy_(self._on_this_rank.pop(receive.tag))
        works = iter(self._post_between_ranks(sends, receives))
        return [None if t.rank == self.rank else next(works) for t in receives]

    def _post_between_ranks(self, sends: list[Transfer], receives: list[Transfer]) -> list:
        sends = [t for t in sends if t.rank != self.rank]
        transfers = [*sends, *(t for t in receives if t.rank != self.rank)]
        if not transfers:
            return []
        wires = [on_the_wire(t.tensor, self.group, incoming=not t.is_send) for t in transfers]
        ops = [
            dist.P2POp(
                dist.isend if t.is_send else dist.irecv,
                wire,
                group=self.group,
                tag=t.tag,
                group_peer=t.rank,
            )
            for t, wire in zip(transfers, wires)
        ]
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as error:  # gloo sends at once: a dead peer can fail it right here
            what = " and ".join(t.description for t in transfers)
            wait_for(failed(error), what, self.group)  # raises, naming the missing peer
        for work, transfer in zip(works, sends):
            self._sends_in_flight.append((work, transfer))  # keeps the tensor alive
            self.bytes_sent += transfer.tensor.numel() * transfer.tensor.element_size()
            self.note("send", transfer.what)
        received = zip(works[len(sends) :], wires[len(sends) :], transfers[len(sends) :])
        return [landing(work, wire, transfer.tensor) for work, wire, transfer in received]

    def wait_receives(
        self, works: list[dist.Work | None], receives: list[Transfer]
    ) -> tuple[torch.Tensor, ...]:
        """Block until `receives` have arrived; the time spent here is the stage's idle time."""
        self.note("idle", "start")
        for work, transfer in zip(works, receives, strict=True):
            if work is not None:  # None: from a stage on this rank, handed over in memory
                wait_for_transfer(work, transfer.description, transfer.rank, self.group)
        self.note("idle", "end")
        for transfer in receives:
            self.note("recv", transfer.what)
        return tuple(transfer.tensor for transfer in receives)

    def receive_now(self, receives: list[Transfer]) -> tuple[torch.Tensor, ...]:
        return self.wait_receives(self.post([], receives), receives)

    def finish_sends(self) -> None:
        for work, transfer in self._sends_in_flight:
            wait_for_transfer(work, transfer.description, transfer.rank, self.group)
        self._sends_in_flight.clear()
