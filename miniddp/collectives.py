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
    all_reduce reduce_broadcast    2L         L n       tree reduce to rank 0, tree broadcast
    all_reduce recursive_doubling  L (+2)     L n (+n)  swap and combine with rank r XOR 2^k
    reduce_scatter ring            W-1        (W-1)/W n
    all_gather     ring            W-1        (W-1)/W n
    all_reduce ring                2(W-1)     2(W-1)/W n   reduce_scatter, then all_gather

(+2: two more steps, and one more n, when W is not a power of two.) The ring's 2(W-1)/W n is the
least any all-reduce can send per rank (Patarasuk and Yuan, 2009: every rank must send out its
(W-1)/W share of the inputs and receive the others' share of the result), which is why NCCL and
gloo use rings for large tensors; recursive doubling's log2 W steps are the fewest any all-reduce
can take, which wins for small ones. `all_reduce(algorithm="auto")` picks by size (AUTO_CHOICES);
`CostModel` predicts each algorithm's time from two numbers fitted on the running machine.

Collectives run one at a time in issue order, async ones on one communication thread per process
(see `_InIssueOrder`), so `async_op=True` returns a `Work` at once, as torch.distributed's does.
`traffic` counts the bytes this process sent and received; `record_messages()` logs each message.
"""

from __future__ import annotations

import atexit
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
ALL_REDUCE_ALGORITHMS = ("reduce_broadcast", "recursive_doubling", "ring", "auto")

# What `all_reduce(algorithm="auto")` runs, by world size: (from this many bytes on, algorithm).
# Measured with `python -m miniddp.bench collectives` under torchrun with W ranks (gloo over
# loopback TCP) on the shared 2-core machine MiniDDP was written on, where a "link" is memory
# copies by the same two cores and every message costs ~100 us of thread wake-ups. There, fewer
# messages won up to tens of MiB: with 2 ranks the ring's 4 half-size messages lost to the tree's
# 2 whole ones below 64 MiB, and recursive doubling's single swap won below 128 KiB; with 3 or 4
# ranks on 2 cores, steps that need every rank running at once are slow, which favours the tree
# until the bytes dominate. Between neighbouring entries the two algorithms were within the
# run-to-run noise (about 10%). World sizes not listed use the largest one listed: measure yours.
AUTO_CHOICES = {
    2: ((0, "recursive_doubling"), (128 * KiB, "reduce_broadcast"), (64 * MiB, "ring")),
    3: ((0, "reduce_broadcast"), (16 * MiB, "ring")),
    4: ((0, "reduce_broadcast"), (16 * MiB, "ring")),
}

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
_INTEGER_ONLY = frozenset((ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR))


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
            _wait(run(peers, flat.clone(), root, op))

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
    run = {
        "reduce_broadcast": _reduce_broadcast_all_reduce,
        "recursive_doubling": _recursive_doubling_all_reduce,
        "ring": _ring_all_reduce,
    }[algorithm]
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
        _run_ring(peers, chunks, op, _ring_reduce_scatter(peers))
        out.copy_(chunks[peers.rank])

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
        _run_ring(peers, chunks, ReduceOp.SUM, _ring_all_gather(peers))
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
        _run_ring(peers, chunks, ReduceOp.SUM, _ring_all_gather(peers))

    return _issue(gather, output_tensor, [output_tensor], async_op)


def choose_all_reduce_algorithm(nbytes: int, world_size: int) -> str:
    """What `all_reduce(algorithm="auto")` runs for a tensor of `nbytes` on `world_size` ranks:
    the last entry of AUTO_CHOICES[world_size] whose size `nbytes` reaches."""
    choices = AUTO_CHOICES.get(world_size, AUTO_CHOICES[max(AUTO_CHOICES)])
    return [algorithm for from_bytes, algorithm in choices if nbytes >= from_bytes][-1]


class _Peers:
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
        return dist.irecv(buffer, source, group=self.group, tag=MESSAGE_TAG)

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
        return dist.isend(buffer, target, group=self.group, tag=MESSAGE_TAG)

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
        _wait(*posted)


def _wait(*works: dist.Work | None) -> None:
    for work in works:
        if work is not None:
            work.wait()


def _broadcast_naive(peers: _Peers, flat: torch.Tensor, root: int) -> None:
    """The root sends the whole tensor to each other rank in turn: W-1 steps."""
    me = peers.relative(root)
    if me == 0:
        for step in range(1, peers.size):
            peers.exchange(step, sends=[(peers.absolute(step, root), flat, "whole tensor")])
    else:
        peers.exchange(me, receives=[(root, flat)])


def _reduce_naive(peers: _Peers, flat: torch.Tensor, root: int, op: ReduceOp.RedOpType) -> None:
    """Each rank sends its tensor to the root in turn (relative rank order): W-1 steps; the root
    folds them in as they come, ((x_root op x_root+1) op x_root+2) op ... Returns once its
    sends are done (None, like `_reduce_tree` at the root)."""
    me = peers.relative(root)
    if me == 0:
        incoming = _scratch(flat.numel(), flat.dtype, flat.device)
        for step in range(1, peers.size):
            peers.exchange(step, receives=[(peers.absolute(step, root), incoming)])
            _COMBINE[op](flat, incoming, out=flat)
    else:
        peers.exchange(me, sends=[(root, flat, "whole tensor")])


# The binomial tree, in ranks relative to the root. Broadcasting, at step s every rank that has
# the tensor sends it to the rank 2^(s-1) further on, so the holders double each step: 1, 2, 4...
# Rank v's children are thus v + d for each power of two d > v (with v + d < W), reached at step
# log2(d) + 1, and its parent is v minus its highest power of two. Reducing runs the same tree
# backwards: the child at distance d sends its partial result at step ceil(log2 W) - log2(d).
#
#     W = 8:   0 -> 1 (step 1)   0 -> 2, 1 -> 3 (step 2)   0 -> 4, 1 -> 5, 2 -> 6, 3 -> 7 (step 3)
#
# Every rank posts its receives first, then sends as soon as its data is complete, rather than
# waiting step by step: gloo sends only into a posted receive, so a receive posted late would
# cost the sender a round trip of "ready" notice at every level of the tree.


def _child_distances(me: int, size: int) -> list[int]:
    return [1 << k for k in range(size.bit_length()) if me < 1 << k < size - me]


def _parent_distance(me: int) -> int:
    return 1 << (me.bit_length() - 1)


def _receive_from_parent(peers: _Peers, flat: torch.Tensor, root: int) -> dist.Work | None:
    me = peers.relative(root)
    return peers.receive(peers.absolute(me - _parent_distance(me), root), flat)


def _broadcast_tree(
    peers: _Peers,
    flat: torch.Tensor,
    root: int,
    first_step: int = 0,
    arriving: dist.Work | None = None,
) -> None:
    """Binomial tree broadcast: ceil(log2 W) steps. `arriving`: the receive from the parent, if
    the caller posted it already."""
    me = peers.relative(root)
    if me > 0:
        _wait(arriving if arriving is not None else _receive_from_parent(peers, flat, root))
    sends = [
        peers.send(first_step + d.bit_length(), peers.absolute(me + d, root), flat, "whole tensor")
        for d in _child_distances(me, peers.size)
    ]
    _wait(*sends)


def _reduce_tree(
    peers: _Peers, flat: torch.Tensor, root: int, op: ReduceOp.RedOpType
) -> dist.Work | None:
    """Binomial tree reduce, ceil(log2 W) steps: each rank folds its children's partial results
    into `flat` (furthest child first: the order is fixed, so the rounding is too), then sends
    the result to its parent. Returns that send still in flight (None at the root): the caller
    waits for it, and may post a receive first."""
    me, steps = peers.relative(root), _tree_steps(peers.size)
    children = sorted(_child_distances(me, peers.size), reverse=True)
    n = flat.numel()
    slots = _scratch(len(children) * n, flat.dtype, flat.device)
    partials = [slots[i * n : (i + 1) * n] for i in range(len(children))]
    arriving = [
        peers.receive(peers.absolute(me + d, root), partial)
        for d, partial in zip(children, partials)
    ]
    for partial, work in zip(partials, arriving):
        _wait(work)
        _COMBINE[op](flat, partial, out=flat)
    if me > 0:
        distance = _parent_distance(me)
        step = steps + 1 - distance.bit_length()
        return peers.send(step, peers.absolute(me - distance, root), flat, "partial")
    return None


def _reduce_broadcast_all_reduce(peers: _Peers, flat: torch.Tensor, op: ReduceOp.RedOpType) -> None:
    """Tree reduce into rank 0, then tree broadcast from it: 2 ceil(log2 W) steps, each moving
    the whole tensor. Few steps, many bytes: the choice for small tensors.

    The broadcast's receive is posted as soon as our partial is on its way, before waiting for
    that send: the parent broadcasts only once our partial has arrived, so it never waits for
    our receive, and our partial left without waiting for the receive to be posted. It cannot
    arrive too early either: the parent we receive from is the parent we sent our partial to,
    and it broadcasts only after the whole reduce is done, so after our partial has left `flat`.
    """
    partial_sent = _reduce_tree(peers, flat, 0, op)
    arriving = _receive_from_parent(peers, flat, 0) if peers.rank > 0 else None
    _wait(partial_sent)
    if peers.rank == 0:
        _finish_average(flat, op, peers.size)
    _broadcast_tree(peers, flat, 0, first_step=_tree_steps(peers.size), arriving=arriving)


def _recursive_doubling_all_reduce(
    peers: _Peers, flat: torch.Tensor, op: ReduceOp.RedOpType
) -> None:
    """At step k every rank swaps its partial result with the rank whose number differs from
    its own in bit k, and both combine the two: after log2 W steps every rank holds everything.
    The fewest steps of any all-reduce, at the price of a whole tensor per step: the choice for
    small tensors.

    When W is not a power of two, the ranks from the largest power of two P on first hand their
    tensor to rank r - P and, at the end, get the result back from it: two more steps.

    Both partners combine as (lower rank's partial) op (higher rank's), so they compute the same
    bits, and every rank ends with the same result.
    """
    me, size = peers.rank, peers.size
    inner = 1 << (size.bit_length() - 1)  # the largest power of two <= W
    folded = size > inner
    incoming = _scratch(flat.numel(), flat.dtype, flat.device)
    if me >= inner:  # an extra rank: hand over, then wait for the result
        result = peers.receive(me - inner, flat)  # arrives only after our send has been received
        _wait(peers.send(1, me - inner, flat, "own values"), result)
        return
    if me + inner < size:
        peers.exchange(1, receives=[(me + inner, incoming)])
        _COMBINE[op](flat, incoming, out=flat)
    for k in range(inner.bit_length() - 1):
        partner = me ^ (1 << k)
        step = k + 1 + folded
        peers.exchange(step, sends=[(partner, flat, "partial")], receives=[(partner, incoming)])
        lower, higher = (flat, incoming) if me < partner else (incoming, flat)
        _COMBINE[op](lower, higher, out=flat)
    _finish_average(flat, op, size)
    if me + inner < size:
        peers.exchange(inner.bit_length() + 1, sends=[(me + inner, flat, "result")])


def _ring_all_reduce(peers: _Peers, flat: torch.Tensor, op: ReduceOp.RedOpType) -> None:
    """Cut the tensor into W chunks; reduce-scatter leaves group rank r with chunk r complete,
    all-gather passes the complete chunks round the ring. 2(W-1) steps, and each rank sends
    2(W-1) chunks of n/W bytes: bandwidth-optimal."""
    chunks = list(flat.tensor_split(peers.size))
    _run_ring(peers, chunks, op, _ring_reduce_scatter(peers) + _ring_all_gather(peers))


def _ring_reduce_scatter(peers: _Peers) -> list[tuple[int, int, bool]]:
    """W-1 steps of (chunk sent right, chunk received from left, fold it in). At step s rank r
    sends its partial result for chunk r-s (its own values at step 1) and folds its own values
    into the left's partial for chunk r-s-1. Chunk c thus starts at rank c+1 and collects one
    rank per step until it ends, complete, at rank c: x[c+1] op x[c+2] op ... op x[c]."""
    me, size = peers.rank, peers.size
    return [((me - s) % size, (me - s - 1) % size, True) for s in range(1, size)]


def _ring_all_gather(peers: _Peers) -> list[tuple[int, int, bool]]:
    """W-1 steps: at step s rank r forwards chunk r-s+1 (its own at step 1) and receives chunk
    r-s straight into place. Every rank ends with all W."""
    me, size = peers.rank, peers.size
    return [((me - s + 1) % size, (me - s) % size, False) for s in range(1, size)]


def _run_ring(
    peers: _Peers,
    chunks: list[torch.Tensor],
    op: ReduceOp.RedOpType,
    steps: list[tuple[int, int, bool]],
) -> None:
    """Run ring steps, r -> r+1: at each step every rank sends one chunk right and receives one
    from the left. A chunk that is complete (folded into at the last reduce-scatter step) is
    divided by W there for AVG.

    Every receive is posted before the first send, and no send is waited for until the end, so
    a rank only ever waits for data: the left neighbour never waits for our "ready" notice, and
    a step's send leaves as soon as its chunk is folded. Posting early is safe because nothing
    lands where we still look: partials go to a scratch slot per step; in a plain all-gather a
    chunk lands before we first forward it; and in an all-reduce a final chunk arrives only
    after our partial of it went round the whole ring, long after we last read or wrote it (the
    final value includes what we sent, so that send is finished).
    """
    right, left = (peers.rank + 1) % peers.size, (peers.rank - 1) % peers.size
    folds = [receive for _, receive, fold in steps if fold]
    largest = max(chunk.numel() for chunk in chunks)
    slots = _scratch(len(folds) * largest, chunks[0].dtype, chunks[0].device)
    partials = iter(slots[i * largest :][: chunks[c].numel()] for i, c in enumerate(folds))
    intos = [next(partials) if fold else chunks[receive] for _, receive, fold in steps]
    arriving = [peers.receive(left, into) for into in intos]
    sent = []
    for index, (send, receive, fold) in enumerate(steps):
        stage = "own" if index == 0 else "partial" if fold else "final"
        sent.append(peers.send(index + 1, right, chunks[send], f"chunk {send} ({stage})"))
        _wait(arriving[index])
        if fold:
            _COMBINE[op](chunks[receive], intos[index], out=chunks[receive])
            if receive == peers.rank:
                _finish_average(chunks[receive], op, peers.size)
    _wait(*sent)


def _tree_steps(world_size: int) -> int:
    return math.ceil(math.log2(world_size)) if world_size > 1 else 0


def _finish_average(tensor: torch.Tensor, op: ReduceOp.RedOpType, world_size: int) -> None:
    if op == ReduceOp.AVG:
        tensor.div_(world_size)


_scratch_buffers: dict[torch.device, torch.Tensor] = {}


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A receive buffer, reused from call to call: a fresh 64 MiB tensor costs thousands of page
    faults each time. Collectives run one at a time, so one buffer (per device) serves them all;
    it keeps the largest size asked for."""
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


def _submit(job: Callable[[], None], result: list[torch.Tensor], async_op: bool) -> Work | None:
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
    inner_steps = w.bit_length() - 1  # log2 of the largest power of two <= W
    doubling = inner_steps + (2 if w > 1 << inner_steps else 0)
    chunk = math.ceil(nbytes / w)  # the ring's messages: the largest of W nearly equal chunks
    shapes = {
        ("broadcast", "naive"): (w - 1, (w - 1) * nbytes),
        ("broadcast", "tree"): (tree, tree * nbytes),
        ("reduce", "naive"): (w - 1, (w - 1) * nbytes),
        ("reduce", "tree"): (tree, tree * nbytes),
        ("all_reduce", "reduce_broadcast"): (2 * tree, 2 * tree * nbytes),
        ("all_reduce", "recursive_doubling"): (doubling, doubling * nbytes),
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
    sizes: Sequence[int] = (8, 4 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB),
    repeats: int = 30,
) -> CostModel:
    """Measure alpha and beta on this machine: every rank must call it, with no async collective
    of ours in flight.

    Group ranks 0 and 1 ping-pong a float32 tensor of each size (multiples of 4 bytes) `repeats`
    times, through the same sends and receives the algorithms use, going round the sizes so that
    a busy moment slows one round rather than one size. One way is half the quickest round trip:
    the model describes the machine, not whoever else was using it at the time. alpha is the
    smallest message's time; beta is the least-squares slope of the others' times above alpha,
    so the large sizes, where bandwidth shows, decide it. Rank 0 sends the result to all. With
    one rank there is nothing to measure: alpha = beta = 0.
    """
    peers = _Peers(group, "fit_cost_model")
    fitted = torch.zeros(2, dtype=torch.float64)

    def measure() -> None:
        if peers.size < 2:
            return
        buffers = [torch.zeros(nbytes // 4) for nbytes in sizes]
        one_way = [math.inf] * len(sizes)
        for attempt in range(repeats + 1):  # the first round warms up, uncounted
            for index, buffer in enumerate(buffers):
                seconds = _ping_pong(peers, buffer)
                if attempt:
                    one_way[index] = min(one_way[index], seconds)
        if peers.rank == 0:
            alpha = one_way[0]
            n = torch.tensor(sizes[1:], dtype=torch.float64)
            above_alpha = torch.tensor(one_way[1:], dtype=torch.float64) - alpha
            beta = (n * above_alpha).sum() / (n * n).sum()
            fitted.copy_(torch.tensor([alpha, beta.item()]))
        _broadcast_tree(peers, fitted, 0)

    _submit(measure, [fitted], async_op=False)
    return CostModel(alpha=fitted[0].item(), beta=fitted[1].item())


def _ping_pong(peers: _Peers, buffer: torch.Tensor) -> float:
    """Half a round trip of `buffer` between group ranks 0 and 1, as rank 0 times it."""
    start = time.perf_counter()
    if peers.rank == 0:
        peers.exchange(1, sends=[(1, buffer, "ping")])
        peers.exchange(2, receives=[(1, buffer)])
    elif peers.rank == 1:
        peers.exchange(1, receives=[(0, buffer)])
        peers.exchange(2, sends=[(0, buffer, "pong")])
    return (time.perf_counter() - start) / 2
