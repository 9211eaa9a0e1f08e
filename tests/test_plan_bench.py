"""`python -m miniddp.bench plan`: the four layouts on 8 ranks over the link, each measured step
beside the plan's prediction with this machine's constants. No timing is asserted (this machine
is shared; the ratios go in the closing notes): only that every layout ran and was priced from
constants measured here, and that the report says how the orders compare.
"""

from __future__ import annotations

import json
import sys

import pytest

from miniddp.instruments.bench.plan import LAYOUTS
from tests.harness.processes import child_env, run_ranks_like_torchrun


@pytest.mark.slow  # 8 ranks on 2 cores, about 20 s
def test_every_layout_is_measured_and_priced_from_this_machines_constants(tmp_path):
    report_path = tmp_path / "plan.json"
    command = [sys.executable, "-m", "miniddp.bench", "plan", "--iters", "1", "--warmup", "0"]
    command += ["--json", str(report_path)]
    returncode, output = run_ranks_like_torchrun(command, 8, child_env(tmp_path), timeout=300)
    assert returncode == 0, output[-3000:]
    report = json.loads(report_path.read_text())
    assert report["flops"] > 0 and report["layer"] > 0 and report["o"] >= 0
    assert report["ends"] >= 0 and 0 < report["bandwidth"] <= 100e6 / 8  # at most the link's
    assert [tuple(row["pp_dp_tp"]) for row in report["rows"]] == list(LAYOUTS)
    for row in report["rows"]:
        assert row["measured_s"] > 0 and row["predicted_s"] > 0
        assert row["ratio"] == pytest.approx(row["measured_s"] / row["predicted_s"])
    assert "fastest to slowest, planned:" in output and "within 25% of the plan:" in output


def test_a_global_batch_that_does_not_split_is_refused_before_anything_runs(tmp_path):
    command = [sys.executable, "-m", "miniddp.bench", "plan", "--global-batch", "6"]
    returncode, output = run_ranks_like_torchrun(command, 1, child_env(tmp_path), timeout=120)
    assert returncode == 2, output[-3000:]
    assert "--global-batch 6 must split over dp = 4" in output
