"""`python -m miniddp.bench step`: the interleaving, the paired statistics, and one tiny real run.

No timing is asserted: this machine is shared. The run checks what the report contains.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest

from miniddp.bench.paired import paired_ratio, paired_ratio_interval, quantile, rotated
from miniddp.bench.step import targets
from miniddp.bench.variants import VARIANTS
from tests.harness.processes import child_env, run_in_own_session


def test_rotation_puts_every_variant_in_every_position_equally_often():
    names = ["a", "b", "c", "d"]
    orders = [rotated(names, i) for i in range(8)]
    assert all(sorted(order) == names for order in orders)
    for position in range(4):
        assert Counter(order[position] for order in orders) == {n: 2 for n in names}


def test_paired_ratio_is_the_median_of_per_iteration_ratios():
    # A load spike in iteration 2 slows both variants: pairing cancels it, unpaired would not.
    ours, theirs = [1.0, 1.1, 5.0], [1.0, 1.0, 5.5]
    assert paired_ratio(ours, theirs) == pytest.approx(1.0)
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.25) == pytest.approx(1.75)
    assert quantile([1.0], 0.75) == 1.0


def test_every_variant_is_compared_with_a_torch_variant():
    for name, (_, reference) in VARIANTS.items():
        assert reference.startswith("torch") and reference in VARIANTS, name


def test_targets_check_the_issues_bounds():
    result = {
        "model": "mlp",
        "wall_s": {"miniddp": [1.0, 1.0], "torch": [1.0, 0.9], "miniddp-1": [0.9, 0.9],
                   "deferred-1": [1.0, 1.0]},
        "cpu_s": {"miniddp": [1.2, 1.2], "torch": [1.0, 1.0]},
        "rows": {"miniddp": {"cpu_vs_reference": 1.2, "reference": "torch"},
                 "miniddp-1": {"overlap": 0.8}},
    }  # fmt: skip
    found = {c["what"]: (round(c["value"], 3), c["met"]) for c in targets([result])}
    assert found["miniddp / torch"] == (pytest.approx(1.056), False)  # median of 1.0 and 1.11
    assert found["miniddp-1 / deferred-1"] == (0.9, True)
    assert found["CPU miniddp / torch"] == (1.2, False)
    assert found["overlap miniddp-1"] == (0.8, True)
    assert "miniddp / naive" not in found  # only for the deep model, and naive did not run


def test_the_interval_of_a_paired_median_narrows_with_more_iterations():
    theirs = [1.0] * 100
    ours = [1.0 + i / 100 for i in range(100)]  # ratios 1.00 .. 1.99, median 1.495
    assert paired_ratio_interval(ours, theirs) == (pytest.approx(1.40), pytest.approx(1.59))
    assert paired_ratio_interval(ours[::4], theirs[::4]) == (  # 25 ratios: 1.00, 1.04, ...
        pytest.approx(1.28),
        pytest.approx(1.68),
    )
    assert paired_ratio_interval([2.0], [1.0]) == (2.0, 2.0)


def test_a_tiny_run_reports_every_variant_with_paired_ratios(tmp_path):
    report_path = tmp_path / "step.json"
    command = [sys.executable, "-m", "miniddp.bench", "step", "--models", "deep",
               "--variants", "miniddp,naive", "--iters", "2", "--trace-iters", "1",
               "--json", str(report_path)]  # fmt: skip
    returncode, output = run_in_own_session(command, child_env(tmp_path), timeout=240)
    assert returncode == 0, output[-3000:]
    assert "torchrun" in output or "torch.distributed.run" in output  # relaunched itself
    report = json.loads(report_path.read_text())
    (result,) = report["results"]
    assert result["model"] == "deep" and result["tensors"] == 300
    assert set(result["wall_s"]) == {"miniddp", "naive", "torch"}  # torch added as reference
    assert all(len(times) == 2 for times in result["wall_s"].values())
    rows = result["rows"]
    assert rows["miniddp"]["reference"] == "torch" and rows["miniddp"]["vs_reference"] > 0
    assert 0 <= rows["miniddp"]["overlap"] <= 1 and rows["naive"]["overlap"] == 0
    assert "overlap" not in rows["torch"]  # torch's DDP notes no events
    assert rows["miniddp"]["buckets"] == 2  # 2.4 MB of gradients: the 1 MiB first bucket + one
    checked = {c["what"] for c in report["targets"]}
    assert {"miniddp / torch", "miniddp / naive", "CPU miniddp / torch"} <= checked
    assert len(report["load_average_before"]) == 3
    for line in ("deep:", "targets (paired medians over iterations", "load average"):
        assert line in output
