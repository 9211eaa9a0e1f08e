"""Recursive doubling: the all-reduce with the fewest steps.

Chapter 01 (tutorials/01_collectives.py) runs it in section 3, beside the tree's all-reduce
(tree.py) and the ring's (ring.py).

The idea: at step k every rank swaps its partial result with its partner, the rank whose number
differs from its own in bit k, and both combine the two. After step k each rank holds the
combination of a block of 2^(k+1) ranks, so the blocks double each step, and after log2 W steps
every rank holds everything: half the steps of the tree's reduce-then-broadcast (tree.py),
because no rank waits while others work: all W ranks send at every step.

    W = 4:   step 1: 0 <-> 1, 2 <-> 3     step 2: 0 <-> 2, 1 <-> 3

The maths, for a tensor of n bytes on W ranks:

    W a power of two     log2 W steps; every rank sends the whole tensor each step: log2 W n
    otherwise            with P the largest power of two below W, each extra rank r >= P
                         first hands its tensor to rank r - P, and gets the result back from it
                         at the end: log2 P + 2 steps; a rank that folds an extra in sends
                         log2 P n + n

log2 W is the fewest steps any all-reduce can take (each step at most doubles the number of
ranks whose values a rank holds), which wins for small tensors, where each message's fixed cost
dominates. The price is the whole tensor at every step: for large ones the ring (ring.py) sends
far fewer bytes.
"""

from __future__ import annotations

import torch
from torch.distributed import ReduceOp

from miniddp.collectives.peers import COMBINE, Peers, finish_average, scratch, wait_all


def all_reduce(peers: Peers, flat: torch.Tensor, op: ReduceOp.RedOpType) -> None:
    """Swap and combine with rank r XOR 2^k at step k; extra ranks beyond a power of two hand
    over first and get the result back last.

    Both partners combine as (lower rank's partial) op (higher rank's), so they compute the same
    bits, and every rank ends with the same result.
    """
    me, size = peers.rank, peers.size
    inner = 1 << (size.bit_length() - 1)  # the largest power of two <= W
    folded = size > inner
    incoming = scratch(flat.numel(), flat.dtype, flat.device)
    if me >= inner:  # an extra rank: hand over, then wait for the result
        result = peers.receive(me - inner, flat)  # arrives only after our send has been received
        wait_all(peers.send(1, me - inner, flat, "own values"), result)
        return
    if me + inner < size:
        peers.exchange(1, receives=[(me + inner, incoming)])
        COMBINE[op](flat, incoming, out=flat)
    for k in range(inner.bit_length() - 1):
        partner = me ^ (1 << k)
        step = k + 1 + folded
        peers.exchange(step, sends=[(partner, flat, "partial")], receives=[(partner, incoming)])
        lower, higher = (flat, incoming) if me < partner else (incoming, flat)
        COMBINE[op](lower, higher, out=flat)
    finish_average(flat, op, size)
    if me + inner < size:
        peers.exchange(inner.bit_length() + 1, sends=[(me + inner, flat, "result")])
