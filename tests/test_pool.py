"""The worker pool's contract: results by rank, errors with every rank's traceback, and a pool
that is killed and replaced rather than left hanging.

Each scenario is a module-level function next to the test that runs it: the pool sends it to
its workers by name (`tests.test_pool.<function>`), and they import this module to run it."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness import pool as pool_module
from tests.harness.pool import PoolStartupError, RankError, RankFailure, RankPool, WorkerDied

GetPool = Callable[[int], RankPool]


def all_reduce_contributions(contributions: list[int]) -> int:
    """Rank r contributes `contributions[r]`; every rank should see the sum."""
    total = torch.tensor([contributions[dist.get_rank()]], dtype=torch.int64)
    dist.all_reduce(total)
    return int(total.item())


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_gives_every_rank_the_sum(rank_pools: GetPool, world_size: int) -> None:
    contributions = [10**rank for rank in range(world_size)]
    results = rank_pools(world_size).run(all_reduce_contributions, contributions)
    assert results == [sum(contributions)] * world_size


@settings(max_examples=20, deadline=None)
@given(contributions=st.lists(st.integers(-(2**40), 2**40), min_size=2, max_size=2))
def test_pool_is_reused_across_hypothesis_examples(
    rank_pools: GetPool, contributions: list[int]
) -> None:
    results = rank_pools(2).run(all_reduce_contributions, contributions)
    assert results == [sum(contributions)] * 2


def raise_on_rank(failing_rank: int, message: str) -> int:
    """Fails before any collective, so the other ranks are not left waiting."""
    if dist.get_rank() == failing_rank:
        raise ValueError(message)
    return dist.get_rank()


def test_error_on_one_rank_names_it_and_leaves_the_pool_usable(pool2: RankPool) -> None:
    with pytest.raises(RankError) as raised:
        pool2.run(raise_on_rank, 1, "rank one is unhappy")
    assert raised.value.errors == {1: ("ValueError", "rank one is unhappy")}
    assert "rank 1 raised ValueError" in str(raised.value)
    assert "in raise_on_rank" in str(raised.value)  # the worker's traceback
    assert pool2.alive
    assert pool2.run(all_reduce_contributions, [1, 2]) == [3, 3]


def raise_everywhere(message: str) -> None:
    raise KeyError(f"{message} on rank {dist.get_rank()}")


def test_run_expecting_errors_reports_each_rank(pool2: RankPool) -> None:
    outcomes = pool2.run_expecting_errors(raise_everywhere, "no such key")
    assert all(isinstance(outcome, RankFailure) for outcome in outcomes)
    assert [(o.type_name, o.message) for o in outcomes] == [
        ("KeyError", repr(f"no such key on rank {rank}")) for rank in range(2)
    ]
    assert pool2.run_expecting_errors(raise_on_rank, 0, "x")[1] == 1


def sleep_on_rank(slow_rank: int, seconds: float) -> int:
    if dist.get_rank() == slow_rank:
        time.sleep(seconds)
    return dist.get_rank()


def test_a_rank_that_does_not_answer_times_out_and_the_pool_is_replaced(
    rank_pools: GetPool,
) -> None:
    pool = rank_pools(2)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of RankPool\(2\) did not answer"):
        pool.run(sleep_on_rank, 1, 60.0, timeout=1.0)
    assert time.monotonic() - started < 1.0 + 5.0  # the timeout, plus killing the workers
    assert not pool.alive
    fresh = rank_pools(2)
    assert fresh is not pool
    assert fresh.run(all_reduce_contributions, [1, 2]) == [3, 3]


def exit_on_rank(dying_rank: int, exit_code: int) -> int:
    if dist.get_rank() == dying_rank:
        os._exit(exit_code)
    return dist.get_rank()


def test_a_worker_that_exits_is_reported_with_its_exit_code(rank_pools: GetPool) -> None:
    pool = rank_pools(2)
    with pytest.raises(WorkerDied, match="rank 1 exit code 3") as raised:
        pool.run(exit_on_rank, 1, 3)
    assert raised.value.exit_codes == {1: 3}
    assert not pool.alive
    assert rank_pools(2).run(all_reduce_contributions, [1, 2]) == [3, 3]


def leave_ranks_out_of_step(failing_rank: int) -> None:
    """The other ranks start an all_reduce that `failing_rank` never joins, then carry on, so
    their collectives are numbered one ahead of its own from now on."""
    if dist.get_rank() == failing_rank:
        raise RuntimeError("failed before the all_reduce")
    dist.all_reduce(torch.full((1,), 100), async_op=True)


def test_ranks_left_out_of_step_get_the_pool_discarded(
    rank_pools: GetPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pool_module, "GROUP_CHECK_TIMEOUT_S", 1.0)
    pool = rank_pools(2)
    with pytest.raises(RankError, match="failed before the all_reduce"):
        pool.run(leave_ranks_out_of_step, 1)
    assert not pool.alive
    assert rank_pools(2).run(all_reduce_contributions, [1, 2]) == [3, 3]


def process_id() -> int:
    return os.getpid()


def test_dead_pool_refuses_work_and_shutdown_removes_the_workers() -> None:
    pool = RankPool(2)
    worker_pids = pool.run(process_id)
    pool.shutdown()
    assert not pool.alive
    assert all(not process.is_alive() for process in pool._processes)
    assert len(set(worker_pids)) == 2
    with pytest.raises(RuntimeError, match="is dead"):
        pool.run(process_id)


def test_a_pool_that_does_not_start_in_time_is_killed() -> None:
    children_before = set(multiprocessing.active_children())
    with pytest.raises(PoolStartupError, match=r"RankPool\(2\) did not start: .* within 0.1 s"):
        RankPool(2, startup_timeout=0.1)
    assert set(multiprocessing.active_children()) <= children_before
