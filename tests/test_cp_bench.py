"""`python -m miniddp.bench cp`: one tiny real run on 2 ranks, and what its report says.

No timing is asserted (this machine is shared): only that every variant ran every step and
computed one process's attention, that the ring held half of one process's activations at
W = 2 and as much as torch's ring, that load balancing gave both ranks the same blocks, and
that each ratio sits inside its own interval.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.harness.processes import child_env, run_in_own_session


@pytest.mark.slow  # ~20 s (two ranks start); tests/test_context_parallel.py checks the maths
def test_the_bench_times_the_ring_against_one_process_and_torchs(tmp_path):
    report_path = tmp_path / "cp.json"
    command = [
        *(sys.executable, "-m", "miniddp.bench", "cp", "--lengths", "64,128"),
        *("--iters", "3", "--json", str(report_path)),
    ]
    returncode, output = run_in_own_session(command, child_env(tmp_path), timeout=240)
    assert returncode == 0, output[-3000:]
    results = json.loads(report_path.read_text())["results"]
    assert [result["length"] for result in results] == [64, 128]
    for result in results:
        assert sorted(result["times"]) == ["one", "ours", "torch"]
        assert all(len(seconds) == 3 for seconds in result["times"].values())
        assert max(result["largest_difference_to_one"].values()) <= 1e-5
        held = result["held_bytes"]
        assert held["ours"] * 2 == held["one"] and held["ours"] == held["torch"]
        assert result["blocks_per_rank"] == [5, 5]  # 2W + 1 of 4W chunk pairs, each rank
        for ratio in result["ratios"].values():
            low, high = ratio["interval"]
            assert 0 < low <= ratio["ratio"] <= high


def test_a_bad_length_list_is_refused_at_once(tmp_path):
    command = [sys.executable, "-m", "miniddp.bench", "cp", "--lengths", "64,x"]
    returncode, output = run_in_own_session(command, child_env(tmp_path), timeout=120)
    assert returncode == 2, output[-3000:]
    assert "not a comma-separated list of lengths: '64,x'" in output
