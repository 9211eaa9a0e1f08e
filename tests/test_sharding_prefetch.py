"""fully_shard's prefetch (miniddp/sharding/prefetch.py): four units in a chain, each with a probe
that counts the units whose full parameters exist (gathered, or their all-gather in flight)
while it computes, in forward and in backward.

From the second step on, the previous forward's order is known: the next unit's gather is in
flight while one computes, so two units' full parameters exist, never more. Without prefetch,
one. Either way the same bits, and the same bytes.
"""

from __future__ import annotations

import torch

from miniddp.sharding.units import UNIT_NUMBER_BYTES
from tests import sharding_prefetch_tasks as tasks
from tests.faulty_ranks import EXIT_DURING_PREFETCH, record_detection, run_ranks

UNITS = len(tasks.WIDTHS) - 1


def assert_bitwise(ours: list, theirs: list) -> None:
    for step, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        for index, (a, b) in enumerate(zip(mine, reference, strict=True)):
            assert torch.equal(a, b), f"parameter {index} differs after step {step}"


def test_prefetch_keeps_two_units_full_at_most_and_changes_no_bits(pool2):
    on, off = pool2.run(tasks.train), pool2.run(tasks.train, prefetch=False)
    for with_prefetch, without in zip(on, off, strict=True):
        assert with_prefetch["alive"][0] == {"forward": 1, "backward": 2}  # no order yet
        assert with_prefetch["alive"][1:] == [{"forward": 2, "backward": 2}] * 2
        assert without["alive"] == [{"forward": 1, "backward": 1}] * 3
        assert_bitwise(with_prefetch["params"], without["params"])
        assert with_prefetch["sent"] == without["sent"]


def test_without_resharding_after_forward_backward_gathers_nothing(pool2):
    """reshard_after_forward=False keeps the full parameters from forward to backward: the
    step sends one all-gather and one reduce-scatter per unit, and the units' numbers once."""
    for result in pool2.run(tasks.train, reshard_after_forward=False):
        shards = sum(result["shard_elements"])
        assert result["sent"] == [2 * shards * 4 + UNITS * UNIT_NUMBER_BYTES] * 3


def test_explicit_prefetch_lists_are_honoured_with_torchs_bits(pool2):
    """Every unit told to prefetch all later units (forward) and all earlier ones (backward),
    as torch's set_modules_to_forward_prefetch / set_modules_to_backward_prefetch allow: all
    four are full at once, and the parameters are torch's fully_shard's, bit for bit."""
    ours = pool2.run(tasks.train, explicit="all")
    theirs = pool2.run(tasks.torch_with_explicit_prefetch)
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine["alive"][0] == {"forward": UNITS, "backward": UNITS}
        assert_bitwise(mine["params"], reference)


def test_a_rank_killed_during_a_prefetched_gather_is_named_within_a_second_or_so(tmp_path):
    """Rank 1 joins the check before unit 2's prefetched all-gather, then dies: rank 0, which
    issued that gather while unit 1 computed, waits for it through the one wait seam, and
    names the gather and the rank (tests/test_faults.py's "exits abruptly", behind prefetch)."""
    run = run_ranks(tmp_path, EXIT_DURING_PREFETCH, "fully_shard")
    error = run.raised(0)
    assert error["type"] == "CollectiveFailed" and error["missing"] == [1], error["message"]
    assert error["collective"].startswith("all-gather of fully_shard unit 2 (Linear")
    assert error["collective"].endswith("bytes), prefetched")
    assert "rank 1 is missing" in error["message"] and "died abruptly" in error["message"]
    seconds = run.detection_s(0, victim=1)
    record_detection("rank 1 dies during a prefetched fully_shard gather", seconds)
    assert seconds <= 3, f"rank 0 raised {seconds:.2f} s after the fault"


def test_the_timeline_records_each_units_lanes_in_the_order_prefetch_issues_them(pool2):
    """A recorded step (miniddp/sharding/unit_lanes.py): every unit computes forward and backward,
    is gathered twice and reduce-scattered once. With prefetch, unit i+1's gather is issued
    before unit i's forward ends, and the peak of full parameters is one unit's and its
    neighbour's gather buffer; without, each gather waits for the forward before, and the peak
    is the largest unit's. Orders of events, not timings."""
    for prefetch in (True, False):
        for result in pool2.run(tasks.record_lanes, prefetch=prefetch):
            spans = {(lane, name): (start, end) for lane, name, start, end in result["spans"]}
            numbers = result["numbers"]
            lanes = [lane for lane, *_ in result["spans"]]
            assert lanes.count("compute") == 2 * UNITS and lanes.count("reduce-scatter") == UNITS
            assert lanes.count("all-gather") == 2 * UNITS
            first_gather = {
                n: min(s for lane, name, s, _ in result["spans"] if name == f"all-gather {n}")
                for n in numbers
            }
            for a, b in zip(numbers, numbers[1:]):
                issued_early = first_gather[b] < spans["compute", f"forward {a}"][1]
                assert issued_early == prefetch, (prefetch, a, b)
            full, gathered = result["full_bytes"], result["gathered_bytes"]
            if prefetch:
                pairs = zip(range(UNITS), range(1, UNITS))
                peak = max(max(full[i] + gathered[j], full[j] + gathered[i]) for i, j in pairs)
            else:
                peak = max(full)
            assert result["peak"] == peak
            assert not result["recording_after"]
