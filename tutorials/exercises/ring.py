"""Exercise 1 (chapter 01): the ring all-reduce, from sends and receives.

Fill in the TODO, then check your function with the same tests miniddp's own ring passes:

    python -m pytest tests/test_collectives.py -x --ring tutorials/exercises/ring.py:all_reduce

They run it on 2, 3 and 4 gloo ranks with random inputs (empty, shorter than W, float32,
float64, bfloat16, int64; SUM, AVG, PRODUCT, MAX, MIN and the bitwise ops) and check that every
rank ends with the same bits, within rounding of torch.distributed's all_reduce (bit for bit at
W = 2), and that you kept the ring's promise: every message goes to the right neighbour and
carries one of W chunks, and each rank sends 2(W-1)/W·n bytes, the least any all-reduce can.
A reduce followed by a broadcast gets the numbers right and fails there, naming the idea.

Stuck? Chapter 01 (tutorials/01_collectives.py), section 3, runs the ring step by step and
prints every message. Only once your own attempt passes, compare it with
miniddp/collectives/ring.py.
"""

from __future__ import annotations

import torch
from torch.distributed import ReduceOp

from miniddp.collectives.peers import COMBINE, Peers, finish_average, wait_all


def all_reduce(peers: Peers, flat: torch.Tensor, op: ReduceOp.RedOpType) -> None:
    """Reduce `flat` (1-D, contiguous, the same length on every rank) with `op` over the
    `peers.size` ranks, in place: afterwards every rank holds the same result.

    What you have: `peers.rank` and `peers.size` (ranks 0..W-1); `peers.send(step, dst,
    tensor, what)` and `peers.receive(src, tensor)` post a message and return at once (a Work,
    or None for an empty tensor); `wait_all(*works)` waits for them; `COMBINE[op](a, b, out=a)`
    folds b into a; `finish_average(tensor, op, W)` is AVG's one division.

    TODO. What must hold, and why (chapter 01, section 3): cut the tensor into W chunks
    (`tensor_split` allows n < W); at every step every rank sends one chunk to its right
    neighbour and receives one from its left, so every link is busy at once. After W-1 steps of
    folding (reduce-scatter) each chunk is complete on one rank; W-1 more steps of passing
    (all-gather) bring every complete chunk to every rank. Each rank then sent 2(W-1) chunks of
    n/W: 2(W-1)/W·n bytes, under 2n however many ranks.

    Two traps. gloo sends only into a receive the other side has posted: a rank that waits for
    its send before posting its receive waits forever, since its neighbour does the same. And a
    buffer you receive into must not be one you are still sending from or folding into.
    """
    raise NotImplementedError(
        "TODO exercise 1 (tutorials/exercises/ring.py, chapter 01): write the ring all-reduce "
        "(reduce-scatter, then all-gather, one chunk to the right neighbour per step)"
    )


__all__ = ["COMBINE", "Peers", "ReduceOp", "all_reduce", "finish_average", "wait_all"]
