"""`python -m miniddp.bench step`: the interleaving, the paired statistics, and one tiny real run;
and how every bench command refuses a bad option: in the launcher, before it relaunches itself
under torchrun, once, naming the option, the value and what would do.

No timing is asserted: this machine is shared. The run checks what the report contains.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

import miniddp.instruments.bench.__main__ as bench
from miniddp.instruments.bench.paired import paired_ratio, paired_ratio_interval, quantile, rotated
from miniddp.instruments.bench.step import targets
from miniddp.instruments.bench.variants import VARIANTS
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


def test_every_target_is_the_projects_goal_against_torch():
    """One goal: each MiniDDP variant at most 1.05x torch's DDP at the same settings (a tie
    within the benchmark's interval); ablations and overlap are figures, not targets."""
    result = {
        "model": "mlp",
        "wall_s": {
            "miniddp": [1.0, 1.0],
            "torch": [1.0, 0.9],
            "miniddp-1": [0.9, 0.9],
            "torch-1": [1.0, 1.0],
            "deferred-1": [1.0, 1.0],
        },
        "cpu_s": {"miniddp": [1.2, 1.2], "torch": [1.0, 1.0]},
        "rows": {
            "miniddp": {"cpu_vs_reference": 1.2, "reference": "torch"},
            "miniddp-1": {"overlap": 0.8, "reference": "torch-1"},
            "deferred-1": {"reference": "torch-1"},
            "torch": {"reference": "torch"},
        },
    }
    checks = targets([result])
    found = {c["what"]: (round(c["value"], 3), c["met"]) for c in checks}
    assert found == {
        "miniddp / torch": (pytest.approx(1.056), False),  # median of 1.0 and 1.11
        "CPU miniddp / torch": (1.2, False),
        "miniddp-1 / torch-1": (0.9, True),
    }
    assert {c["target"] for c in checks} == {"<= 1.05"}


def test_the_interval_of_a_paired_median_narrows_with_more_iterations():
    theirs = [1.0] * 100
    ours = [1.0 + i / 100 for i in range(100)]  # ratios 1.00 .. 1.99, median 1.495
    assert paired_ratio_interval(ours, theirs) == (pytest.approx(1.40), pytest.approx(1.59))
    assert paired_ratio_interval(ours[::4], theirs[::4]) == (  # 25 ratios: 1.00, 1.04, ...
        pytest.approx(1.28),
        pytest.approx(1.68),
    )
    assert paired_ratio_interval([2.0], [1.0]) == (2.0, 2.0)


@pytest.mark.slow  # 17 s, a whole benchmark; its arithmetic and refusals are tested above
def test_a_tiny_run_reports_every_variant_with_paired_ratios(tmp_path):
    report_path = tmp_path / "step.json"
    command = [
        sys.executable,
        "-m",
        "miniddp.bench",
        "step",
        "--models",
        "deep",
        "--variants",
        "miniddp,naive",
        "--iters",
        "2",
        "--trace-iters",
        "1",
        "--json",
        str(report_path),
    ]
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
    assert checked == {"miniddp / torch", "CPU miniddp / torch"}  # naive is no target
    assert len(report["load_average_before"]) == 3
    for line in ("deep:", "targets (paired medians over iterations", "load average"):
        assert line in output


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What `python -m miniddp.bench ARGV` prints when it exits 2, as argparse does."""
    with pytest.raises(SystemExit) as exited:
        bench.main(argv)
    assert exited.value.code == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    return printed.err


@pytest.fixture
def no_relaunch(monkeypatch: pytest.MonkeyPatch) -> None:
    """As run by a user, outside torchrun: a relaunch would come after the checks, so none may."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MINIDDP_LINK"):
        monkeypatch.delenv(name, raising=False)

    def relaunch(*_) -> None:
        raise AssertionError("relaunched under torchrun before refusing the options")

    monkeypatch.setattr(bench, "relaunch_under_torchrun", relaunch)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["step", "--iters", "0"], "argument --iters: 0 is too small; give a whole number >= 1"),
        (
            ["step", "--iters", "ten"],
            "argument --iters: 'ten' is not a whole number; give one >= 1",
        ),
        (
            ["step", "--trace-iters", "-1"],
            "argument --trace-iters: -1 is too small; give a whole number >= 0",
        ),
        (
            ["step", "--models", "mlp,bert"],
            "--models: unknown 'bert'; choose from mlp, transformer, deep, gpt",
        ),
        (["step", "--variants", "miniddp,torch-2"], "--variants: unknown 'torch-2'; choose from"),
        (
            ["step", "--link", "alpha=200us,bandwidth=0"],
            "argument --link: cannot read the link "
            "'alpha=200us,bandwidth=0': bandwidth=0 is zero; bandwidth must be a rate > 0",
        ),
        (
            ["sharding", "--width", "0"],
            "argument --width: 0 is too small; give a whole number >= 1",
        ),
        (
            ["sharding", "--depth", "-2"],
            "argument --depth: -2 is too small; give a whole number >= 1",
        ),
        (
            ["sharding", "--batch", "0"],
            "argument --batch: 0 is too small; give a whole number >= 1",
        ),
        (
            ["sharding", "--iters", "-1"],
            "argument --iters: -1 is too small; give a whole number >= 0",
        ),
        (
            ["collectives", "--iters", "0"],
            "argument --iters: 0 is too small; give a whole number >= 1",
        ),
        (
            ["collectives", "--sizes", "4K,6"],
            "argument --sizes: '6' is not a size in bytes > 0 and a "
            "multiple of 4 (float32); give sizes like 4K,16K",
        ),
        (["collectives", "--sizes", "4K,lots"], "argument --sizes: 'lots' is not a size in bytes"),
        (["stpe", "--iters", "3"], "unknown command 'stpe'"),
    ],
)
def test_a_bad_option_is_refused_once_before_the_relaunch(
    argv: list[str], message: str, no_relaunch: None, capsys: pytest.CaptureFixture[str]
) -> None:
    printed = refusal(argv, capsys)
    assert printed.count(message) == 1, printed


def test_a_bad_miniddp_link_is_refused_naming_the_variable(
    no_relaunch: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MINIDDP_LINK", "alpha=1ms")
    printed = refusal(["step"], capsys)
    assert printed.count("$MINIDDP_LINK (the default of --link): cannot read the link") == 1
    assert "bandwidth is missing" in printed


@pytest.mark.parametrize("command", ["step", "sharding", "collectives"])
def test_an_output_file_that_cannot_be_written_is_refused_before_the_run(
    command: str, tmp_path: Path, no_relaunch: None, capsys: pytest.CaptureFixture[str]
) -> None:
    missing_folder = tmp_path / "no such folder" / "report.json"
    printed = refusal([command, "--json", str(missing_folder)], capsys)
    assert printed.count(f"argument --json: cannot write the file '{missing_folder}'") == 1
    assert f"there is no folder '{missing_folder.parent}'" in printed
    printed = refusal([command, "--json", str(tmp_path)], capsys)
    assert f"'{tmp_path}' is a folder; give a file name in a folder you can write to" in printed


def test_a_trace_folder_under_a_file_is_refused(
    tmp_path: Path, no_relaunch: None, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    printed = refusal(["step", "--trace-dir", str(a_file / "traces")], capsys)
    assert printed.count(f"'{a_file}' is a file, not a folder; give a folder you can write") == 1


def test_under_torchrun_only_rank_0_says_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Launched by torchrun directly, every rank checks; rank 1 exits as rank 0 does, silently."""
    torchrun = dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="x", MASTER_PORT="1")
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    assert refusal(["step", "--iters", "0"], capsys) == ""
    monkeypatch.setenv("RANK", "0")
    assert refusal(["step", "--iters", "0"], capsys).count("argument --iters: 0 is too small") == 1


def test_iters_0_is_refused_at_once_not_after_the_relaunch(tmp_path: Path) -> None:
    """The reported case, run as a user runs it: it ended after 22 s in a StatisticsError on
    every rank. Now the one process exits 2 with argparse's message, never reaching torchrun."""
    command = [sys.executable, "-m", "miniddp.bench", "step", "--iters", "0"]
    returncode, output = run_in_own_session(command, child_env(tmp_path), timeout=120)
    assert returncode == 2, output
    assert output.count("argument --iters: 0 is too small; give a whole number >= 1") == 1
    assert "torch.distributed.run" not in output and "Traceback" not in output, output
