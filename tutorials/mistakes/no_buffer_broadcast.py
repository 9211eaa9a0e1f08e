"""Mistake: BatchNorm's buffers never broadcast from rank 0 before a forward.

Symptom: the running statistics (running_mean, running_var) differ from rank to rank after the
first step, each rank's the average of its own shards only; evaluation then depends on which
rank you ask, and a checkpoint saved on rank 0 holds rank 0's statistics. The exact condition
under which training is unaffected: every forward that is backpropagated runs in train mode,
where BatchNorm normalizes with the batch's statistics and the running ones only get updated.
Then gradients and weights are torch DDP's, bit for bit. They are not one process's on the
global batch, with or without the broadcast: each rank normalizes with its own shard's mean
and variance, not the global batch's (that is what SyncBatchNorm is for), so they equal one
process that normalizes each rank's shard separately. A forward in eval mode that is trained
through, or evaluation between steps that feeds back into training, uses the running
statistics and then differs from rank to rank. The property checks catch it against torch's
DDP: a buffer differs ("does yours broadcast them?").

Why: buffers are not parameters: no gradient, no hook, no all-reduce. Each rank's forward
updates its own copy from its own batch.

How torch avoids it: `broadcast_buffers=True` (the default) overwrites every buffer with rank
0's before each forward that follows a synced one, so all ranks carry rank 0's statistics
(updated by each rank's own batch during that forward). Not averaged: rank 0's. SyncBatchNorm
is the other fix, which computes the batch statistics over all ranks.

This is rung 1 (NaiveDDP) with its forward minus the broadcast.
"""

from __future__ import annotations

from typing import Any

from miniddp.steps import NaiveDDP


class NoBufferBroadcast(NaiveDDP):
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)  # the mistake: no broadcast of rank 0's buffers
