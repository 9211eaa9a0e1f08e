"""When a replica dies between two syncs: the others agree on who is left, and average among
themselves, without a restart.

DiLoCo's replicas meet only at syncs, so a replica that dies (killed, crashed) is noticed at the
next one: its all-reduce cannot finish. `miniddp.faults.wait_for` turns gloo's "Connection
closed by peer" into a `CollectiveFailed` that names the missing ranks (each survivor hears,
through the store, from every rank that is still there). Then:

1. Agree on who is present. Each survivor proposes the ranks it heard from; the first proposal
   written to the store wins (`compare_set`: one atomic write), and every survivor reads that
   one. So all survivors average over the same set, even if their views differed (a survivor
   too slow to report in time is left out, and says so: it cannot catch up alone). torchft
   calls this set the quorum.
2. Average among them with a ring of point-to-point messages (miniddp/collectives/ring.py over
   `Peers.among`): the process group's own all-reduce would wait for the dead rank forever, but
   gloo's send/recv between two live ranks still work when a third is dead.

The sync that failed is redone from its pseudo-gradients (kept until the average arrives: a
failed all-reduce leaves its buffers half summed), and every later sync runs the same ring. The
survivors thus hold the same bits as a run whose replicas were only the survivors from that
sync on (at two survivors exactly gloo's: a + b = b + a).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from miniddp.collectives import ring
from miniddp.collectives.peers import Peers
from miniddp.job.faults import CollectiveFailed
from miniddp.job.notes import board_of
from miniddp.placement import group_ranks

ROSTER_KEY = "diloco-survivors"


def agree_on_survivors(group, sync: int, failure: CollectiveFailed) -> list[int]:
    """The global ranks that go on, the same list on every survivor, agreed through the store."""
    everyone = group_ranks(group)
    missing = {everyone[r] for r in failure.missing_ranks}
    if not missing:
        raise failure  # every rank reported in: not a death this can survive
    board = board_of(group)
    proposal = ",".join(str(r) for r in everyone if r not in missing)
    agreed = board.store.compare_set(board.key(ROSTER_KEY, sync), "", proposal).decode()
    survivors = [int(r) for r in agreed.split(",")]
    if dist.get_rank() not in survivors:
        raise RuntimeError(
            f"the other replicas agreed to go on without this rank (ranks {survivors}) at sync "
            f"{sync}: it reported too late. Restart it from their next checkpoint."
        ) from failure
    return survivors


def ring_sum_among(tensors: Sequence[torch.Tensor], group, survivors: list[int]) -> None:
    """Sum every tensor over the `survivors` (global ranks) in place, with ring all-reduces."""
    peers = Peers.among(group, survivors, "all_reduce/ring among survivors")
    for tensor in tensors:
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        ring.all_reduce(peers, flat, ReduceOp.SUM)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view(tensor.shape))
