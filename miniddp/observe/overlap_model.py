"""The alpha-beta model of one DDP step (and, at the end, of one ZeRO-3 step): how long it
takes, and how much communication hides.

Backward produces the gradients at an even pace, `total` bytes in `backward` seconds, so a
bucket is full once backward has produced every byte up to its end:

    ready_i = backward * (b_0 + ... + b_i) / total

Buckets go one at a time (a link carries one transfer at a time), each taking alpha + beta b_i:

    start_i = max(ready_i, end_{i-1})         end_i = start_i + alpha + beta * b_i

The step's backward-and-sync part ends at max(backward, end_last). Its communication is the
union of the spans [ready_i, end_i] (launch to arrival, queueing included), as
`miniddp.observe.timeline.summarize` measures it; the part before `backward` is hidden.

Two ways to lose. Small buckets: many alphas, and the queue falls behind backward. Big buckets:
the first one waits for most of backward before it can leave, and the last one is all exposed.
Chapter 04 measures a sweep of bucket sizes against this model.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from miniddp.observe.timeline import union_of_intervals


@dataclass(frozen=True)
class PredictedStep:
    """Seconds from backward's start; `overlap` is the hidden fraction of communication."""

    sync_s: float  # backward start -> the last bucket has arrived (or backward ends)
    comm_s: float  # time with at least one bucket in flight
    overlapped_s: float  # of which during backward

    @property
    def overlap(self) -> float:
        return self.overlapped_s / self.comm_s if self.comm_s > 0 else 0.0

    @property
    def exposed_s(self) -> float:
        return self.comm_s - self.overlapped_s


def predict_step(
    bucket_bytes: Sequence[int], backward_s: float, alpha: float, beta: float
) -> PredictedStep:
    """The model's step for buckets of `bucket_bytes` (in launch order)."""
    total = sum(bucket_bytes)
    spans: list[tuple[float, float]] = []
    end = 0.0
    for size, filled in zip(bucket_bytes, itertools.accumulate(bucket_bytes)):
        ready = backward_s * filled / total
        end = max(ready, end) + alpha + beta * size
        spans.append((ready, end))
    comm = union_of_intervals(spans)
    comm_s = sum(stop - start for start, stop in comm)
    overlapped = sum(max(0.0, min(stop, backward_s) - start) for start, stop in comm)
    return PredictedStep(max(backward_s, end), comm_s, overlapped)


def uniform_buckets(total: int, bucket: float) -> list[int]:
    """`total` bytes cut into buckets of about `bucket` bytes (the model's continuous sweep)."""
    count = max(1, round(total / bucket))
    edges = [round(total * i / count) for i in range(count + 1)]
    return [b - a for a, b in itertools.pairwise(edges)]


@dataclass(frozen=True)
class PredictedZero3Step:
    """Seconds of one ZeRO-3 step (fully_shard, miniddp/sharding/prefetch.py) on the link."""

    step_s: float
    compute_s: float
    comm_s: float  # the all-gathers and reduce-scatters, one after another on the link
    host_s: float = 0.0  # the host's own time per collective, all of them (overhead_s below)

    @property
    def beyond_compute_s(self) -> float:
        """All of the step that is not compute: the exposed transfers and the host's time."""
        return self.step_s - self.compute_s

    @property
    def exposed_s(self) -> float:
        """The all-gathers' and reduce-scatters' time that no compute hides."""
        return self.beyond_compute_s - self.host_s

    @property
    def overlap(self) -> float:
        return max(0.0, 1 - self.exposed_s / self.comm_s) if self.comm_s > 0 else 0.0


def predict_zero3_step(
    units: int,
    forward_s: float,
    backward_s: float,
    gather_s: float,
    reduce_s: float,
    prefetch: bool = True,
    overhead_s: float = 0.0,
) -> PredictedZero3Step:
    """A chain of `units` alike, each computing `forward_s` and `backward_s`, each gather taking
    `gather_s` on the link and each reduce-scatter `reduce_s`. Without prefetch every transfer is
    exposed:

        U (c_f + c_b) + U (2 AG + RS)

    With it, unit i+1's gather travels while unit i computes; in backward, with the reduce-scatter
    of unit i-1 (one link: the two queue). Exposed: the first gather of each pass, the last
    reduce-scatter, and whatever a transfer outlasts the compute beside it:

        forward   AG + (U-1) max(c_f, AG) + c_f
        backward  AG + (U-1) max(c_b, AG + RS) + c_b + RS

    `overhead_s` is LogP's o (Culler et al., 1993): the host's time per collective, which no
    overlap hides because the host spends it (issuing it, casting and copying around it, the
    threads that hand it on waking up). Alpha-beta leaves it out; each of the 3U collectives
    adds it to the step, with prefetch or without. A bench measures it where nothing else runs
    beside it, on the step without prefetch, and the model then predicts the one with it.
    """
    compute = units * (forward_s + backward_s)
    comm = units * (2 * gather_s + reduce_s)
    host = 3 * units * overhead_s
    if not prefetch:
        return PredictedZero3Step(compute + comm + host, compute, comm, host)
    forward = gather_s + (units - 1) * max(forward_s, gather_s) + forward_s
    backward = gather_s + (units - 1) * max(backward_s, gather_s + reduce_s) + backward_s
    return PredictedZero3Step(forward + backward + reduce_s + host, compute, comm, host)
