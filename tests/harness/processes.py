"""Running torchrun (or launch.sh) as a child of a test: with a deadline, and nothing left over.

Each run gets a session of its own, so a timeout kills torchrun and every worker it started, and
its own TMPDIR, because torchrun leaves a `torchelastic_*` folder there on every run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def child_env(tmp_dir: Path, drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """This environment, minus `drop`, with one compute thread per rank, its own TMPDIR, the
    repository importable, and this interpreter's python3/torchrun first on PATH."""
    env = {name: value for name, value in os.environ.items() if name not in drop}
    env.update(
        OMP_NUM_THREADS="1",
        TMPDIR=str(tmp_dir),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    )
    env.update(extra)
    return env


def run_in_own_session(
    command: list[str], env: dict[str, str], timeout: float, cwd: Path = REPO
) -> tuple[int, str]:
    """Run `command`; return its exit code and combined output. Past `timeout`, kill it all."""
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"timed out after {timeout} s: {command}\n{tail(output)}")
    finally:
        if process.poll() is None:  # interrupted (Ctrl-C): leave no workers behind
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, output


def tail(output: str, lines: int = 60) -> str:
    return "\n".join(output.splitlines()[-lines:])
