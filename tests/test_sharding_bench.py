"""`python -m miniddp.bench sharding`: one tiny real run on 4 ranks, and what its report says.

No timing is asserted (this machine is shared); memory and bytes are exact, so they are.
"""

from __future__ import annotations

import json
import sys

import pytest

from miniddp.sharding.units import UNIT_NUMBER_BYTES
from tests.harness.processes import child_env, run_in_own_session


@pytest.mark.slow  # 17 s, 4 ranks; the formulas are checked in test_sharding*
def test_the_report_matches_every_formula_at_w_1_2_and_4(tmp_path):
    report_path = tmp_path / "sharding.json"
    tiny = ["--width", "8", "--depth", "2", "--iters", "3"]
    prefetch = [
        "--link",
        "alpha=1ms,bandwidth=1gbit",
        "--prefetch-iters",
        "2",
        "--prefetch-batch",
        "8",
    ]
    command = [sys.executable, "-m", "miniddp.bench", "sharding", *tiny, *prefetch]
    command += ["--json", str(report_path)]
    returncode, output = run_in_own_session(command, child_env(tmp_path), timeout=240)
    assert returncode == 0, output[-3000:]
    report = json.loads(report_path.read_text())
    rows = report["rows"]
    assert {(r["world_size"], r["stage"]) for r in rows} == {
        (w, s) for w in (1, 2, 4) for s in ("ddp", "zero1", "zero2", "zero3")
    }
    assert len(rows) == 4 * (1 + 2 + 4)  # every rank of every group reports
    for row in rows:
        assert row["exact"], row  # memory equals the formula, byte for byte
        if row["world_size"] == 1:
            assert row["sent"] == 0
        if row["stage"] == "ddp":
            assert abs(row["sent"] - row["sent_theory"]) <= 4 * row["world_size"], row
        if row["stage"] == "zero3":  # two all-gathers and a reduce-scatter of padded shards,
            others = row["world_size"] - 1  # and each gather's unit number, 2 units
            numbers = 2 * 2 * others * UNIT_NUMBER_BYTES
            assert row["sent"] == 3 * others * row["owned_elements"] * 4 + numbers
    assert set(report["ratios"]) == {"zero1", "zero2", "zero3"}
    prefetched, peak = report["prefetch"], report["prefetch"]["peak_full_bytes"]
    assert peak["prefetch"] == 2 * peak["no prefetch"] > 0  # two units full at most, or one
    assert len(prefetched["seconds"]["prefetch"]) == 2 == len(prefetched["compute_s"]["prefetch"])
    for measured, model in prefetched["beyond_compute_measured_and_model"].values():
        assert measured > 0 and model > 0  # the link's 1 ms a message is never free
