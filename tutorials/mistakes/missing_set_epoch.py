"""Mistake: a DistributedSampler without `set_epoch(epoch)` at the start of each epoch.

Symptom: every epoch visits the same samples in the same order, on every rank: shuffle=True
shuffles once. Nothing fails and nothing diverges; the model just sees a fixed sequence, which
costs some generalization and makes loss curves suspiciously periodic. The property checks
cannot see it (they run one epoch's steps); the check that catches it is the sampler's own
order: a new permutation each epoch.

Why: every rank must draw the same permutation, or their shards would overlap. So the sampler
seeds its shuffle with `seed + epoch`, the same everywhere, and cannot know the epoch unless
told.

How torch avoids it: it doesn't; `torch.utils.data.DistributedSampler` documents that you must
call `set_epoch` before each epoch's iterator, and miniddp.data_parallel.sampler does the same.

The one change is in the loop below: `sampler.set_epoch(epoch)` is missing.
"""

from __future__ import annotations

from torch.utils.data import DistributedSampler


def indices_per_epoch(sampler: DistributedSampler, epochs: int) -> list[list[int]]:
    """The sample indices this rank's loader visits, epoch by epoch."""
    orders = []
    for _epoch in range(epochs):
        # The mistake: no sampler.set_epoch(_epoch) here.
        orders.append(list(sampler))
    return orders
