"""Every collective DDP relies on, built from nothing but point-to-point sends and receives.

Same names, arguments and in-place behaviour as torch.distributed, so the two read side by side:

    broadcast(tensor, src)             src's tensor everywhere
    reduce(tensor, dst, op)            op over all ranks' tensors, into dst's tensor
    all_reduce(tensor, op)             op over all ranks' tensors, into every rank's tensor
    reduce_scatter(output, inputs, op) rank r gets op over everyone's inputs[r]
    all_gather(outputs, tensor)        every rank gets every rank's tensor

What each algorithm costs, for a tensor of n bytes on W ranks (L = ceil(log2 W)):

    algorithm                      steps      bytes a rank sends (at most)
    broadcast  naive               W-1        (W-1) n   the root sends to everyone in turn
    broadcast  tree                L          L n       whoever has it sends: 1, 2, 4, ... ranks
    reduce     naive               W-1        n         the root receives (W-1) n in turn
    reduce     tree                L          n         the broadcast tree, run backwards
    all_reduce reduce_broadcast    2L         2L n      tree reduce to rank 0, tree broadcast
    reduce_scatter ring            W-1        (W-1)/W n
    all_gather     ring            W-1        (W-1)/W n
    all_reduce ring                2(W-1)     2(W-1)/W n   reduce_scatter, then all_gather

The ring's 2(W-1)/W n is the least any all-reduce can send per rank (Patarasuk and Yuan, 2009:
every rank must send out its (W-1)/W share of the inputs and receive the others' share of the
result), which is why NCCL and gloo use rings for large tensors, while the tree's fewer steps win
for small ones. `all_reduce(algorithm="auto")` picks between them by size (see RING_FROM_BYTES);
`CostModel` predicts each algorithm's time from two numbers fitted on the running machine.

Collectives run one at a time in issue order, async ones on one communication thread per process
(see `_InIssueOrder`), so `async_op=True` returns a `Work` at once, as torch.distributed's does.
`traffic` counts the bytes this process sent and received; `record_messages()` logs each message.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from queue import SimpleQueue

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

KiB = 1024
MiB = 1024 * KiB

BROADCAST_ALGORITHMS = ("naive", "tree")
REDUCE_ALGORITHMS = ("naive", "tree")
ALL_REDUCE_ALGORITHMS = ("reduce_broadcast", "ring", "auto")

# The smallest tensor, in bytes, from which "ring" beat "reduce_broadcast" in
# `python -m miniddp.bench collectives` (torchrun with W ranks, gloo over loopback TCP, on the
# 2-core machine MiniDDP was written on). Below it the tree's fewer steps win, above it the ring's
# fewer bytes. World sizes not listed use the largest one listed: measure yours.
RING_FROM_BYTES = {2: 16 * MiB, 3: 1 * MiB, 4: 1 * MiB}

# Our messages carry their own tag, so that a user's own dist.send/recv between the same ranks
# (tag 0 by default) is never taken for one of ours.
MESSAGE_TAG = 7_000

# How each op folds one rank's values into another's, in place. AVG is a SUM divided by W once at
# the end, and needs a floating dtype: an integer mean would have to round.
_COMBINE = {
    ReduceOp.SUM: torch.add,
    ReduceOp.AVG: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.BAND: torch.bitwise_and,
    ReduceOp.BOR: torch.bitwise_or,
    ReduceOp.BXOR: torch.bitwise_xor,
}
_INTEGER_ONLY = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


@dataclass
class Traffic:
    """What this process sent and received through these collectives since the last `reset()`.

    Counted as each message is posted, on the communication thread; read it after `wait()`.
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


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: ProcessGroup | None = None,
    algorithm: str = "tree",
    async_op: bool = False,
) -> Work | None:
    """Overwrite `tensor` on every rank with global rank `src`'s."""
    _check_choice(algorithm, BROADCAST_ALGORITHMS)
    peers = _Peers(group, f"broadcast/{algorithm}")
    root = peers.group_rank_of(src)
    run = _broadcast_naive if algorithm == "naive" else _broadcast_tree
    return _issue(lambda flat: run(peers, flat, root), tensor, [tensor], async_op)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    algorithm: str = "tree",
    async_op: bool = False,
) -> Work | None:
    """Combine every rank's `tensor` with `op` into global rank `dst`'s `tensor`.

    The other ranks' tensors are left unchanged (gloo's reduce uses them as scratch space).
    """
    _check_choice(algorithm, REDUCE_ALGORITHMS)
    _check_op(op, tensor.dtype)
    peers = _Peers(group, f"reduce/{algorithm}")
    root = peers.group_rank_of(dst)
    run = _reduce_naive if algorithm == "naive" else _reduce_tree

    def reduce_into_root(flat: torch.Tensor) -> None:
        if peers.rank == root:
            run(peers, flat, root, op)
            _finish_average(flat, op, peers.size)
        else:
            run(peers, flat.clone(), root, op)

    return _issue(reduce_into_root, tensor, [tensor], async_op)


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    algorithm: str = "auto",
    async_op: bool = False,
) -> Work | None:
    """Combine every rank's `tensor` with `op`; every rank ends with the same bits."""
    _check_choice(algorithm, ALL_REDUCE_ALGORITHMS)
    _check_op(op, tensor.dtype)
    peers = _Peers(group, "")
    if algorithm == "auto":
        algorithm = choose_all_reduce_algorithm(tensor.numel() * tensor.element_size(), peers.size)
    peers.collective = f"all_reduce/{algorithm}"
    run = _ring_all_reduce if algorithm == "ring" else _reduce_broadcast_all_reduce
    return _issue(lambda flat: run(peers, flat, op), tensor, [tensor], async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: Sequence[torch.Tensor],
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """Group rank r's `output` becomes `op` over every rank's `input_list[r]` (ring algorithm).

    The inputs are first copied into one flat buffer, which the ring reduces in place, so they
    stay unchanged.
    """
    _check_op(op, output.dtype)
    peers = _Peers(group, "reduce_scatter/ring")
    _check_pieces(input_list, output, peers.size, "input_list")

    def scatter(out: torch.Tensor) -> None:
        chunks = list(torch.cat([t.reshape(-1) for t in input_list]).tensor_split(peers.size))
        _ring_reduce_scatter(peers, chunks, op)
        out.copy_(chunks[peers.rank])
        _finish_average(out, op, peers.size)

    return _issue(scatter, output, [output], async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """`reduce_scatter` with the inputs concatenated in one tensor of W times output's size."""
    pieces = list(input.reshape(-1).tensor_split(dist.get_world_size(group)))
    return reduce_scatter(output, pieces, op, group, async_op)


def all_gather(
    tensor_list: Sequence[torch.Tensor],
    tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """`tensor_list[r]` becomes group rank r's `tensor`, on every rank (ring algorithm)."""
    peers = _Peers(group, "all_gather/ring")
    _check_pieces(tensor_list, tensor, peers.size, "tensor_list")

    def gather() -> None:
        chunks = [piece.contiguous().view(-1) for piece in tensor_list]
        chunks[peers.rank].copy_(tensor.reshape(-1))
        _ring_all_gather(peers, chunks, first_step=0)
        for piece, chunk in zip(tensor_list, chunks):
            if chunk.data_ptr() != piece.data_ptr():  # a contiguous copy of a strided piece
                piece.copy_(chunk.view(piece.shape))

    return _submit(gather, list(tensor_list), async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work | None:
    """`all_gather` into one tensor of W times the input's size, in group rank order."""
    peers = _Peers(group, "all_gather/ring")
    if output_tensor.numel() != peers.size * input_tensor.numel():
        raise ValueError(
            f"output_tensor needs {peers.size} x {input_tensor.numel()} elements, one input per "
            f"rank; got {output_tensor.numel()}"
        )

    def gather(flat: torch.Tensor) -> None:
        chunks = list(flat.tensor_split(peers.size))
        chunks[peers.rank].copy_(input_tensor.reshape(-1))
        _ring_all_gather(peers, chunks, first_step=0)

    return _issue(gather, output_tensor, [output_tensor], async_op)


def choose_all_reduce_algorithm(nbytes: int, world_size: int) -> str:
    """What `all_reduce(algorithm="auto")` runs: the tree below the measured crossover size."""
    known = [w for w in RING_FROM_BYTES if w <= world_size] or [min(RING_FROM_BYTES)]
    ring_from = RING_FROM_BYTES.get(world_size, RING_FROM_BYTES[max(known)])
    return "ring" if world_size > 1 and nbytes >= ring_from else "reduce_broadcast"


class _Peers:
    """The ranks taking part in one collective call, and the only way its algorithms talk.

    Algorithms think in group ranks 0..W-1; messages go to global ranks, as torch.distributed's
    point-to-point calls expect.
    """

    def __init__(self, group: ProcessGroup | None, collective: str) -> None:
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

    def exchange(
        self,
        step: int,
        sends: Sequence[tuple[int, torch.Tensor, str]] = (),
        receives: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> None:
        """One step: post every receive and every send, then wait for all of them.

        Posting both before waiting matters: gloo sends only once the receiver has posted its
        receive, so two ranks that each wait on a send to the other would wait forever. Empty
        tensors travel as no message at all; both sides know the sizes, so both skip them.
        """
        pending = []
        for src, buffer in receives:
            if buffer.numel():
                source = self.global_ranks[src]
                pending.append(dist.irecv(buffer, source, group=self.group, tag=MESSAGE_TAG))
                traffic.bytes_received += buffer.numel() * buffer.element_size()
                traffic.messages_received += 1
        for dst, buffer, what in sends:
            if buffer.numel():
                nbytes = buffer.numel() * buffer.element_size()
                target = self.global_ranks[dst]
                pending.append(dist.isend(buffer, target, group=self.group, tag=MESSAGE_TAG))
                traffic.bytes_sent += nbytes
                traffic.messages_sent += 1
                if self.log is not None:
                    me = self.global_ranks[self.rank]
                    self.log.append(Message(self.collective, step, me, target, what, nbytes))
        for work in pending:
            work.wait()


def _broadcast_naive(peers: _Peers, flat: torch.Tensor, root: int) -> None:
    """The root sends the whole tensor to each other rank in turn: W-1 steps."""
    me = peers.relative(root)
    if me == 0:
        for step in range(1, peers.size):
            peers.exchange(step, sends=[(peers.absolute(step, root), flat, "whole tensor")])
    else:
        peers.exchange(me, receives=[(root, flat)])


def _broadcast_tree(peers: _Peers, flat: torch.Tensor, root: int, first_step: int = 0) -> None:
    """Binomial tree: at step s the 2^(s-1) ranks that have the tensor each send it to one that
    has not (relative rank v sends to v + 2^(s-1)), so all W have it after ceil(log2 W) steps."""
    me = peers.relative(root)
    for step in range(1, _tree_steps(peers.size) + 1):
        distance = 1 << (step - 1)
        if me < distance and me + distance < peers.size:
            peer = peers.absolute(me + distance, root)
            peers.exchange(first_step + step, sends=[(peer, flat, "whole tensor")])
        elif distance <= me < 2 * distance:
            source = peers.absolute(me - distance, root)
            peers.exchange(first_step + step, receives=[(source, flat)])


def _reduce_naive(peers: _Peers, flat: torch.Tensor, root: int, op: ReduceOp.RedOpType) -> None:
    """Each rank sends its tensor to the root in turn (relative rank order): W-1 steps; the root
    folds them in as they come, ((x_root op x_root+1) op x_root+2) op ..."""
    me = peers.relative(root)
    if me == 0:
        incoming = _scratch(flat.numel(), flat.dtype, flat.device)
        for step in range(1, peers.size):
            peers.exchange(step, receives=[(peers.absolute(step, root), incoming)])
            _COMBINE[op](flat, incoming, out=flat)
    else:
        peers.exchange(me, sends=[(root, flat, "whole tensor")])


def _reduce_tree(peers: _Peers, flat: torch.Tensor, root: int, op: ReduceOp.RedOpType) -> None:
    """The broadcast tree run backwards: at each step the upper half of the ranks still holding
    a partial result send it to the lower half, which fold it in; `flat` is overwritten."""
    me = peers.relative(root)
    steps = _tree_steps(peers.size)
    incoming = _scratch(flat.numel(), flat.dtype, flat.device)
    for step in range(1, steps + 1):
        distance = 1 << (steps - step)
        if distance <= me < 2 * distance:
            peers.exchange(step, sends=[(peers.absolute(me - distance, root), flat, "partial")])
            return
        if me < distance and me + distance < peers.size:
            peers.exchange(step, receives=[(peers.absolute(me + distance, root), incoming)])
            _COMBINE[op](flat, incoming, out=flat)


def _reduce_broadcast_all_reduce(peers: _Peers, flat: torch.Tensor, op: ReduceOp.RedOpType) -> None:
    """Tree reduce into rank 0, then tree broadcast from it: 2 ceil(log2 W) steps, each moving
    the whole tensor. Few steps, many bytes: the choice for small tensors."""
    _reduce_tree(peers, flat, 0, op)
    if peers.rank == 0:
        _finish_average(flat, op, peers.size)
    _broadcast_tree(peers, flat, 0, first_step=_tree_steps(peers.size))


def _ring_all_reduce(peers: _Peers, flat: torch.Tensor, op: ReduceOp.RedOpType) -> None:
    """Cut the tensor into W chunks; reduce-scatter leaves group rank r with chunk r fully
    reduced, all-gather passes the reduced chunks round the ring. 2(W-1) steps, and each rank
    sends 2(W-1) chunks of n/W bytes: bandwidth-optimal."""
    chunks = list(flat.tensor_split(peers.size))
    _ring_reduce_scatter(peers, chunks, op)
    _finish_average(chunks[peers.rank], op, peers.size)
    _ring_all_gather(peers, chunks, first_step=peers.size - 1)


def _ring_reduce_scatter(peers: _Peers, chunks: list[torch.Tensor], op: ReduceOp.RedOpType):
    """W-1 steps round the ring r -> r+1. At step s each rank sends its partial result for chunk
    r-s (its own raw values at step 1) to the right, receives the left's partial for chunk r-s-1
    and folds its own values in. Chunk c thus starts at rank c+1 and collects one rank per step
    until it ends, complete, at rank c: x[c+1] op x[c+2] op ... op x[c], left to right."""
    me, size = peers.rank, peers.size
    right, left = (me + 1) % size, (me - 1) % size
    incoming = _scratch(max(c.numel() for c in chunks), chunks[0].dtype, chunks[0].device)
    for step in range(1, size):
        send, receive = (me - step) % size, (me - step - 1) % size
        into = chunks[receive]
        partial = incoming[: into.numel()]
        what = f"chunk {send}" + (" (own values)" if step == 1 else " (partial)")
        peers.exchange(step, sends=[(right, chunks[send], what)], receives=[(left, partial)])
        _COMBINE[op](into, partial, out=into)


def _ring_all_gather(peers: _Peers, chunks: list[torch.Tensor], first_step: int) -> None:
    """W-1 steps round the ring r -> r+1: at step s each rank forwards chunk r-s+1 (its own at
    the first step) and receives chunk r-s straight into place. Every rank ends with all W."""
    me, size = peers.rank, peers.size
    right, left = (me + 1) % size, (me - 1) % size
    for step in range(1, size):
        send, receive = (me - step + 1) % size, (me - step) % size
        peers.exchange(
            first_step + step,
            sends=[(right, chunks[send], f"chunk {send}")],
            receives=[(left, chunks[receive])],
        )


def _tree_steps(world_size: int) -> int:
    return math.ceil(math.log2(world_size)) if world_size > 1 else 0


def _finish_average(tensor: torch.Tensor, op: ReduceOp.RedOpType, world_size: int) -> None:
    if op == ReduceOp.AVG:
        tensor.div_(world_size)


_scratch_buffers: dict[torch.device, torch.Tensor] = {}


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A receive buffer, reused from call to call: a fresh 64 MiB tensor costs thousands of page
    faults each time. Only the communication thread uses it, one collective at a time."""
    nbytes = numel * dtype.itemsize
    buffer = _scratch_buffers.get(device)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _scratch_buffers[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buffer[:nbytes].view(dtype)


class Work:
    """The handle an `async_op=True` collective returns, shaped like torch.distributed's Work:
    `wait()` returns once the result is in place (or re-raises what the collective raised), and
    `get_future()` is a `torch.futures.Future` whose value is the list of output tensors."""

    def __init__(self, result: list[torch.Tensor]) -> None:
        self.result = result
        self._future: torch.futures.Future = torch.futures.Future()

    def wait(self) -> bool:
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
    """

    def __init__(self) -> None:
        self._turn = threading.Condition()
        self._issued = 0
        self._finished = 0
        self._queue: SimpleQueue[tuple[int, Callable[[], None], Work]] = SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="miniddp-comm", daemon=True)
        self.thread.start()

    def run(self, job: Callable[[], None], work: Work, async_op: bool) -> None:
        on_comm_thread = threading.current_thread() is self.thread
        if on_comm_thread and not async_op:
            raise RuntimeError(
                "A blocking collective was issued from a future's callback, which runs on the "
                "communication thread: it would wait for itself. Pass async_op=True there."
            )
        with self._turn:
            ticket = self._issued
            self._issued += 1
            if async_op:  # queued under the lock, so the queue stays in ticket order
                self._queue.put((ticket, job, work))
        if not async_op:
            self._run_in_turn(ticket, job, work)

    def _serve(self) -> None:
        while True:
            self._run_in_turn(*self._queue.get())

    def _run_in_turn(self, ticket: int, job: Callable[[], None], work: Work) -> None:
        with self._turn:
            self._turn.wait_for(lambda: self._finished == ticket)
        failure = None
        try:
            with torch.no_grad():  # collectives are not differentiable, and may write into leaves
                job()
        except Exception as exc:  # handed to whoever waits; the thread serves on
            failure = exc
        with self._turn:
            self._finished += 1
            self._turn.notify_all()
        # Completed after the turn has passed on: a callback may issue the next collective.
        if failure is None:
            work.get_future().set_result(work.result)
        else:
            work.get_future().set_exception(failure)


_in_issue_order: _InIssueOrder | None = None
_start_lock = threading.Lock()


def _submit(job: Callable[[], None], result: list[torch.Tensor], async_op: bool) -> Work | None:
    global _in_issue_order
    with _start_lock:
        if _in_issue_order is None:
            _in_issue_order = _InIssueOrder()
    work = Work(result)
    _in_issue_order.run(job, work, async_op)
    if async_op:
        return work
    work.wait()  # re-raises what the job raised
    return None


def _issue(
    algorithm: Callable[[torch.Tensor], None],
    tensor: torch.Tensor,
    result: list[torch.Tensor],
    async_op: bool,
) -> Work | None:
    """Run `algorithm` on `tensor` as one flat, contiguous 1-D tensor, updated in place."""

    def job() -> None:
        if tensor.is_contiguous():
            algorithm(tensor.view(-1))
        else:
            flat = tensor.contiguous().view(-1)
            algorithm(flat)
            tensor.copy_(flat.view(tensor.shape))

    return _submit(job, result, async_op)


def _check_choice(algorithm: str, choices: Sequence[str]) -> None:
    if algorithm not in choices:
        raise ValueError(f"algorithm must be one of {', '.join(choices)}; got {algorithm!r}")


def _check_op(op: ReduceOp.RedOpType, dtype: torch.dtype) -> None:
    if op not in _COMBINE:
        names = ", ".join(o.name for o in _COMBINE)
        raise ValueError(f"op must be one of ReduceOp.{{{names}}}; got {op!r}")
    if op == ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(
            f"ReduceOp.AVG needs a floating-point tensor, got {dtype}: an integer mean would have "
            "to round. Reduce with SUM and divide yourself."
        )
    if op in _INTEGER_ONLY and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"ReduceOp.{op.name} works on integer or bool tensors only, got {dtype}")


def _check_pieces(
    pieces: Sequence[torch.Tensor], like: torch.Tensor, world_size: int, name: str
) -> None:
    if len(pieces) != world_size:
        raise ValueError(f"{name} needs one tensor per rank ({world_size}), got {len(pieces)}")
    for piece in pieces:
        if piece.numel() != like.numel() or piece.dtype != like.dtype:
            raise ValueError(
                f"every tensor in {name} must have {like.numel()} elements of {like.dtype}, as "
                f"the other argument does; got {piece.numel()} of {piece.dtype}"
            )


@dataclass(frozen=True)
class CostModel:
    """The alpha-beta model: a message of n bytes takes alpha + n * beta seconds.

    alpha is the latency every message pays (software, system calls, waking threads), beta the
    inverse bandwidth. An algorithm of S steps whose steps carry B bytes in all (on the slowest
    rank) takes about S * alpha + B * beta. The model leaves out the time spent adding numbers
    and any contention between the messages of one step: on a few shared cores, both matter.
    """

    alpha: float  # seconds per message
    beta: float  # seconds per byte

    def predict(self, collective: str, algorithm: str, nbytes: int, world_size: int) -> float:
        steps, step_bytes = schedule(collective, algorithm, nbytes, world_size)
        return steps * self.alpha + step_bytes * self.beta


def schedule(collective: str, algorithm: str, nbytes: int, world_size: int) -> tuple[int, int]:
    """(steps, bytes carried by the steps in all) of an algorithm on `world_size` ranks."""
    w, tree = world_size, _tree_steps(world_size)
    chunk = math.ceil(nbytes / w)  # the ring's messages: the largest of W nearly equal chunks
    shapes = {
        ("broadcast", "naive"): (w - 1, (w - 1) * nbytes),
        ("broadcast", "tree"): (tree, tree * nbytes),
        ("reduce", "naive"): (w - 1, (w - 1) * nbytes),
        ("reduce", "tree"): (tree, tree * nbytes),
        ("all_reduce", "reduce_broadcast"): (2 * tree, 2 * tree * nbytes),
        ("all_reduce", "ring"): (2 * (w - 1), 2 * (w - 1) * chunk),
        ("reduce_scatter", "ring"): (w - 1, (w - 1) * chunk),
        ("all_gather", "ring"): (w - 1, (w - 1) * chunk),
    }
    if algorithm == "auto":
        algorithm = choose_all_reduce_algorithm(nbytes, world_size)
    if (collective, algorithm) not in shapes:
        raise ValueError(f"no algorithm {algorithm!r} for {collective}")
    return shapes[(collective, algorithm)]


def fit_cost_model(
    group: ProcessGroup | None = None,
    sizes: Sequence[int] = (8, 64 * KiB, 1 * MiB, 4 * MiB),  # multiples of 4: float32 tensors
    repeats: int = 10,
) -> CostModel:
    """Measure alpha and beta on this machine: every rank must call it, none may have async
    collectives in flight.

    Group ranks 0 and 1 ping-pong a float32 tensor of each size `repeats` times, through the
    same sends and receives the algorithms use; one way takes half the median round trip. The
    line alpha + n * beta is fitted to those times in relative terms, so the small sizes, which
    pin alpha down, weigh as much as the large ones, which pin beta. Rank 0 sends the result to
    all. With one rank there is nothing to measure: alpha = beta = 0.
    """
    peers = _Peers(group, "fit_cost_model")
    fitted = torch.zeros(2, dtype=torch.float64)

    def measure() -> None:
        if peers.size < 2:
            return
        one_way = [_ping_pong(peers, nbytes, repeats) for nbytes in sizes]
        if peers.rank == 0:
            n = torch.tensor(sizes, dtype=torch.float64)
            t = torch.tensor(one_way, dtype=torch.float64)
            rows = torch.stack([1 / t, n / t], dim=1)
            solution = torch.linalg.lstsq(rows, torch.ones_like(t).unsqueeze(1)).solution
            fitted.copy_(solution.squeeze(1).clamp(min=0))
        _broadcast_tree(peers, fitted, 0)

    _submit(measure, [fitted], async_op=False)
    return CostModel(alpha=fitted[0].item(), beta=fitted[1].item())


def _ping_pong(peers: _Peers, nbytes: int, repeats: int) -> float:
    """Median one-way time of an `nbytes` message between group ranks 0 and 1, on rank 0."""
    buffer = torch.zeros(nbytes // 4, dtype=torch.float32)
    times = []
    for attempt in range(repeats + 1):  # the first round trip warms up, uncounted
        start = time.perf_counter()
        if peers.rank == 0:
            peers.exchange(1, sends=[(1, buffer, "ping")])
            peers.exchange(2, receives=[(1, buffer)])
        elif peers.rank == 1:
            peers.exchange(1, receives=[(0, buffer)])
            peers.exchange(2, sends=[(0, buffer, "pong")])
        if attempt:
            times.append((time.perf_counter() - start) / 2)
    return sorted(times)[len(times) // 2]
