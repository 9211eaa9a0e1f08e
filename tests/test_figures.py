"""`python -m miniddp.figures --out DIR` draws every figure the README shows, as valid PNGs.

It runs the command as a reader would (the 4-rank job it spawns, and chapter 04 under torchrun
with --plot), into a fresh folder, with a deadline. A folder it cannot write in, and every other
bad option, is refused before anything runs, once, saying what to give instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib.image
import pytest

from miniddp.instruments.figures import __main__ as command
from miniddp.instruments.figures.__main__ import FIGURE_SETS
from miniddp.instruments.figures.__main__ import main as figures
from tests.harness.processes import child_env, run_in_own_session, tail

REPO = Path(__file__).resolve().parents[1]
FIGURES = [
    "00_accumulation.png",
    "01_messages.png",
    "02_data_parallel.png",
    "03_buckets.png",
    "04_timelines.png",
    "04_sweep.png",
    "05_no_sync.png",
    "06_failover.png",
    "11_memory.png",
    "11_prefetch.png",
    "11c_memory.png",
    "13_tensor_parallel.png",
    "14_pipeline.png",
    "14b_schedules.png",
    "16_three_d.png",
    "15_ring_attention.png",
]
# Drawn only with --only 12: chapter 12's 3-minute training run (its claims: test_train_gpt.py);
# with --only 18 and --only 19, chapters 18's and 19's runs on 4 ranks (their claims:
# test_expert_parallel.py, test_local_sgd.py, test_tutorials.py).
ON_REQUEST = ["12_loss.png", "18_experts.png", "19_across_the_internet.png"]
TIMEOUT_SECONDS = 300


@pytest.mark.slow  # 25 s: run it (pytest -m slow) after changing a figure
def test_the_figures_command_draws_every_figure(tmp_path: Path) -> None:
    """Every set but chapter 04's, whose figures the chapter draws itself with --plot: that
    timed run is tests/test_tutorials.py's (chapter 04 with --plot)."""
    out = tmp_path / "figures"
    sets = ",".join(s for s in FIGURE_SETS if s != "04")
    command = [sys.executable, "-m", "miniddp.figures", "--out", str(out), "--only", sets]
    returncode, output = run_in_own_session(command, child_env(tmp_path), TIMEOUT_SECONDS)
    assert returncode == 0, tail(output)
    for name in (name for name in FIGURES if not name.startswith("04_")):
        pixels = matplotlib.image.imread(out / name)  # raises unless it is a readable PNG
        height, width = pixels.shape[:2]
        assert height > 200 and width > 400, (name, pixels.shape)


def test_the_committed_figures_are_the_ones_the_command_draws() -> None:
    committed = sorted(path.name for path in (REPO / "docs" / "figures").glob("*.png"))
    assert committed == sorted(FIGURES + ON_REQUEST)


def test_every_chapter_the_command_runs_is_found() -> None:
    """The chapters it runs under torchrun are named from the repository's root: when the
    module moved one folder down, --only 18 looked for miniddp/tutorials/18_experts.py."""
    chapters = [value for name, value in vars(command).items() if name.startswith("CHAPTER_")]
    paths = [path for path in chapters if isinstance(path, Path)]
    assert len(paths) == 6 and all(path.is_file() for path in paths), paths


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        figures(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_an_out_that_is_a_file_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """As a reader runs it: one message from argparse, no traceback, nothing drawn."""
    a_file = tmp_path / "figures.png"
    a_file.write_bytes(b"")
    command = [sys.executable, "-m", "miniddp.figures", "--out", str(a_file)]
    returncode, output = run_in_own_session(command, child_env(tmp_path), timeout=120)
    assert returncode == 2, tail(output)
    message = (
        f"argument --out: cannot write files in '{a_file}': '{a_file}' is a file, not a folder"
    )
    assert output.count(message) == 1, output
    assert "give a folder you can write to (it is made if missing)" in output
    assert "Traceback" not in output


def test_an_out_below_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    printed = refusal(["--out", str(a_file / "figures")], capsys)
    assert printed.count(f"'{a_file}' is a file, not a folder; give a folder you can write") == 1


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_out_where_no_file_can_be_made_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """/proc takes no new files, not even from root, for whom permission bits say nothing."""
    printed = refusal(["--out", "/proc/figures"], capsys)
    assert (
        printed.count("cannot write files in '/proc/figures': no file can be made in '/proc'") == 1
    )
    assert not Path("/proc/figures").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--only", "01,99"],
            "argument --only: unknown figure set '99'; choose from 00, 01, 02,",
        ),
        (["--iters", "0"], "argument --iters: 0 is too small; give a whole number >= 1"),
    ],
)
def test_other_bad_options_are_refused_without_making_the_folder(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "figures"
    assert refusal(["--out", str(out), *argv], capsys).count(message) == 1
    assert not out.exists()


def test_the_three_d_figure_draws_the_mesh_and_a_step(tmp_path: Path) -> None:
    """Chapter 16b's figure from a step made up here (the 8-rank job that records a real one is
    the slow test's): its groups are the mesh's, and it is a readable PNG."""
    from miniddp.instruments.figures import three_d
    from miniddp.pipeline.bubble import Block

    groups = three_d.groups_of((2, 2, 2))
    assert groups == {  # miniddp/mesh.py's docstring draws these
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    }
    steps = []
    for rank in range(8):
        stage = rank // 4
        blocks = [Block(stage, "F", 0, 0.01 * stage, 0.01 * stage + 0.01, stage)]
        blocks.append(Block(stage, "B", 0, 0.03 - 0.01 * stage, 0.05 - 0.01 * stage, stage))
        wire = [
            three_d.WireEvent("tp", "all_reduce", 512, 2048, 0.012, 0.013),
            three_d.WireEvent("pp", "send", 512, 2048, 0.02),
            three_d.WireEvent("dp", "all_reduce", 14_000, 56_000, 0.045, 0.05),
        ]
        coordinate = [stage, rank // 2 % 2, rank % 2]
        steps.append(three_d.RankStep(rank, coordinate, blocks, [(0.0, 0.01)], wire))
    path = three_d.mesh_and_step(steps, tmp_path / "16_three_d.png")
    height, width = matplotlib.image.imread(path).shape[:2]
    assert height > 200 and width > 400


def test_the_experts_figure_draws_its_four_panels(tmp_path: Path) -> None:
    """Chapter 18's figure from numbers made up here (the chapter's own run is `--only 18`):
    a readable PNG, and the running mean its training curves are drawn with."""
    from miniddp.instruments.figures import experts

    assert experts.running_mean([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]
    steps = [0.5 - 0.001 * s for s in range(30)]
    path = experts.experts(
        [[3, 1, 0, 4], [0, 2, 5, 1]],
        {0.5: (0.4, 0.3), 1.0: (0.2, 0.1)},
        {"aux loss x 0.0": steps, "aux loss x 0.01": [s / 2 for s in steps]},
        {"aux loss x 0.0": steps, "aux loss x 0.01": steps},
        tmp_path / "18_experts.png",
    )
    height, width = matplotlib.image.imread(path).shape[:2]
    assert height > 200 and width > 400
