"""`python -m miniddp.bench ep`: one tiny real run on 2 ranks, and what its report says.

No timing is asserted (this machine is shared): only that every variant ran every step, that
the model priced the all-to-alls of the batch (more over the link than bare), and that each
ratio sits inside its own interval.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.harness.processes import child_env, run_in_own_session


@pytest.mark.slow  # ~30 s (two ranks start, the cost model is fitted)
def test_the_bench_times_the_all_to_alls_against_the_model(tmp_path):
    report_path = tmp_path / "ep.json"
    command = [
        *(sys.executable, "-m", "miniddp.bench", "ep", "--tokens", "64", "--dim", "32"),
        *("--hidden", "32", "--iters", "3", "--json", str(report_path)),
    ]
    returncode, output = run_in_own_session(command, child_env(tmp_path), timeout=240)
    assert returncode == 0, output[-3000:]
    bare, linked = json.loads(report_path.read_text())["runs"]
    assert (bare["link"], linked["link"]) == ("none", "alpha=1ms,bandwidth=1gbit")
    assert bare["dispatch_combine_predicted_ms"] < linked["dispatch_combine_predicted_ms"]
    for run in (bare, linked):
        assert all(len(seconds) == 3 for seconds in run["times"].values())
        for ratio in run["ratios"].values():  # "ep / deepspeed" too, where it is installed
            low, high = ratio["interval"]
            assert 0 < low <= ratio["ratio"] <= high
        assert "ep / dp" in run["ratios"]


def test_more_choices_than_experts_is_refused_at_once(tmp_path):
    command = [sys.executable, "-m", "miniddp.bench", "ep", "--experts", "2", "--top-k", "3"]
    returncode, output = run_in_own_session(command, child_env(tmp_path), timeout=120)
    assert returncode == 2, output[-3000:]
    assert "--top-k 3 is more than --experts 2" in output
