"""Uneven inputs: what a rank out of batches does while the others still train (torch's Join).

MiniDDP is the `Joinable`; `ShadowsTraining` is the hook its `join_hook()` returns. The two small
collectives below are Join's own: MiniDDP's forward issues them too, on a rank still training.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from miniddp.job.faults import wait_for


class Joined(Protocol):
    """What the hook needs of the model it shadows (MiniDDP): the narrow interface."""

    join_device: torch.device
    process_group: dist.ProcessGroup | None

    def joined_forward(self, any_rank_syncs: bool) -> None: ...

    def joined_backward(self) -> None: ...

    def copy_model_from(self, source: int) -> None: ...


def any_rank_syncs(this_rank_syncs: bool, device: torch.device, group: Any) -> bool:
    """Join's second all-reduce per iteration: a joined rank shadows the backward's
    collectives only if some rank still training syncs this iteration."""
    flag = torch.tensor([int(this_rank_syncs)], device=device)
    work = dist.all_reduce(flag, group=group, async_op=True)
    wait_for(work, "all-reduce of whether any rank syncs its gradients (Join)", group)
    return bool(flag.item())


def highest_rank_where(condition: bool, device: torch.device, group: Any) -> int:
    """The highest rank in the group for which `condition` holds (on at least one rank)."""
    rank = dist.get_rank(group) if condition else -1
    highest = torch.tensor([rank], device=device)
    work = dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group, async_op=True)
    wait_for(work, "all-reduce choosing the rank to copy from (Join)", group)
    return int(highest.item())


class ShadowsTraining(JoinHook):
    """What a joined rank does for each iteration the others still train, and at the end.

    Uneven inputs: ranks run out of batches at different times (torch's Join protocol). Every
    collective needs every rank: a rank past its last batch stops issuing all-reduces, and the
    ranks still training wait for it (MiniDDP names it, after the process group's timeout:
    chapter 10). `Join([model])`, or `model.join()`, keeps the finished ("joined") rank
    answering instead. Each iteration of a rank still training starts with one all-reduce of a
    1 (`notify_join_context`); a joined rank, waiting in `Join.__exit__`, adds a 0 to it and so
    learns how many ranks still train. While that count is not 0, it runs `main_hook`, which
    shadows, collective for collective, what a training rank's forward and backward issue:

        training rank (MiniDDP.forward/backward)     joined rank (main_hook)
        all-reduce of 1 if this backward syncs        all-reduce of 0: does anyone sync?
        broadcast of rank 0's ready order, once       the same broadcast (its own order if it
                                                      had none: registration order, as torch's)
        max over ranks still training: who owns       max with -1: it owns no buffers any more
        the buffers; broadcast them from it
        (static_graph, first synced backward only)    its usage: nothing
        the usage map, learnt before any bucket goes
        one all-reduce per bucket, in bucket order    an all-reduce of zeros per bucket
        (find_unused_parameters) the usage map        its own usage map

    Adding zeros changes no bit, so the sum is the sum over the ranks that still train. The
    divisor stays the initial world size W (`divide_by_initial_world_size=True`, torch's
    default: a joined rank counts as one with zero gradient); with False it is the number of
    ranks still training, read from that first all-reduce. Buffers come from the highest rank
    still training, since rank 0 may have joined with stale BatchNorm statistics. When every
    rank has joined, `post_hook` copies the whole model from the last rank to join (the
    highest, if several), so the replicas end equal. With `throw_on_early_termination=True`
    every rank raises as soon as one runs out.

    It talks to MiniDDP through three documented methods, `joined_forward`, `joined_backward`
    and `copy_model_from`: MiniDDP's own steps (the buckets, the buffers, the usage map) for a
    rank with no batch, as torch's `_DDPJoinHook` calls its DDP's.
    """

    def __init__(self, ddp: Joined) -> None:
        self.ddp = ddp

    def main_hook(self) -> None:
        ddp = self.ddp
        should_sync = any_rank_syncs(False, ddp.join_device, ddp.process_group)
        ddp.joined_forward(should_sync)
        if should_sync:
            ddp.joined_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank copies the model of the last rank to join: replicas end identical."""
        ddp = self.ddp
        ddp.copy_model_from(highest_rank_where(is_last_joiner, ddp.join_device, ddp.process_group))
