"""Uneven inputs: when ranks run out of batches at different times (torch's Join protocol).

Every collective needs every rank. A rank that finished its last batch stops issuing all-reduces,
and the ranks still training wait for it forever (MiniDDP names it, after the process group's
timeout: chapter 11). `torch.distributed.algorithms.join.Join([model])`, or `model.join()`,
keeps the finished ("joined") rank answering instead. Each iteration of a rank still training
starts with one all-reduce of a 1 (torch's Join issues it through `notify_join_context`); a
joined rank, waiting in `Join.__exit__`, adds a 0 to it and so learns how many ranks still train.
While that count is not 0, the joined rank runs `main_hook`, which shadows, collective for
collective, what a training rank's forward and backward issue (MiniDDP.forward, in ddp.py,
issues the first column; its `join_hook()` returns the object below, as torch's DDP returns
its `_DDPJoinHook`):

    training rank (MiniDDP.forward/backward)      joined rank (ShadowsTraining.main_hook)
    all-reduce of 1 if this backward syncs         all-reduce of 0: does anyone sync?
    broadcast of rank 0's ready order, once        the same broadcast (its own order if it had
                                                   none: registration order, as torch's)
    max over ranks still training: who owns        max with -1: it does not own buffers any more
    the buffers; broadcast them from it
    (static_graph, first synced backward only)     its usage: nothing
    the usage map, learnt before any bucket goes
    one all-reduce per bucket, in bucket order     an all-reduce of zeros per bucket
    (find_unused_parameters) the usage map         its own usage map

Adding zeros changes no bit, so the sum is the sum over the ranks that still train. The divisor
stays the initial world size W (`divide_by_initial_world_size=True`, torch's default: a joined
rank counts as a rank with zero gradient); with False it is the number of ranks still training,
read from that first all-reduce. Buffers come from the highest rank still training, since rank 0
may have joined with stale BatchNorm statistics. When every rank has joined, `post_hook` copies
the whole model from the last rank to join (the highest, if several), so replicas end equal.
With `Join(..., throw_on_early_termination=True)` every rank raises as soon as one runs out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from miniddp.buckets import Bucket
from miniddp.same_model import broadcast_from_rank0

if TYPE_CHECKING:
    from miniddp.ddp import MiniDDP


class ShadowsTraining(JoinHook):
    """What a joined rank does for each iteration the others still train, and at the end."""

    def __init__(self, ddp: MiniDDP) -> None:
        self.ddp = ddp

    def main_hook(self) -> None:
        ddp = self.ddp
        should_sync = ddp._any_rank_syncs(False)
        if ddp._layout.rebuild_due:
            ddp._rebuild_buckets()
        ddp._sync_buffers(training=False)
        ddp._require_forward_param_sync = should_sync
        if not should_sync:
            return
        # static_graph's first synced backward asks which parameters any rank used before its
        # buckets go; a rank that joined before its own first one answers "none" (and learns).
        first_static = ddp._static_graph_first_backward_ends()
        # Fresh zero buckets, so that this rank's own gradients (which may live in the real
        # buckets, with gradient_as_bucket_view) stay as they are.
        shadows = [Bucket(b.index, b.param_indices, ddp.params) for b in ddp._layout.buckets]
        for shadow in shadows:
            shadow.launch(ddp._all_reduce)
        for shadow in shadows:
            shadow.wait(ddp._wait)
        if ddp.find_unused_parameters:
            self._shadow_usage()
        # Joined before observing any order: it offers registration order to the coming rebuild
        # (as torch's does); rank 0's order is the one every rank adopts. Under static_graph the
        # others record theirs in the backward after the counting one, so it waits as long.
        layout = ddp._layout
        if not layout.has_rebuilt and not layout.ready_order and not first_static:
            layout.ready_order = list(range(len(ddp.params)))

    def _shadow_usage(self) -> None:
        """A joined rank's part in the usage all-reduce (find_unused_parameters). torch's joined
        rank re-sends the map its last synced backward received, so a parameter used on any
        rank then counts as used as long as others train (its `.grad` becomes zeros, not None,
        which momentum or weight decay would then apply to): the same here, for torch's bits."""
        ddp = self.ddp
        last = ddp._usage.last_on_any_rank
        if last is None:  # joined before any synced backward: it used nothing
            ddp._usage.on_any_rank(ddp.join_device, ddp.process_group, ddp._wait)
            return
        work = dist.all_reduce(last, group=ddp.process_group, async_op=True)
        ddp._wait(work, "all-reduce of parameter usage")
        last.clamp_(max=1)  # torch's sums grow each time; only "not zero" is ever read

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank copies the model of the last rank to join: replicas end identical."""
        ddp = self.ddp
        source = ddp._highest_rank_where(is_last_joiner)
        state = [*ddp.module.parameters(), *(ddp._buffers_to_sync if ddp.broadcast_buffers else [])]
        broadcast_from_rank0(state, "the final model (Join)", ddp.process_group, ddp._wait, source)
