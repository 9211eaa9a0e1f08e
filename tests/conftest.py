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
        help="stronger claims to check too, from miniddp.steps.CLAIMS: e.g. overlap (an "
        "all-reduce in flight while backward goes on), buckets (one "
        "all-reduce per bucket), torch-layout (torch's buckets, bitwise torch's DDP at any W), "
        "no-sync, find-unused-parameters, comm-hook, gradient-as-bucket-view, batchnorm, "
        "mixed-dtypes",
    )
    group.addoption(
        "--ring",
        metavar="FILE.py:FUNCTION",
        help="run tests/test_collectives.py's checks on your own ring all-reduce, "
        "FUNCTION(peers, flat, op), as miniddp/collectives/ring.py's all_reduce",
    )
    group.addoption(
        "--zero1",
        metavar="FILE.py:CLASS",
        help="run tests/test_sharding.py's checks on your own ZeRO-1 optimizer, "
        "CLASS(params, optimizer_class, **defaults), against torch's ZeroRedundancyOptimizer",
    )


# Each option naming a learner's code, and the fixture of the tests that check it.
YOUR_CODE = {"--ddp": "your_ddp", "--ring": "your_ring", "--zero1": "your_zero1"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With --ddp, --ring or --zero1, run only the checks of your code; without, skip them."""
    given = {fixture for option, fixture in YOUR_CODE.items() if config.getoption(option)}

    def wanted(item: pytest.Item) -> bool:
        checks = set(YOUR_CODE.values()) & set(item.fixturenames)
        return bool(checks & given) if given else not checks

    keep = [item for item in items if wanted(item)]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep


def pytest_configure(config: pytest.Config) -> None:
    """Check --ddp and --ddp-claims (and --ring, --zero1) before anything starts: a wrong file,
    class or signature is named at once, not after the rank pool started, once per rank."""
    if config.getoption("--ring") or config.getoption("--zero1"):
        from tests.harness.your_code import ring_option, zero1_option

        if config.getoption("--ring"):
            config.your_ring = ring_option(config.getoption("--ring"))
        if config.getoption("--zero1"):
            config.your_zero1 = zero1_option(config.getoption("--zero1"))
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


@pytest.fixture(scope="session")
def your_ring(request: pytest.FixtureRequest) -> str:
    """The function given with --ring, as "/absolute/path/to/file.py:FUNCTION"."""
    return request.config.your_ring


@pytest.fixture(scope="session")
def your_zero1(request: pytest.FixtureRequest) -> str:
    """The class given with --zero1, as "/absolute/path/to/file.py:CLASS"."""
    return request.config.your_zero1


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A learner's code that raised on the ranks: show its own error, with its file:line,
    first and once (`--tb=long` shows the harness's frames and every rank's traceback)."""
    report = yield
    checks = [f for f in YOUR_CODE.values() if f in getattr(item, "fixturenames", ())]
    if not (report.failed and call.excinfo and checks and item.config.option.tbstyle == "auto"):
        return report
    from tests.harness.pool import RankError
    from tests.harness.your_ddp import your_error_first

    if isinstance(call.excinfo.value, RankError):
        given = {"your_ddp": "your_ddp_class"}.get(checks[0], checks[0])
        path = Path(getattr(item.config, given).rpartition(":")[0])
        short = your_error_first(call.excinfo.value.failures, path)
        if short is not None:
            what = {"your_ddp": "DDP", "your_ring": "ring", "your_zero1": "ZeRO-1"}[checks[0]]
            report.longrepr = f"your {what} raised:\n{short}\n\n(--tb=long shows every frame)"
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
