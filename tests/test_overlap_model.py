"""The alpha-beta model of a step (miniddp/observe/overlap_model.py), worked by hand on small
cases."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miniddp.observe.overlap_model import predict_step, predict_zero3_step, uniform_buckets

MS = 1e-3


def test_one_bucket_leaves_after_backward_and_hides_nothing() -> None:
    step = predict_step([1000], backward_s=10 * MS, alpha=1 * MS, beta=2e-6)
    assert step.sync_s == pytest.approx(10 * MS + 1 * MS + 2 * MS)
    assert step.overlap == 0 and step.exposed_s == pytest.approx(3 * MS)


def test_buckets_that_keep_pace_leave_only_the_last_one_exposed() -> None:
    """Four buckets ready at 2.5, 5, 7.5 and 10 ms, each 1 ms on the wire: each is done before
    the next is full, so only the last one's 1 ms comes after backward."""
    step = predict_step([250] * 4, backward_s=10 * MS, alpha=0.5 * MS, beta=2e-6)
    assert step.sync_s == pytest.approx(11 * MS)
    assert step.comm_s == pytest.approx(4 * MS)
    assert step.overlap == pytest.approx(3 / 4)


def test_buckets_that_fall_behind_queue_one_at_a_time() -> None:
    """Four buckets ready every 1 ms but 3 ms each on the wire: they go back to back from the
    first one's readiness, 1 ms, to 13 ms; backward ends at 4 ms."""
    step = predict_step([100] * 4, backward_s=4 * MS, alpha=3 * MS, beta=0.0)
    assert step.sync_s == pytest.approx(13 * MS)
    assert step.comm_s == pytest.approx(12 * MS)
    assert step.overlapped_s == pytest.approx(3 * MS)


@given(total=st.integers(1, 10**9), count=st.integers(1, 1000))
def test_uniform_buckets_cover_the_total(total: int, count: int) -> None:
    sizes = uniform_buckets(total, total / count)
    assert len(sizes) == count and sum(sizes) == total and max(sizes) - min(sizes) <= 1


def test_zero3_without_prefetch_exposes_every_transfer() -> None:
    """4 units, 1 ms forward and 2 ms backward each; gathers 1.5 ms, reduce-scatters 1 ms:
    12 ms of compute, then 4 x (1.5 + 1.5 + 1) ms of transfers, one after another."""
    step = predict_zero3_step(4, 1 * MS, 2 * MS, 1.5 * MS, 1 * MS, prefetch=False)
    assert step.step_s == pytest.approx(12 * MS + 16 * MS)
    assert step.exposed_s == pytest.approx(16 * MS) and step.overlap == 0


def test_zero3_prefetch_hides_all_but_the_first_gathers_and_the_last_reduce_scatter() -> None:
    """Compute outlasts every transfer beside it: forward waits only for unit 1's gather,
    backward for unit 4's, and the last reduce-scatter comes after backward."""
    step = predict_zero3_step(4, 2 * MS, 4 * MS, 1 * MS, 1 * MS)
    assert step.step_s == pytest.approx(24 * MS + 1 * MS + 1 * MS + 1 * MS)
    assert step.overlap == pytest.approx(1 - 3 / 12)


def test_zero3_prefetch_on_a_link_bound_step_leaves_the_link_busy_end_to_end() -> None:
    """No compute at all: the transfers queue on one link, so prefetch cannot shorten it."""
    step = predict_zero3_step(4, 0.0, 0.0, 1.5 * MS, 1 * MS)
    assert step.step_s == pytest.approx(4 * (1.5 + 1.5 + 1) * MS)


def test_zero3_host_overhead_adds_once_per_collective_with_prefetch_or_without() -> None:
    """LogP's o: 3U collectives, each costing the host 0.5 ms that no overlap hides."""
    for prefetch in (False, True):
        bare = predict_zero3_step(4, 2 * MS, 4 * MS, 1 * MS, 1 * MS, prefetch)
        host = predict_zero3_step(4, 2 * MS, 4 * MS, 1 * MS, 1 * MS, prefetch, overhead_s=0.5 * MS)
        assert host.step_s == pytest.approx(bare.step_s + 12 * 0.5 * MS)
        assert host.exposed_s == pytest.approx(bare.exposed_s)  # the transfers' share is the same
        assert host.beyond_compute_s == pytest.approx(bare.exposed_s + 6 * MS)
