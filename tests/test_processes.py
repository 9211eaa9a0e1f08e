"""The harness that runs ranks as torchrun's workers (tests/harness/processes.py) shows what
they printed when a run goes wrong: a chapter that fails or hangs must show its output."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.harness.processes import child_env, run_ranks_like_torchrun

# Rank 1 fails at once; rank 0 is still writing when it does (print, no flush: a file buffers).
FAILS_BESIDE_A_WRITER = """
import os, sys, time
from pathlib import Path
done = Path(sys.argv[1])
if os.environ["RANK"] == "1":
    done.touch()
    sys.exit(3)
print("rank 0 started")
while not done.exists():
    time.sleep(0.01)
time.sleep(0.5)
print("rank 0's last words")
"""

HANGS = """
import os, time
print(f"rank {os.environ['RANK']} is stuck here", flush=True)
time.sleep(60)
"""


def test_a_rank_still_writing_when_another_fails_keeps_its_output(tmp_path: Path) -> None:
    command = [sys.executable, "-c", FAILS_BESIDE_A_WRITER, str(tmp_path / "rank1-failed")]
    returncode, output = run_ranks_like_torchrun(command, 2, child_env(tmp_path), timeout=60)
    assert returncode == 3
    assert "rank 0 started" in output and "rank 0's last words" in output, output


def test_a_run_that_times_out_shows_every_ranks_output(tmp_path: Path) -> None:
    command = [sys.executable, "-c", HANGS]
    with pytest.raises(pytest.fail.Exception) as failure:
        run_ranks_like_torchrun(command, 2, child_env(tmp_path), timeout=6)
    message = str(failure.value)
    assert "timed out after 6 s" in message
    assert "rank 0 is stuck here" in message and "rank 1 is stuck here" in message, message
