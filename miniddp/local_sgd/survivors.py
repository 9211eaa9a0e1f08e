"""When a replica dies between two syncs: the others agree on who is left, and average among
themselves, without a restart.

DiLoCo's replicas meet only at syncs, so a replica that dies (killed, crashed) is noticed at the
next one: its all-reduce cannot finish. `miniddp.faults.wait_for` turns gloo's "Connection
closed by peer" into a `CollectiveFailed` that names the missing ranks (each survivor hears,
through the store, from every rank that is still there). Then:

1. Agree on who is present. A rank that is merely slow (still computing, or evaluating) must
   not be taken for dead, so every replica keeps a heartbeat in the store: a thread adds 1 to
   its counter every BEAT_S seconds. At the failed sync each survivor writes that it arrived,
   then waits until every other rank has either arrived too or let its heartbeat stand still
   for DEAD_AFTER_S. The first proposal written to the store wins (`compare_set`: one atomic
   write) and every survivor reads that one, so all average over the same set even if their
   views differed. torchft calls this set the quorum, and its lighthouse keeps the heartbeats.
2. Average among them. The process group cannot serve any more: its all-reduce would wait for
   the dead rank, and its half-finished collectives, timing out later, close the connections
   they used (gloo: "Application timeout caused pair closure"), even between live ranks. So
   the survivors make a group of their own (`dist.new_group` with local synchronization: only
   its members take part), finish the failed sync on it with the course's ring all-reduce
   (send/recv, miniddp/collectives/ring.py), and run every later sync on it.

The sync that failed is redone from its pseudo-gradients (kept until the average arrives: a
failed all-reduce leaves its buffers half summed). The survivors thus hold the same bits as a
run whose replicas were only the survivors from that sync on (at two survivors exactly gloo's:
a + b = b + a; at more, the failed sync's ring adds in another order than gloo would).
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from miniddp.job.faults import CollectiveFailed
from miniddp.job.notes import board_of
from miniddp.placement import group_ranks

BEAT_S = 0.5  # how often a replica's heartbeat counter moves
DEAD_AFTER_S = 5.0  # a counter standing still this long: the replica is dead
POLL_S = 0.1


def _key(*parts: object) -> str:
    """Keys in the job's own store (the default group's, which outlives any group made later),
    by global rank."""
    return board_of(None).key("diloco", *parts)


class Heartbeat:
    """A daemon thread that adds 1 to this rank's counter in the job's store every BEAT_S."""

    def __init__(self) -> None:
        self._store, self._key = board_of(None).store, _key("beat", dist.get_rank())
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="diloco-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stopped.wait(BEAT_S):
            try:
                self._store.add(self._key, 1)
            except Exception:  # the store went away: the job is ending
                return

    def stop(self) -> None:
        self._stopped.set()


def agree_on_survivors(group, sync: int, failure: CollectiveFailed) -> list[int]:
    """The global ranks that go on, the same list on every survivor, agreed through the store."""
    if not failure.missing_ranks:
        raise failure  # every rank reported in: not a death this can survive
    store, me, everyone = board_of(None).store, dist.get_rank(), group_ranks(group)
    name = ",".join(map(str, everyone))  # which group's sync: a mesh has several
    store.set(_key(name, sync, "arrived", me), "1")
    present, dead = {me}, set()
    last_beat: dict[int, tuple[int, float]] = {}
    while len(present) + len(dead) < len(everyone):
        for rank in set(everyone) - present - dead:
            if store.check([_key(name, sync, "arrived", rank)]):
                present.add(rank)
                continue
            beats, now = store.add(_key("beat", rank), 0), time.monotonic()
            if rank not in last_beat or last_beat[rank][0] != beats:
                last_beat[rank] = (beats, now)
            elif now - last_beat[rank][1] > DEAD_AFTER_S:
                dead.add(rank)
        time.sleep(POLL_S)
    proposal = ",".join(str(r) for r in sorted(present))
    agreed = store.compare_set(_key(name, sync, "survivors"), "", proposal).decode()
    survivors = [int(r) for r in agreed.split(",")]
    if me not in survivors:
        raise RuntimeError(
            f"the other replicas agreed to go on without this rank (ranks {survivors}) at sync "
            f"{sync}: its heartbeat stood still for {DEAD_AFTER_S:g} s. Restart it from their "
            "next checkpoint."
        ) from failure
    return survivors


def group_of(survivors: list[int]) -> dist.ProcessGroup:
    """A new process group of the survivors alone: only they take part in making it."""
    return dist.new_group(survivors, use_local_synchronization=True)
