"""scripts/gpu_check.sh, the one prepared command for a lent GPU, checked here without one: its
dry run lists every parallelism and what else it would run, and its checks themselves pass on
the CPU over gloo at W = 2 (`--cpu`: the very checks a GPU node runs, on another device).
How the ranks agree on an outcome is checked on its own, with made-up outcomes."""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

import pytest

from tests.harness.processes import child_env, run_in_own_session, tail

REPO = Path(__file__).resolve().parents[1]
PARALLELISMS = (
    *("DDP", "ZeRO", "FSDP", "HSDP", "TP", "PP", "CP", "EP"),
    *("3-D", "4-D", "5-D", "collectives"),
)

sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402
import parallelism_checks  # noqa: E402
import run_checks  # noqa: E402


def rows(output: str) -> list[str]:
    """The lines that begin (after their indent) with a parallelism's name."""
    return [line for line in output.splitlines() if line.split()[:1] in [[p] for p in PARALLELISMS]]


def listed(output: str) -> set[str]:
    return {line.split()[0] for line in rows(output)}


def test_the_dry_run_lists_every_parallelism_the_tests_and_the_bench_on_8_gpus(tmp_path):
    command = ["scripts/gpu_check.sh", "--dry-run", "--gpus", "8"]
    returncode, output = run_in_own_session(command, child_env(tmp_path), timeout=120)
    assert returncode == 0, tail(output)
    assert listed(output) == set(PARALLELISMS), output
    assert "W = 8 over nccl" in output and "--nproc-per-node=8" in output
    assert "-m cuda" in output and "tests/test_cuda.py" in output  # the existing CUDA tests
    assert "miniddp.bench step --device=cuda" in output
    assert "skipped" not in output


def test_the_dry_run_on_one_gpu_shares_it_over_gloo_and_says_what_it_skips(capsys):
    assert gpu_check.main(["--dry-run", "--gpus", "1"]) == 0
    output = capsys.readouterr().out
    assert "W = 2 over gloo+cuda" in output and "NCCL refuses two ranks on one GPU" in output
    checks = parallelism_checks.CHECKS.values()
    sending = [c.name for c in checks if c.torch_sends]
    assert sending and all(f"{name} skipped: torch's side sends" in output for name in sending)
    ours = [c.name for c in checks if not c.torch_sends]  # ours go through a host copy
    assert ours and not any(f"{name} skipped" in output for name in ours)


def test_the_checks_pass_on_the_cpu_over_gloo_at_w2(tmp_path, monkeypatch, capsys):
    """Every check of the GPU run, on CPU tensors: each within its bound (bitwise where the
    maths allows), in one torchrun of two ranks. (In this process: one import of torch fewer
    than scripts/gpu_check.sh --cpu, which the dry run above goes through.)"""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # torchrun leaves a folder there
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # and so does gpu_check
    passed = gpu_check.main(["--cpu"]) == 0
    output = capsys.readouterr().out
    assert passed, output
    table = rows(output)
    assert len(table) == len(parallelism_checks.CHECKS) and listed(output) == set(PARALLELISMS)
    assert all(re.search(r" 2 gloo +\d+ ok ", row) for row in table), output
    assert "gpu_check: PASS" in output


def outcome(status: str, **fields) -> dict:
    return {"status": status, "seconds": 0.1, **fields}


def test_the_ranks_agree_on_the_worst_outcome_and_name_the_first_error():
    agree = run_checks.agree
    passed = [
        outcome("ok", difference=0.0, bound=0.0, note=""),
        outcome("ok", difference=1e-9, bound=1e-8, note="k"),
    ]
    assert agree("c", "DDP", passed) | {"seconds": 0} == {
        "check": "c",
        "parallelism": "DDP",
        "status": "ok",
        "seconds": 0,
        "difference": 1e-9,
        "bound": 1e-8,
        "note": "k",
    }
    one_differs = [passed[0], outcome("FAIL", difference=2e-8, bound=1e-8, note="")]
    assert agree("c", "DDP", one_differs)["status"] == "FAIL"
    echo = outcome("ERROR", note="timed out", traceback="t0", raised_at=20.0)
    cause = outcome("ERROR", note="planted", traceback="t1", raised_at=10.0)
    row = agree("c", "DDP", [echo, cause])
    assert row["status"] == "ERROR" and row["note"] == "rank 1: planted"
    assert agree("c", "DDP", [passed[0], cause])["status"] == "ERROR"


@pytest.mark.parametrize("world, shape", [(2, (1, 2, 1)), (4, (1, 2, 2)), (8, (2, 2, 2))])
def test_the_3d_mesh_gives_dp_tp_then_pp_a_factor_two(world, shape):
    assert parallelism_checks.mesh_shape(world) == shape


JUNIT = """<testsuites><testsuite>
<testcase name="test_miniddp_on_one_rank_over_the_devices_backend_matches_torch_ddp[cuda]"/>
<testcase name="test_miniddp_on_two_ranks_over_gloo_matches_torch_ddp[cuda]">
  <failure message="AssertionError: rank 0: MiniDDP differs&#10;more">trace</failure></testcase>
<testcase name="test_send_recv_collectives_match_torch[cuda]">
  <skipped type="pytest.xfail" message="gloo's send/recv take host memory only"/></testcase>
<testcase name="test_the_pipeline_sends_cuda_tensors_over_gloo"/>
</testsuite></testsuites>"""


def test_the_cuda_tests_rows_come_from_pytests_report():
    rows = {row["check"]: row for row in gpu_check.junit_rows(JUNIT, "see tests.log")}
    assert [row["status"] for row in rows.values()] == ["ok", "FAIL", "xfail", "ok"]
    assert rows["MiniDDP on W = 2, gloo+CUDA"]["note"] == "AssertionError: rank 0: MiniDDP differs"
    assert {row["status"] for row in gpu_check.junit_rows(None, "timed out")} == {"not run"}
