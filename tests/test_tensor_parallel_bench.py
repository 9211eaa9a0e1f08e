"""`python -m miniddp.bench tp`: one tiny real run on 2 ranks, and what its report says.

No timing is asserted (this machine is shared): only that both designs ran every step, computed
the same block, and that the ratio sits inside its own interval.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.harness.processes import child_env, run_in_own_session


@pytest.mark.slow  # 12 s; tests/test_tensor_parallel.py checks the same block's maths
def test_the_bench_times_both_on_the_same_block(tmp_path):
    report_path = tmp_path / "tp.json"
    command = [
        *(sys.executable, "-m", "miniddp.bench", "tp", "--width", "16", "--heads", "4"),
        *("--batch", "2", "--length", "4", "--iters", "3", "--json", str(report_path)),
    ]
    returncode, output = run_in_own_session(command, child_env(tmp_path), timeout=240)
    assert returncode == 0, output[-3000:]
    report = json.loads(report_path.read_text())
    assert sorted(report["times"]) == ["ours", "torch"]
    assert all(len(seconds) == 3 for seconds in report["times"].values())
    assert report["largest_output_difference"] <= 1e-5  # the same block, the same maths
    low, high = report["interval"]
    assert 0 < low <= report["ratio"] <= high
