"""launch.sh refuses a bad NPROC at once, with a usage error, before torch is even imported
(torchrun itself took ~5 s to end in a bare AssertionError)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("nproc", ["0", "-1", "two", "1.5", " 2"])
def test_launch_sh_refuses_nproc_that_is_not_a_positive_integer(nproc: str) -> None:
    env = dict(os.environ, NPROC=nproc)
    launcher = subprocess.run(
        ["./launch.sh", "tutorials/02_naive_ddp.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert launcher.returncode == 2, launcher.stdout + launcher.stderr
    assert f"NPROC is the number of processes per node, a positive integer (got '{nproc}')" in (
        launcher.stderr
    )
    assert "see ./launch.sh --help" in launcher.stderr and launcher.stdout == ""
