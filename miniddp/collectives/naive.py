"""The obvious way: the root talks to every other rank, one after another.

Chapter 01 (tutorials/01_collectives.py) runs these first, in sections 1 and 2, as the baseline
the tree in tree.py improves on.

Broadcast: the root sends its whole tensor of n bytes to rank root+1, then root+2, and so on.
Reduce: the same, backwards: each rank sends its tensor to the root, in turn, and the root folds
each one in as it arrives, ((x_root op x_root+1) op x_root+2) op ...

On W ranks both take W-1 steps, one message each. The root sends (broadcast) or receives
(reduce) (W-1) n bytes, while every other rank moves n bytes once and then sits idle: all the
work queues at one rank. A tree (tree.py) moves the same bytes per receiver in ceil(log2 W)
steps, by letting every rank that already has the data help.
"""

from __future__ import annotations

import torch
from torch.distributed import ReduceOp

from miniddp.collectives.peers import COMBINE, Peers, scratch


def broadcast(peers: Peers, flat: torch.Tensor, root: int) -> None:
    """The root sends the whole tensor to each other rank in turn: W-1 steps."""
    me = peers.relative(root)
    if me == 0:
        for step in range(1, peers.size):
            peers.exchange(step, sends=[(peers.absolute(step, root), flat, "whole tensor")])
    else:
        peers.exchange(me, receives=[(root, flat)])


def reduce(peers: Peers, flat: torch.Tensor, root: int, op: ReduceOp.RedOpType) -> None:
    """Each rank sends its tensor to the root in turn (relative rank order): W-1 steps; the root
    folds them in as they come. Returns once its sends are done (None, like `tree.reduce` at the
    root)."""
    me = peers.relative(root)
    if me == 0:
        incoming = scratch(flat.numel(), flat.dtype, flat.device)
        for step in range(1, peers.size):
            peers.exchange(step, receives=[(peers.absolute(step, root), incoming)])
            COMBINE[op](flat, incoming, out=flat)
    else:
        peers.exchange(me, sends=[(root, flat, "whole tensor")])
