"""Mistake: BatchNorm's buffers never broadcast from rank 0 before a forward.

Symptom: the running statistics (running_mean, running_var) differ from rank to rank after the
first step, each rank's the average of its own shards only; evaluation then depends on which
rank you ask, and a checkpoint saved on rank 0 holds rank 0's statistics. Training itself is
unaffected: in train mode BatchNorm normalizes with the batch's statistics, so gradients and
weights still match one process. The property checks catch it against torch's DDP: a buffer
differs ("does yours broadcast them?").

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
