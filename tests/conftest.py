"""Shared fixtures: one persistent pool of worker ranks per world size (tests/harness/pool.py).

Import test helpers by their full name (e.g. `from tests.harness.pool import RankError`), not bare:
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

from tests.harness.pool import RankPool, RankPools


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("miniddp", "checking your own DDP class")
    group.addoption(
        "--ddp",
        metavar="FILE.py:CLASS",
        help="run tests/test_ddp_equivalence.py's checks on your own DDP class (the rung "
        "protocol: CLASS(module, *, bucket_cap_mb=None), forward, and "
        "finish_gradient_synchronization() after backward)",
    )
    group.addoption(
        "--ddp-claims",
        default="",
        metavar="CLAIM,...",
        help="stronger claims to check too, from miniddp.steps.CLAIMS: e.g. buckets (one "
        "all-reduce per bucket), torch-layout (torch's buckets, bitwise torch's DDP at any W), "
        "no-sync, batchnorm, mixed-dtypes",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With --ddp, run only the checks of your class; without it, skip them."""
    wanted = bool(config.getoption("--ddp"))
    keep = [item for item in items if ("your_ddp" in item.fixturenames) == wanted]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep


def pytest_configure(config: pytest.Config) -> None:
    """Check --ddp and --ddp-claims before anything starts: a wrong file, class or signature
    is named at once, not after the rank pool started, once per rank."""
    if not config.getoption("--ddp"):
        return
    from miniddp.steps import CLAIMS
    from tests.harness.idea_checks import IDEA_CLAIMS
    from tests.harness.your_ddp import check_your_ddp

    config.your_ddp_class = check_your_ddp(config.getoption("--ddp"))
    claims = frozenset(c for c in config.getoption("--ddp-claims").split(",") if c)
    if not claims <= CLAIMS | IDEA_CLAIMS:
        raise pytest.UsageError(
            f"unknown claims {sorted(claims - CLAIMS - IDEA_CLAIMS)}; choose from "
            f"{sorted(CLAIMS | IDEA_CLAIMS)}"
        )
    config.your_ddp_claims = claims


@pytest.fixture(scope="session")
def your_ddp(request: pytest.FixtureRequest) -> tuple[str, frozenset[str]]:
    """The class given with --ddp, as "/absolute/path/to/file.py:CLASS", and the claims to
    check (both checked in pytest_configure)."""
    return request.config.your_ddp_class, request.config.your_ddp_claims


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A learner's class that raised on the ranks: show its own error, with its file:line,
    first and once (`--tb=long` shows the harness's frames and every rank's traceback)."""
    report = yield
    wanted = "your_ddp" in getattr(item, "fixturenames", ())
    if not (report.failed and call.excinfo and wanted and item.config.option.tbstyle == "auto"):
        return report
    from tests.harness.pool import RankError
    from tests.harness.your_ddp import your_error_first

    if isinstance(call.excinfo.value, RankError):
        path = Path(item.config.your_ddp_class.rpartition(":")[0])
        short = your_error_first(call.excinfo.value.failures, path)
        if short is not None:
            report.longrepr = f"your DDP raised:\n{short}\n\n(--tb=long shows every frame)"
    return report


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
    from tests.harness.measurements import LARGEST

    if LARGEST:
        terminalreporter.section("measured")
        for name, value in sorted(LARGEST.items()):
            terminalreporter.write_line(f"{name}: {value:.3g}")
