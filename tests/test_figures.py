"""`python -m miniddp.figures --out DIR` draws every figure the README shows, as valid PNGs.

It runs the command as a reader would (the 4-rank job it spawns, and chapter 04 under torchrun
with --plot), into a fresh folder, with a deadline.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib.image

from tests.harness.processes import child_env, run_in_own_session, tail

REPO = Path(__file__).resolve().parents[1]
FIGURES = [
    "00_accumulation.png",
    "01_messages.png",
    "03_buckets.png",
    "04_timelines.png",
    "04_sweep.png",
    "14_pipeline.png",
]
TIMEOUT_SECONDS = 300


def test_the_figures_command_draws_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "figures"
    command = [sys.executable, "-m", "miniddp.figures", "--out", str(out), "--iters", "3"]
    returncode, output = run_in_own_session(command, child_env(tmp_path), TIMEOUT_SECONDS)
    assert returncode == 0, tail(output)
    for name in FIGURES:
        pixels = matplotlib.image.imread(out / name)  # raises unless it is a readable PNG
        height, width = pixels.shape[:2]
        assert height > 200 and width > 400, (name, pixels.shape)


def test_the_committed_figures_are_the_ones_the_command_draws() -> None:
    committed = sorted(path.name for path in (REPO / "docs" / "figures").glob("*.png"))
    assert committed == sorted(FIGURES)
