"""The all-to-all: every rank sends a different piece to every other, as a pairwise exchange.

Expert parallelism (miniddp/expert_parallel/) is built on it: each rank holds some of the
experts, and every rank's tokens must reach whichever rank holds the expert they chose (the
dispatch), then come back (the combine). Rank r cuts its input into W pieces along dim 0, piece
d for rank d, and receives W pieces, piece s from rank s, in rank order. The sizes may differ
(a rank may route no token at all to some rank: a piece of zero rows), so both sides are told
them: `input_split_sizes` on the sender, `output_split_sizes` on the receiver, as torch's
`all_to_all_single` takes them.

The pairwise exchange (as in MPI's and gloo's implementations): in W-1 steps, at step s rank r
sends its piece for rank r+s and receives rank r-s's piece for it, mod W. Every rank sends one
message and receives one at every step, and over the W-1 steps meets every other rank once each
way. Its own piece is copied, never sent.

    all_to_all pairwise    W-1 steps;   every rank sends n - (its own piece) bytes,
                           (W-1)/W n when the pieces are even

(n: the input's bytes.) The same bytes as the ring's all-gather, but in the ring a chunk goes
round through every rank; here each piece travels directly to where it belongs. There is no
arithmetic: the result is the same bits as torch's, whatever the order of the steps.
"""

from __future__ import annotations

import torch

from miniddp.collectives.peers import Peers


def pairwise(peers: Peers, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
    """`outputs[s]` becomes group rank s's `inputs[this rank]`. At step s this rank sends to
    r+s and receives from r-s; a piece of zero elements travels as no message (peers.py)."""
    me, size = peers.rank, peers.size
    outputs[me].copy_(inputs[me])
    for step in range(1, size):
        to, source = (me + step) % size, (me - step) % size
        peers.exchange(
            step,
            sends=[(to, inputs[to], f"piece for {to}")],
            receives=[(source, outputs[source])],
        )
