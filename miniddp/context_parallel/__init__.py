"""Context parallelism: the sequence split across the ranks of a group, on MiniDDP's send/recv.

The vocabulary (Liu et al. 2023, "Ring Attention"; torch's context_parallel):
    context-parallel group   the W ranks that share one sequence, each holding S/W positions
                             of every activation (W = the group's size)
    layout                   which positions a rank holds: plain chunks, or head-tail pairs
                             that balance causal work (load_balance=True)
    block                    one query chunk against one key chunk: the unit of work and of
                             the causal skip

Everything but attention acts on each position alone (LayerNorm, the MLP, the residuals), so it
runs on the S/W local positions unchanged; only attention needs every key. Three files, in
reading order:

    sequence.py         the layouts; shard_sequence, unshard_sequence
    attention.py        ring_attention: K/V round the ring, the log-sum-exp merge, the backward
                        by the same ring; the blocks each rank computes (count_blocks)
    model.py            a whole model on the ring: sdpa_on_the_ring routes its attention
                        calls, positions_of gives its position embedding global positions;
                        ContextParallel does both around a training step (parallelize's)

    q, k, v = (shard_sequence(t, dim=2, load_balance=True) for t in (Q, K, V))
    out = ring_attention(q, k, v, is_causal=True, load_balance=True)
    # == shard_sequence(F.scaled_dot_product_attention(Q, K, V, is_causal=True), 2, ...)
"""

from miniddp.context_parallel.attention import (
    Block,
    RingStats,
    count_blocks,
    ring_attention,
    ring_bytes,
    ring_seconds,
    stats_for,
    step_blocks,
)
from miniddp.context_parallel.model import ContextParallel, positions_of, sdpa_on_the_ring
from miniddp.context_parallel.sequence import chunks_of, shard_sequence, unshard_sequence

__all__ = [
    "Block",
    "ContextParallel",
    "RingStats",
    "chunks_of",
    "count_blocks",
    "positions_of",
    "ring_attention",
    "ring_bytes",
    "ring_seconds",
    "sdpa_on_the_ring",
    "shard_sequence",
    "stats_for",
    "step_blocks",
    "unshard_sequence",
]
