"""A rank that dies, stalls or stops early becomes an error naming the collective and the rank.

Each test starts its own ranks (tests/faulty_ranks.py): real processes, one of which
misbehaves on purpose, with a 2 s process-group timeout.

Two layers are tested with the same faults: `wait_for` around a raw async all-reduce (the
mechanism alone), and MiniDDP training (the mechanism where users meet it). The MiniDDP cases
need ddp.py to route its waits through `miniddp.faults.wait_for`; until it does they are skipped,
with that reason.

The time from the fault to the survivor's error is printed in the "measured" summary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.faulty_ranks import PROCESS_GROUP_TIMEOUT_S, record_detection, run_ranks

LAYERS = ["wait_for", "miniddp"]


@dataclass(frozen=True)
class Fault:
    """One row of the table: what rank 1 does, and what rank 0 must then raise, how soon."""

    fault: str  # the victim's misbehaviour, as `worker` below implements it
    says: tuple[str, ...]  # phrases rank 0's CollectiveFailed must contain
    within_s: tuple[float, float]  # seconds from the fault to rank 0's error: (at least, at most)


T = PROCESS_GROUP_TIMEOUT_S
FAULTS = {
    # A closed connection needs no timeout: the others hear within the 1 s grace period.
    "exits abruptly (os._exit)": Fault("exit", ("rank 1 is missing", "died abruptly"), (0, 3)),
    # Alive but silent looks like slow until the timeout: not before it, soon after it.
    "stalls, alive but silent": Fault(
        "stall", ("rank 1 is missing", "alive but not taking part"), (T - 0.5, T + 4)
    ),
    "raises an exception": Fault(
        "raise", ("rank 1 is missing", "ValueError: a bug that only rank 1 has"), (0, 3)
    ),
    "takes one step fewer, then exits": Fault(
        "fewer-steps", ("ended normally", "different numbers of steps"), (0, 3)
    ),
    # Both ranks wait in different collectives until the timeout; whether rank 1's own timeout
    # error ends its process before rank 0 stops listening is a race: only the name is certain.
    "takes one step fewer, then waits in a barrier": Fault(
        "fewer-steps-then-barrier", ("rank 1 is missing",), (T - 0.5, T + 4)
    ),
    "takes one step fewer, then all-gathers": Fault(
        "fewer-steps-then-gather", ("rank 1 is missing",), (T - 0.5, T + 4)
    ),
    # One collective, two sizes: gloo aborts the process whose buffer is too small ("Is there a
    # distributed collective mismatch in your code?"), here rank 1. Rank 0 names it.
    "takes one step fewer, then all-reduces a smaller tensor (gloo aborts it)": Fault(
        "fewer-steps-then-mismatch", ("rank 1 is missing", "died abruptly"), (0, 3)
    ),
}
# Through MiniDDP: the faults a user meets in training. The others need no model.
IN_TRAINING = (
    "exits abruptly (os._exit)",
    "stalls, alive but silent",
    "raises an exception",
    "takes one step fewer, then exits",
)
ROWS = [pytest.param(name, "wait_for", id=f"{name} [wait_for]") for name in FAULTS]
ROWS += [pytest.param(name, "miniddp", id=f"{name} [MiniDDP]") for name in IN_TRAINING]


@pytest.mark.parametrize(("name", "layer"), ROWS)
def test_a_faulty_rank_is_named_by_the_others(tmp_path: Path, name: str, layer: str) -> None:
    row = FAULTS[name]
    run = run_ranks(tmp_path, row.fault, layer)
    error = run.raised(0)
    assert error["type"] == "CollectiveFailed" and error["missing"] == [1], error["message"]
    assert "all-reduce" in error["collective"] and error["collective"] in error["message"]
    for phrase in row.says:
        assert phrase in error["message"], error["message"]
    seconds = run.detection_s(0, victim=1)
    record_detection(f"rank 1 {name} ({layer})", seconds)
    low, high = row.within_s
    assert low <= seconds <= high, f"rank 0 raised {seconds:.2f} s after the fault"


def test_every_survivor_names_the_missing_rank(tmp_path: Path) -> None:
    run = run_ranks(tmp_path, "exit", "wait_for", world_size=3, victim=2)
    for survivor in (0, 1):
        error = run.raised(survivor)
        assert error["missing"] == [2], error["message"]
        assert "ranks 0, 1: waiting on it" in error["message"]
    record_detection("rank 2 of 3 exits abruptly", max(run.detection_s(r, 2) for r in (0, 1)))


@pytest.mark.parametrize("layer", LAYERS)
def test_a_slow_rank_is_not_a_fault(tmp_path: Path, layer: str) -> None:
    run = run_ranks(tmp_path, "slow", layer)
    for rank in (0, 1):
        assert run.first(rank, "raised") is None, run.first(rank, "raised")
        finished = run.first(rank, "finished")
        assert finished is not None, run.outputs[rank][-3000:]
        assert finished["excepthook_untouched"], "watching collectives replaced sys.excepthook"


@pytest.mark.parametrize("layer", LAYERS)
def test_a_rank_that_stops_early_and_calls_cleanup_is_named_on_both_sides(
    tmp_path: Path, layer: str
) -> None:
    """Every chapter ends with cleanup(). Once, the rank that ran a step fewer waited there,
    in a barrier, for the whole timeout and then exited 0, while the other blamed a dead or a
    stuck rank. Now both say what happened, well before the 2 s timeout would have."""
    run = run_ranks(tmp_path, "fewer-steps-then-cleanup", layer)
    training, cleaning_up = run.raised(0), run.raised(1)
    assert training["missing"] == [1] and "all-reduce" in training["collective"]
    assert re.search(
        r"rank 1: it finished after \d+ collectives and called cleanup\(\)", training["message"]
    )
    assert cleaning_up["collective"] == "cleanup()" and cleaning_up["missing"] == [0]
    assert re.search(r"rank 0: waited on collective #\d+, all-reduce", cleaning_up["message"])
    # The training rank's first sign names the rank that stopped (1), not itself (0), whole.
    (sign,) = [line.strip() for line in training["message"].splitlines() if "First sign" in line]
    assert re.fullmatch(
        r"First sign: rank 1 called cleanup\(\) without joining it( \(.*\))?\.", sign
    ), sign
    for rank, error in enumerate((training, cleaning_up)):
        assert "ran different numbers of steps" in error["message"], error["message"]
        seconds = run.detection_s(rank, victim=1)
        record_detection(f"rank 1 stops early and calls cleanup(): rank {rank} ({layer})", seconds)
        assert seconds < 5 * PROCESS_GROUP_TIMEOUT_S, f"rank {rank} took {seconds:.2f} s"


def test_the_first_sign_names_the_rank_that_stopped(tmp_path: Path) -> None:
    """Three ranks, and the middle one stops a step early. Whoever notices first names rank 1
    (gloo's "Connection closed by peer" names no rank: its exit note does); a survivor that
    heard it from the other one's flag names that survivor."""
    run = run_ranks(tmp_path, "fewer-steps", "wait_for", world_size=3, victim=1)
    signs = {}
    for survivor in (0, 2):
        message = run.raised(survivor)["message"]
        signs[survivor] = next(
            line.strip() for line in message.splitlines() if "First sign" in line
        )
    stopped = "First sign: rank 1's process ended without joining it"
    assert any(sign.startswith(stopped) for sign in signs.values()), signs
    for survivor, other in ((0, 2), (2, 0)):
        if not signs[survivor].startswith(stopped):
            assert signs[survivor] == f"First sign: rank {other} gave up first.", signs
            assert signs[other].startswith(stopped), signs
