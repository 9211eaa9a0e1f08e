"""`python -m miniddp.bench compose`: the benchmark in its smallest forms, and what its report says.

No timing is asserted (this machine is shared): only that both designs ran every step, on the
bare machine and over a link, and that the benchmark's own check held before it timed: one step
of MiniDDP's composition and one of torch's, on the same windows, gave the same loss and the same
gradients within rounding (the benchmark stops before timing otherwise).
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.harness.processes import child_env, run_ranks_like_torchrun

LINK = "alpha=100us,bandwidth=10gbit"  # fast: the path over the link runs, the test stays short


def run_the_bench(tmp_path, mesh: str, ranks: int, links: list[str]) -> dict:
    report_path = tmp_path / "compose.json"
    command = [sys.executable, "-m", "miniddp.bench", "compose", "--mesh", mesh]
    command += ["--width", "16", "--vocab", "16", "--length", "8", "--batch", "4"]
    command += ["--iters", "1", "--warmup", "0", "--json", str(report_path)]
    command += [option for link in links for option in ("--link", link)]
    returncode, output = run_ranks_like_torchrun(command, ranks, child_env(tmp_path), timeout=300)
    assert returncode == 0, "\n".join(
        line for line in output.splitlines() if "frame #" not in line
    )[-3000:]
    return json.loads(report_path.read_text())


def check_the_report(report: dict, links: list[str]) -> None:
    assert [run["link"] for run in report["runs"]] == links
    for run in report["runs"]:
        assert sorted(run["times"]) == ["ours", "torch"]
        assert all(len(seconds) == 1 for seconds in run["times"].values())
        assert run["apart"]["loss"] <= 1e-5  # the same GPT, the same windows, the same maths
        assert run["apart"]["gradient"] <= 1e-5
        low, high = run["interval"]
        assert 0 < low <= run["ratio"] <= high


@pytest.mark.slow  # 20 s of start-up: the composition's bits are test_parallelize.py's
def test_tp_x_pp_on_4_ranks_bare_and_over_a_link(tmp_path):
    """(pp, dp, tp) = (2, 1, 2): TP inside each stage, the tie across stages, loss_parallel."""
    links = ["none", LINK]
    check_the_report(run_the_bench(tmp_path, "2,1,2", 4, links), links)


@pytest.mark.slow  # 8 ranks on a small machine; the only mesh where torch's DDP holds TP shards
def test_the_default_3d_mesh_on_8_ranks(tmp_path):
    """(2, 2, 2): also torch's DDP over `_pre_dp_module_transform`'s local shards, whose
    gradients the benchmark divides by m by hand (torch's scale_grads no longer sees them)."""
    check_the_report(run_the_bench(tmp_path, "2,2,2", 8, ["none"]), ["none"])
