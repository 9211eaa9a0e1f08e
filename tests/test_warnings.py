"""A fresh install prints no warning: the README's chapter, run under torchrun, says only what
the chapter says (no "Failed to initialize NumPy", no deprecation notices)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.harness.processes import child_env, run_in_own_session, tail

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_SECONDS = 240


def test_a_chapter_under_torchrun_prints_no_warning(tmp_path: Path) -> None:
    chapter = REPO / "tutorials" / "03_bucketing.py"  # the one `./launch.sh` runs
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", str(chapter)]  # fmt: skip
    returncode, output = run_in_own_session(command, child_env(tmp_path), TIMEOUT_SECONDS)
    assert returncode == 0, tail(output)
    warnings = [line for line in output.splitlines() if "warning" in line.lower()]
    assert not warnings, "\n".join(warnings)
