"""Running torchrun (or launch.sh, or the ranks alone) as a child of a test: with a deadline, and
nothing left over.

Each run gets a session of its own, so a timeout kills torchrun and every worker it started, and
its own TMPDIR, because torchrun leaves a `torchelastic_*` folder there on every run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# After the first rank fails, how long the others get to end on their own (and finish writing
# their traceback) before they are killed.
GRACE_SECONDS = 5.0


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
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
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


def run_ranks_like_torchrun(
    command: list[str], nproc: int, env: dict[str, str], timeout: float, cwd: Path = REPO
) -> tuple[int, str]:
    """Start `nproc` copies of `command` with the variables `torchrun --standalone` gives its
    workers, without torchrun's agent: the agent imports torch once more before any rank
    starts, about 3 s a launch on this machine, which the suite would pay for every chapter.
    For scripts that need nothing of the agent (no restarts, no rendezvous of several nodes);
    the torchrun path itself is tested where it matters (launch.sh, chapters 06 and 07).

    Like torchrun, the first rank to fail ends the others (after GRACE_SECONDS to end on their
    own). Returns the first failing exit code (0 if none failed) and every rank's output, rank by
    rank; past `timeout`, fails showing the end of each rank's output so far."""
    with socket.socket() as probe:  # a free port for rank 0's store, as --standalone finds one
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    shared = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc)}
    shared |= {"LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_RANK": "0"}
    shared |= {"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}
    # Each rank writes its own file, unbuffered: a rank killed after another one failed keeps
    # everything it printed.
    shared |= {"PYTHONUNBUFFERED": "1"}
    # Files, not pipes: a rank that prints more than a pipe holds would block while we poll.
    logs = [tempfile.TemporaryFile("w+") for _ in range(nproc)]
    ranks = []
    for rank, log in enumerate(logs):
        rank_env = {**env, **shared, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        ranks.append(
            subprocess.Popen(
                command,
                cwd=cwd,
                env=rank_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    deadline, failed, timed_out = time.monotonic() + timeout, 0, False
    try:
        while any(rank.poll() is None for rank in ranks):
            now = time.monotonic()
            if now > deadline:
                timed_out = True
                break
            if not failed and (failed := next((r.returncode for r in ranks if r.poll()), 0)):
                deadline = min(deadline, now + GRACE_SECONDS)
            time.sleep(0.05)
        failed = failed or next((rank.returncode for rank in ranks if rank.returncode), 0)
    finally:
        for rank in ranks:
            if rank.poll() is None:
                os.killpg(rank.pid, signal.SIGKILL)
                rank.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    if timed_out and not failed:
        ends = [f"--- rank {r} ---\n{tail(text, 30)}" for r, text in enumerate(outputs)]
        pytest.fail(f"timed out after {timeout} s: {command} on {nproc} ranks\n" + "\n".join(ends))
    return failed, "\n".join(outputs)
