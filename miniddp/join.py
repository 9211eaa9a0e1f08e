"""Uneven inputs: when ranks run out of batches at different times (torch's Join protocol).

Every collective needs every rank. A rank that finished its last batch stops issuing all-reduces,
and the ranks still training wait for it forever (MiniDDP names it, after the process group's
timeout: chapter 11). `torch.distributed.algorithms.join.Join([model])`, or `model.join()`,
keeps the finished ("joined") rank answering instead. Each iteration of a rank still training
starts with one all-reduce of a 1 (torch's Join issues it through `notify_join_context`); a
joined rank, waiting in `Join.__exit__`, adds a 0 to it and so learns how many ranks still train.
While that count is not 0, the joined rank runs `main_hook`, which shadows, collective for
collective, what a training rank's forward and backward issue:

    training rank (MiniDDP.forward/backward)      joined rank (ShadowsTraining.main_hook)
    all-reduce of 1 if this backward syncs         all-reduce of 0: does anyone sync?
    broadcast of rank 0's ready order, once        the same broadcast (its own order if it had
                                                   none: registration order, as torch's)
    max over ranks still training: who owns        max with -1: it does not own buffers any more
    the buffers; broadcast them from it
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

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig

from miniddp.buckets import Bucket
from miniddp.model_checks import broadcast_from_rank0


class JoinsUnevenInputs(Joinable):
    """What MiniDDP needs to be `Joinable`: the hook, the device and group Join talks through,
    and the collectives a training rank adds to each forward while a Join is active."""

    # Join sets this on each joinable it manages; until then, outside any Join, it is disabled.
    _join_config = _JoinConfig.construct_disabled_join_config()
    _divide_by_initial_world_size = True

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """`with model.join(): for batch in my_batches: ...` trains on uneven inputs, as torch's
        `DistributedDataParallel.join` does (the arguments are Join's: see this file's top)."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)  # fmt: skip

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return ShadowsTraining(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.params[0].device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def _tell_join_this_rank_trains(self) -> None:
        """At the start of each forward: count in the ranks still training (and raise on every
        rank if one has joined and `throw_on_early_termination`), choose the divisor, and say
        whether this forward's backward will sync. Outside a Join, nothing."""
        still_training = Join.notify_join_context(self)
        self._refuse_static_graph_under_join()
        if self._comm_hook is None:
            self._divide_by = self.world_size
            if still_training is not None and not self._divide_by_initial_world_size:
                still_training.wait()
                self._divide_by = int(still_training.get_future().value()[0].item())
        if self._join_config.enable:
            self._any_rank_syncs(torch.is_grad_enabled() and self._require_backward_grad_sync)

    def _refuse_static_graph_under_join(self) -> None:
        """static_graph's first backward adds a collective that no joined rank shadows: a clear
        error on every rank (training ones here, joined ones in main_hook), not a hang."""
        if self._join_config.enable and self.static_graph:
            raise NotImplementedError(
                "MiniDDP does not support Join together with static_graph=True. Give every "
                "rank the same number of batches (DistributedSampler with drop_last=True), or "
                "use use_reentrant=False checkpointing without static_graph."
            )

    def _any_rank_syncs(self, this_rank_syncs: bool) -> bool:
        flag = torch.tensor([int(this_rank_syncs)], device=self.join_device)
        work = dist.all_reduce(flag, group=self.process_group, async_op=True)
        self._wait(work, "all-reduce of whether any rank syncs its gradients (Join)")
        return bool(flag.item())

    def _sync_buffers(self, training: bool) -> None:
        """After a synced forward (and with broadcast_buffers), copy every buffer from rank 0, or
        under Join from the highest rank still `training` (a joined rank passes False)."""
        if not (self.broadcast_buffers and self._require_forward_param_sync):
            return
        if not self._buffers_to_sync:
            return
        source = self._highest_rank_where(training) if self._join_config.enable else 0
        broadcast_from_rank0(self._buffers_to_sync, "buffers", self.process_group, self._wait,
                             source)  # fmt: skip

    def _shadow_usage(self) -> None:
        """A joined rank's part in the usage all-reduce (find_unused_parameters). torch's joined
        rank re-sends the map its last synced backward received, so a parameter used on any
        rank then counts as used as long as others train (its `.grad` becomes zeros, not None,
        which momentum or weight decay would then apply to): the same here, for torch's bits."""
        last = self._usage.last_on_any_rank
        if last is None:  # joined before any synced backward: it used nothing
            self._usage.on_any_rank(self.join_device, self.process_group, self._wait)
            return
        work = dist.all_reduce(last, group=self.process_group, async_op=True)
        self._wait(work, "all-reduce of parameter usage")
        last.clamp_(max=1)  # torch's sums grow each time; only "not zero" is ever read

    def _highest_rank_where(self, condition: bool) -> int:
        """The highest rank in the group for which `condition` holds (on at least one rank)."""
        rank = dist.get_rank(self.process_group) if condition else -1
        highest = torch.tensor([rank], device=self.join_device)
        work = dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=self.process_group,
                               async_op=True)  # fmt: skip
        self._wait(work, "all-reduce choosing the rank to copy from (Join)")
        return int(highest.item())


class ShadowsTraining(JoinHook):
    """What a joined rank does for each iteration the others still train, and at the end."""

    def __init__(self, ddp: Any, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp._refuse_static_graph_under_join()
        should_sync = ddp._any_rank_syncs(False)
        if ddp._layout.rebuild_due:
            ddp._rebuild_buckets()
        ddp._sync_buffers(training=False)
        ddp._require_forward_param_sync = should_sync
        if not should_sync:
            return
        # Fresh zero buckets, so that this rank's own gradients (which may live in the real
        # buckets, with gradient_as_bucket_view) stay as they are.
        shadows = [Bucket(b.index, b.param_indices, ddp.params) for b in ddp._layout.buckets]
        for shadow in shadows:
            shadow.launch(ddp._all_reduce)
        for shadow in shadows:
            shadow.wait(ddp._wait)
        if ddp.find_unused_parameters:
            ddp._shadow_usage()
        # Joined before observing any order: it offers registration order to the coming rebuild
        # (as torch's does); rank 0's order is the one every rank adopts.
        layout = ddp._layout
        if not layout.has_rebuilt and not layout.ready_order:
            layout.ready_order = list(range(len(ddp.params)))

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank copies the model of the last rank to join: replicas end identical."""
        ddp = self.ddp
        source = ddp._highest_rank_where(is_last_joiner)
        state = [*ddp.module.parameters(), *(ddp._buffers_to_sync if ddp.broadcast_buffers else [])]
        broadcast_from_rank0(state, "the final model (Join)", ddp.process_group, ddp._wait, source)
