"""`python -m miniddp.bench diloco`: a bad option is refused before any rank starts, and one
tiny real run on 4 ranks reports every way with the bytes the formula gives.

No timing is asserted (this machine is shared): the bytes to the target are syncs x the ring's
2(W-1)/W of the model's float32 bytes, DDP's ratio to itself is 1, and each ratio sits inside
its own interval.
"""

from __future__ import annotations

import json
import sys

import pytest

from miniddp.instruments.bench.diloco import parse_args
from tests.harness.processes import child_env, run_in_own_session


def test_an_h_below_one_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(["--h", "10,0"])
    assert exited.value.code == 2
    assert "every H must be at least 1" in capsys.readouterr().err


@pytest.mark.slow  # a minute or two: 4 ranks train three ways; test_local_sgd.py checks DiLoCo
def test_the_bench_reports_bytes_and_simulated_time_to_the_target(tmp_path):
    report_path = tmp_path / "diloco.json"
    command = [
        *(sys.executable, "-m", "miniddp.bench", "diloco", "--steps", "60", "--h", "5,20"),
        *("--iters", "1", "--target", "3.2", "--json", str(report_path)),
    ]
    returncode, output = run_in_own_session(command, child_env(tmp_path), timeout=600)
    assert returncode == 0, output[-3000:]
    report = json.loads(report_path.read_text())
    results = report["results"]
    assert results["ddp"]["ratio"] == 1.0
    model_bytes = 59_712 * 4
    for way, every in (("ddp", 1), ("H=5", 5), ("H=20", 20)):
        result = results[way]
        syncs = result["steps"] // every
        assert result["bytes"] == syncs * 2 * 3 / 4 * model_bytes
        low, high = result["interval"]
        assert low <= result["ratio"] <= high
