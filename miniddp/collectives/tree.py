"""The binomial tree: broadcast, reduce, and an all-reduce made of the two.

Chapter 01 (tutorials/01_collectives.py) runs these in sections 1 to 3, after the naive ones of
naive.py, and its section 6 fits the cost model with this broadcast.

The idea: whoever already has the data helps to pass it on. Ranks are counted from the root, as
if the root were rank 0. Broadcasting, at step s every rank that has the tensor sends it to the
rank 2^(s-1) further on, so the holders double each step: 1, 2, 4, ... Rank v's children are
thus v + d for each power of two d > v (with v + d < W), reached at step log2(d) + 1, and its
parent is v minus its highest power of two. Reducing runs the same tree backwards: the child at
distance d sends its partial result at step ceil(log2 W) - log2(d), and each parent folds its
children's partials into its own before sending on.

    W = 8:   0 -> 1 (step 1)   0 -> 2, 1 -> 3 (step 2)   0 -> 4, 1 -> 5, 2 -> 6, 3 -> 7 (step 3)

The maths, for a tensor of n bytes on W ranks, with L = ceil(log2 W):

    broadcast         L steps, each carrying the whole tensor; the root sends L n bytes
    reduce            L steps; every rank but the root sends n bytes, once
    all-reduce        reduce into rank 0, then broadcast from it: 2L steps, the whole tensor each

Against the naive W-1 steps that is the same bytes per receiver in far fewer steps: for W = 64,
6 steps instead of 63. Every step still moves the whole tensor, so the all-reduce is the choice
for small tensors, where each message's fixed cost (alpha in cost_model.py) dominates.

Every rank posts its receives first, then sends as soon as its data is complete, rather than
waiting step by step: gloo sends only into a posted receive, so a receive posted late would
cost the sender a round trip of "ready" notice at every level of the tree.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from miniddp.collectives.peers import COMBINE, Peers, finish_average, scratch, wait_all


def tree_steps(world_size: int) -> int:
    """L = ceil(log2 W): the depth of the tree, and the steps of one broadcast or reduce."""
    return math.ceil(math.log2(world_size)) if world_size > 1 else 0


def _child_distances(me: int, size: int) -> list[int]:
    return [1 << k for k in range(size.bit_length()) if me < 1 << k < size - me]


def _parent_distance(me: int) -> int:
    return 1 << (me.bit_length() - 1)


def _receive_from_parent(peers: Peers, flat: torch.Tensor, root: int) -> dist.Work | None:
    me = peers.relative(root)
    return peers.receive(peers.absolute(me - _parent_distance(me), root), flat)


def broadcast(
    peers: Peers,
    flat: torch.Tensor,
    root: int,
    first_step: int = 0,
    arriving: dist.Work | None = None,
) -> None:
    """Binomial tree broadcast: ceil(log2 W) steps. `arriving`: the receive from the parent, if
    the caller posted it already."""
    me = peers.relative(root)
    if me > 0:
        wait_all(arriving if arriving is not None else _receive_from_parent(peers, flat, root))
    sends = [
        peers.send(first_step + d.bit_length(), peers.absolute(me + d, root), flat, "whole tensor")
        for d in _child_distances(me, peers.size)
    ]
    wait_all(*sends)


def reduce(peers: Peers, flat: torch.Tensor, root: int, op: ReduceOp.RedOpType) -> dist.Work | None:
    """Binomial tree reduce, ceil(log2 W) steps: each rank folds its children's partial results
    into `flat` (furthest child first: the order is fixed, so the rounding is too), then sends
    the result to its parent. Returns that send still in flight (None at the root): the caller
    waits for it, and may post a receive first."""
    me, steps = peers.relative(root), tree_steps(peers.size)
    children = sorted(_child_distances(me, peers.size), reverse=True)
    n = flat.numel()
    slots = scratch(len(children) * n, flat.dtype, flat.device)
    partials = [slots[i * n : (i + 1) * n] for i in range(len(children))]
    arriving = [
        peers.receive(peers.absolute(me + d, root), partial)
        for d, partial in zip(children, partials)
    ]
    for partial, work in zip(partials, arriving):
        wait_all(work)
        COMBINE[op](flat, partial, out=flat)
    if me > 0:
        distance = _parent_distance(me)
        step = steps + 1 - distance.bit_length()
        return peers.send(step, peers.absolute(me - distance, root), flat, "partial")
    return None


def all_reduce(peers: Peers, flat: torch.Tensor, op: ReduceOp.RedOpType) -> None:
    """Tree reduce into rank 0, then tree broadcast from it: 2 ceil(log2 W) steps, each moving
    the whole tensor. Few steps, many bytes: the choice for small tensors.

    The broadcast's receive is posted as soon as our partial is on its way, before waiting for
    that send: the parent broadcasts only once our partial has arrived, so it never waits for
    our receive, and our partial left without waiting for the receive to be posted. It cannot
    arrive too early either: the parent we receive from is the parent we sent our partial to,
    and it broadcasts only after the whole reduce is done, so after our partial has left `flat`.
    """
    partial_sent = reduce(peers, flat, 0, op)
    arriving = _receive_from_parent(peers, flat, 0) if peers.rank > 0 else None
    wait_all(partial_sent)
    if peers.rank == 0:
        finish_average(flat, op, peers.size)
    broadcast(peers, flat, 0, first_step=tree_steps(peers.size), arriving=arriving)
