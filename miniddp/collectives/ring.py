"""The ring: reduce-scatter, all-gather, and the bandwidth-optimal all-reduce made of the two.

Chapter 01 (tutorials/01_collectives.py) runs it in section 3, first as one all-reduce, then as
the two halves to show the halfway point, and counts its bytes in section 4.

The idea: arrange the ranks in a ring, 0 -> 1 -> ... -> W-1 -> 0, and cut the tensor into W
chunks. At every step every rank sends one chunk to its right neighbour and receives one from
its left, all at once, so every link is busy and no rank is idle.

- Reduce-scatter: each chunk travels round the ring once, every rank folding its own values in
  as it passes; after W-1 steps chunk r is complete on rank r.
- All-gather: the complete chunks travel round once more, overwriting; after W-1 more steps
  every rank holds all of them.
- All-reduce = reduce-scatter, then all-gather.

The maths, for a tensor of n bytes on W ranks; each message is one chunk of n/W bytes:

    reduce_scatter    W-1 steps;     every rank sends (W-1)/W n bytes
    all_gather        W-1 steps;     every rank sends (W-1)/W n bytes
    all_reduce        2(W-1) steps;  every rank sends 2(W-1)/W n bytes

2(W-1)/W n is the least any all-reduce can send per rank (Patarasuk and Yuan, 2009: every rank
must send out its (W-1)/W share of the inputs and receive the others' share of the result), and
it stays under 2n however many ranks there are, which is why NCCL and gloo use rings for large
tensors. The price is 2(W-1) steps, each paying a message's fixed cost: for small tensors the
tree (tree.py) or recursive doubling (doubling.py) win.
"""

from __future__ import annotations

import torch
from torch.distributed import ReduceOp

from miniddp.collectives.peers import COMBINE, Peers, finish_average, scratch, wait_all

# One step of a ring, as this rank sees it: (chunk sent right, chunk received from the left,
# whether the received chunk is folded into ours or simply lands in place).
Step = tuple[int, int, bool]


def all_reduce(peers: Peers, flat: torch.Tensor, op: ReduceOp.RedOpType) -> None:
    """Cut the tensor into W chunks; reduce-scatter leaves group rank r with chunk r complete,
    all-gather passes the complete chunks round the ring. 2(W-1) steps, and each rank sends
    2(W-1) chunks of n/W bytes: bandwidth-optimal."""
    chunks = list(flat.tensor_split(peers.size))
    run(peers, chunks, op, reduce_scatter_steps(peers) + all_gather_steps(peers))


def reduce_scatter_steps(peers: Peers) -> list[Step]:
    """W-1 steps of (chunk sent right, chunk received from left, fold it in). At step s rank r
    sends its partial result for chunk r-s (its own values at step 1) and folds its own values
    into the left's partial for chunk r-s-1. Chunk c thus starts at rank c+1 and collects one
    rank per step until it ends, complete, at rank c: x[c+1] op x[c+2] op ... op x[c]."""
    me, size = peers.rank, peers.size
    return [((me - s) % size, (me - s - 1) % size, True) for s in range(1, size)]


def all_gather_steps(peers: Peers) -> list[Step]:
    """W-1 steps: at step s rank r forwards chunk r-s+1 (its own at step 1) and receives chunk
    r-s straight into place. Every rank ends with all W."""
    me, size = peers.rank, peers.size
    return [((me - s + 1) % size, (me - s) % size, False) for s in range(1, size)]


def run(
    peers: Peers,
    chunks: list[torch.Tensor],
    op: ReduceOp.RedOpType,
    steps: list[Step],
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
    slots = scratch(len(folds) * largest, chunks[0].dtype, chunks[0].device)
    partials = iter(slots[i * largest :][: chunks[c].numel()] for i, c in enumerate(folds))
    intos = [next(partials) if fold else chunks[receive] for _, receive, fold in steps]
    arriving = [peers.receive(left, into) for into in intos]
    sent = []
    for index, (send, receive, fold) in enumerate(steps):
        stage = "own" if index == 0 else "partial" if fold else "final"
        sent.append(peers.send(index + 1, right, chunks[send], f"chunk {send} ({stage})"))
        wait_all(arriving[index])
        if fold:
            COMBINE[op](chunks[receive], intos[index], out=chunks[receive])
            if receive == peers.rank:
                finish_average(chunks[receive], op, peers.size)
    wait_all(*sent)


LABEL_BYTES = 8  # an int64 leading each message of labelled_all_gather


def labelled_all_gather(
    peers: Peers, chunks: list[torch.Tensor], label: int, room_bytes: int
) -> list[int]:
    """The ring all-gather (all_gather_steps), each message led by its rank's `label`, and
    received into `room_bytes` (the largest chunk any rank may send instead of its own).
    Returns every rank's label, in group rank order.

    What it is for: ranks that disagree about what they gather (fully_shard's units,
    sharding/units.py) may have chunks of different sizes, and gloo aborts the process when a
    message is longer than its receive (it takes a shorter one). With room for the largest,
    every message lands; its label says whose it is. A chunk whose label is not ours is not
    copied into place (its size may be another), but passed on whole, so that every rank sees
    every label. No round trip more than the data's own: the label rides in its message.
    (`traffic` counts what was sent exactly, and, received, the room: gloo does not say how
    much of it a message filled.)"""
    right, left = (peers.rank + 1) % peers.size, (peers.rank - 1) % peers.size
    labels = [label] * peers.size
    own = chunks[peers.rank].reshape(-1).view(torch.uint8)
    lead = torch.tensor([label], dtype=torch.int64, device=own.device).view(torch.uint8)
    message = torch.cat([lead, own])
    inboxes = [
        torch.empty(LABEL_BYTES + room_bytes, dtype=torch.uint8, device=own.device)
        for _ in range(peers.size - 1)
    ]
    arriving = [peers.receive(left, inbox) for inbox in inboxes]
    sent = []
    for index, (send, receive, _) in enumerate(all_gather_steps(peers)):
        sent.append(peers.send(index + 1, right, message, f"chunk {send} (labelled)"))
        wait_all(arriving[index])
        inbox = inboxes[index]
        labels[receive] = int(inbox[:LABEL_BYTES].view(torch.int64))
        place = chunks[receive].reshape(-1).view(torch.uint8)
        if labels[receive] == label:
            place.copy_(inbox[LABEL_BYTES:][: place.numel()])
            message = inbox[: LABEL_BYTES + place.numel()]
        else:
            message = inbox  # another size, perhaps: all of it goes on
    wait_all(*sent)
    return labels
