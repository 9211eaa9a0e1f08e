"""Shared fixtures: one persistent pool of worker ranks per world size (see tests/pool.py).

Import test helpers as `tests.<module>` (e.g. `from tests.pool import RankError`), never bare:
the same file imported under two names gives two `RankError` classes, and `pytest.raises` then
misses. The repository root goes on sys.path here because `pytest tests/x.py`, unlike
`python -m pytest`, does not put it there. Spawned workers inherit sys.path, so they can
import task functions from `tests.<module>` too.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from tests.pool import RankPool, RankPools


@pytest.fixture(scope="session")
def rank_pools() -> Iterator[Callable[[int], RankPool]]:
    """`rank_pools(world_size)` gives a live pool, started on first use, replaced once dead.

    Inside a hypothesis test, call it in the test body for each example: a pool that died in
    one example is then replaced for the next.
    """
    pools = RankPools()
    try:
        yield pools.get
    finally:
        pools.shutdown()


@pytest.fixture
def pool2(rank_pools: Callable[[int], RankPool]) -> RankPool:
    """A live two-rank pool (function-scoped, so a pool killed by one test is not handed on)."""
    return rank_pools(2)


def pytest_terminal_summary(terminalreporter) -> None:
    """Report the figures the tests measured (e.g. the largest difference from single-process
    training), so a run shows the numbers behind its claims, not just that they held."""
    from tests.measurements import LARGEST

    if LARGEST:
        terminalreporter.section("measured")
        for name, value in sorted(LARGEST.items()):
            terminalreporter.write_line(f"{name}: {value:.3g}")
