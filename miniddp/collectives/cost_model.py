"""What each algorithm costs: steps and bytes, the alpha-beta model, and the choice by size.

Chapter 01 (tutorials/01_collectives.py) uses this file last: section 4 checks `schedule` against
the messages it counts, section 6 fits `CostModel` on the running machine, predicts each
all-reduce, and sets `auto`'s picks (`choose_all_reduce_algorithm`) beside measured times.

Every algorithm side by side, for a tensor of n bytes on W ranks (L = ceil(log2 W)); the files
that build them derive each line:

    algorithm                      steps      bytes a rank sends (at most)
    broadcast  naive               W-1        (W-1) n   the root sends to everyone in turn
    broadcast  tree                L          L n       whoever has it sends: 1, 2, 4, ... ranks
    reduce     naive               W-1        n         the root receives (W-1) n in turn
    reduce     tree                L          n         the broadcast tree, run backwards
    all_reduce reduce_broadcast    2L         L n       tree reduce to rank 0, tree broadcast
    all_reduce recursive_doubling  L (+2)     L n (+n)  swap and combine with rank r XOR 2^k
    reduce_scatter ring            W-1        (W-1)/W n
    all_gather     ring            W-1        (W-1)/W n
    all_reduce ring                2(W-1)     2(W-1)/W n   reduce_scatter, then all_gather
    all_to_all pairwise            W-1        (W-1)/W n    each piece straight to its rank

(+2: two more steps, and one more n, when W is not a power of two. For the all-to-all, n is
the input's bytes cut into W even pieces; with uneven pieces the slowest rank is the one that
sends or receives the most, and `all_to_all_time` prices it from the sizes themselves.) Few
steps win when each message's fixed cost dominates (small tensors), few bytes when bandwidth
does (large ones); `CostModel` puts a time on both from two numbers fitted on the running machine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from miniddp.collectives import tree
from miniddp.collectives.comm_thread import submit
from miniddp.collectives.peers import Peers
from miniddp.collectives.tree import tree_steps

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True)
class CostModel:
    """The alpha-beta model: a message of n bytes takes alpha + n * beta seconds.

    alpha is the latency every message pays (software, system calls, waking threads), beta the
    inverse bandwidth. An algorithm of S steps whose steps carry B bytes in all (on the slowest
    rank) takes about S * alpha + B * beta. The model leaves out the time spent adding numbers
    and any contention between the messages of one step: on a few shared cores, both matter.
    """

    alpha: float  # seconds per message
    beta: float  # seconds per byte

    def predict(self, collective: str, algorithm: str, nbytes: int, world_size: int) -> float:
        steps, step_bytes = schedule(collective, algorithm, nbytes, world_size)
        return steps * self.alpha + step_bytes * self.beta


def all_to_all_time(model: CostModel, row_bytes: int, counts: torch.Tensor) -> float:
    """The alpha-beta time of one pairwise all-to-all with uneven pieces: `counts[s, d]` rows of
    `row_bytes` go from rank s to rank d. At each of the W-1 steps every rank sends one piece
    and receives one, and the step lasts as long as its largest piece (all travel at once); the
    empty pieces of a step that carries nothing still cost nothing."""
    w = counts.shape[0]
    total = 0.0
    for step in range(1, w):
        pieces = [int(counts[s, (s + step) % w]) for s in range(w)]
        if max(pieces):
            total += model.alpha + max(pieces) * row_bytes * model.beta
    return total


def schedule(collective: str, algorithm: str, nbytes: int, world_size: int) -> tuple[int, int]:
    """(steps, bytes carried by the steps in all) of an algorithm on `world_size` ranks."""
    w, depth = world_size, tree_steps(world_size)
    inner_steps = w.bit_length() - 1  # log2 of the largest power of two <= W
    doubling = inner_steps + (2 if w > 1 << inner_steps else 0)
    chunk = math.ceil(nbytes / w)  # the ring's messages: the largest of W nearly equal chunks
    shapes = {
        ("broadcast", "naive"): (w - 1, (w - 1) * nbytes),
        ("broadcast", "tree"): (depth, depth * nbytes),
        ("reduce", "naive"): (w - 1, (w - 1) * nbytes),
        ("reduce", "tree"): (depth, depth * nbytes),
        ("all_reduce", "reduce_broadcast"): (2 * depth, 2 * depth * nbytes),
        ("all_reduce", "recursive_doubling"): (doubling, doubling * nbytes),
        ("all_reduce", "ring"): (2 * (w - 1), 2 * (w - 1) * chunk),
        ("reduce_scatter", "ring"): (w - 1, (w - 1) * chunk),
        ("all_gather", "ring"): (w - 1, (w - 1) * chunk),
        ("all_to_all", "pairwise"): (w - 1, (w - 1) * chunk),
    }
    if algorithm == "auto":
        algorithm = choose_all_reduce_algorithm(nbytes, world_size)
    if (collective, algorithm) not in shapes:
        raise ValueError(f"no algorithm {algorithm!r} for {collective}")
    return shapes[(collective, algorithm)]


def fit_cost_model(
    group: ProcessGroup | None = None,
    sizes: Sequence[int] = (8, 4 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB),
    repeats: int = 30,
) -> CostModel:
    """Measure alpha and beta on this machine: every rank must call it, with no async collective
    of ours in flight.

    Group ranks 0 and 1 ping-pong a float32 tensor of each size (multiples of 4 bytes) `repeats`
    times, through the same sends and receives the algorithms use, going round the sizes so that
    a busy moment slows one round rather than one size. One way is half the quickest round trip:
    the model describes the machine, not whoever else was using it at the time. alpha is the
    smallest message's time; beta is the least-squares slope of the others' times above alpha,
    so the large sizes, where bandwidth shows, decide it. Rank 0 sends the result to all. With
    one rank there is nothing to measure: alpha = beta = 0.
    """
    peers = Peers(group, "fit_cost_model")
    fitted = torch.zeros(2, dtype=torch.float64)

    def measure() -> None:
        if peers.size < 2:
            return
        buffers = [torch.zeros(nbytes // 4) for nbytes in sizes]
        one_way = [math.inf] * len(sizes)
        for attempt in range(repeats + 1):  # the first round warms up, uncounted
            for index, buffer in enumerate(buffers):
                seconds = _ping_pong(peers, buffer)
                if attempt:
                    one_way[index] = min(one_way[index], seconds)
        if peers.rank == 0:
            alpha = one_way[0]
            n = torch.tensor(sizes[1:], dtype=torch.float64)
            above_alpha = torch.tensor(one_way[1:], dtype=torch.float64) - alpha
            beta = (n * above_alpha).sum() / (n * n).sum()
            fitted.copy_(torch.tensor([alpha, beta.item()]))
        tree.broadcast(peers, fitted, 0)

    submit(measure, [fitted], async_op=False)
    return CostModel(alpha=fitted[0].item(), beta=fitted[1].item())


def _ping_pong(peers: Peers, buffer: torch.Tensor) -> float:
    """Half a round trip of `buffer` between group ranks 0 and 1, as rank 0 times it."""
    start = time.perf_counter()
    if peers.rank == 0:
        peers.exchange(1, sends=[(1, buffer, "ping")])
        peers.exchange(2, receives=[(1, buffer)])
    elif peers.rank == 1:
        peers.exchange(1, receives=[(0, buffer)])
        peers.exchange(2, sends=[(0, buffer, "pong")])
    return (time.perf_counter() - start) / 2


# What `all_reduce(algorithm="auto")` runs, by world size: (from this many bytes on, algorithm).
# Measured with `python -m miniddp.bench collectives` under torchrun with W ranks (gloo over
# loopback TCP) on the shared 2-core machine MiniDDP was written on, where a "link" is memory
# copies by the same two cores and every message costs ~100 us of thread wake-ups. There, fewer
# messages won up to tens of MiB: with 2 ranks the ring's 4 half-size messages lost to the tree's
# 2 whole ones below 64 MiB, and recursive doubling's single swap won below 128 KiB; with 3 or 4
# ranks on 2 cores, steps that need every rank running at once are slow, which favours the tree
# until the bytes dominate. Between neighbouring entries the two algorithms were within the
# run-to-run noise (about 10%). World sizes not listed use the largest one listed: measure yours.
AUTO_CHOICES = {
    2: ((0, "recursive_doubling"), (128 * KiB, "reduce_broadcast"), (64 * MiB, "ring")),
    3: ((0, "reduce_broadcast"), (16 * MiB, "ring")),
    4: ((0, "reduce_broadcast"), (16 * MiB, "ring")),
}


def choose_all_reduce_algorithm(nbytes: int, world_size: int) -> str:
    """What `all_reduce(algorithm="auto")` runs for a tensor of `nbytes` on `world_size` ranks:
    the last entry of AUTO_CHOICES[world_size] whose size `nbytes` reaches."""
    choices = AUTO_CHOICES.get(world_size, AUTO_CHOICES[max(AUTO_CHOICES)])
    return [algorithm for from_bytes, algorithm in choices if nbytes >= from_bytes][-1]
