"""Chapter 06's claim, checked from outside: a job whose rank crashed, restarted by a plain
`torchrun --max-restarts`, ends with exactly the parameters of a job that never crashed.

The crashed run is a real torchrun with 2 ranks and restarts, in a session of its own (a timeout
kills torchrun and every worker it started) and with its own TMPDIR (torchrun leaves a
torchelastic_* folder there). The runs that never restart start their 2 ranks as torchrun's
workers, without its agent (tests/harness/processes.py says why).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.harness.measurements import record_max
from tests.harness.processes import child_env, run_in_own_session, run_ranks_like_torchrun, tail

REPO = Path(__file__).resolve().parents[1]
CHAPTER = REPO / "tutorials" / "06_failover.py"
TIMEOUT_SECONDS = 90
SHA_LINE = re.compile(r"^final-params-sha256: ([0-9a-f]{64})$", re.MULTILINE)
# "+  0.030  rank0's collective failed: ..." in the chapter's failover timeline
TIMELINE = re.compile(r"\+\s*([\d.]+)\s+(rank0's collective failed|first step done)")


def torchrun(arguments: list[str], workdir: Path, max_restarts: int = 0) -> str:
    """Run the chapter on 2 ranks from `workdir`; return its output, failing on error. Under
    torchrun when it may restart them; else as torchrun's workers, without its agent."""
    temporary = workdir / "tmp"
    temporary.mkdir(parents=True, exist_ok=True)
    env = child_env(temporary)
    if max_restarts:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc_per_node=2", f"--max-restarts={max_restarts}"]
        command += [str(CHAPTER), *arguments]
        returncode, output = run_in_own_session(command, env, TIMEOUT_SECONDS, cwd=workdir)
    else:
        command = [sys.executable, str(CHAPTER), *arguments]
        returncode, output = run_ranks_like_torchrun(command, 2, env, TIMEOUT_SECONDS, workdir)
    assert returncode == 0, f"exit code {returncode}:\n{tail(output)}"
    return output


def final_sha(output: str) -> str:
    """The fingerprint the chapter prints once, as its last line."""
    found = SHA_LINE.findall(output)
    assert len(found) == 1, f"expected one final-params-sha256 line:\n{tail(output)}"
    assert SHA_LINE.match(output.strip().splitlines()[-1]), f"not the last line:\n{tail(output)}"
    return found[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A run without a crash, from a fresh folder with the default checkpoint directory."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    output = torchrun([], workdir)
    assert "attempt 0" in output and "No checkpoint in" in output, tail(output)
    return workdir, final_sha(output)


def test_crashed_and_restarted_run_ends_bit_identical(
    uninterrupted: tuple[Path, str], tmp_path: Path
) -> None:
    output = torchrun(
        ["--crash-at-step", "7", "--checkpoint-dir", str(tmp_path / "run")],
        tmp_path,
        max_restarts=2,
    )
    assert "[rank 1] exits abruptly after step 7" in output, tail(output)
    assert "torchrun attempt 1" in output, f"no restart happened:\n{tail(output)}"
    assert "Resumed from step 5 " in output, tail(output)
    assert final_sha(output) == uninterrupted[1]
    times = {what: float(seconds) for seconds, what in TIMELINE.findall(output)}
    if "rank0's collective failed" in times:
        record_max("failover: crash to survivor's error (s)", times["rank0's collective failed"])
    record_max("failover: crash to first step after restart (s)", times["first step done"])


def test_finished_checkpoint_is_reported_and_verified(uninterrupted: tuple[Path, str]) -> None:
    workdir, sha = uninterrupted
    default_checkpoint = workdir / "checkpoints" / "06_failover-2ranks-20steps" / "checkpoint.pt"
    assert default_checkpoint.is_file()
    output = torchrun([], workdir)
    assert "Resumed from step 20 " in output and "nothing left to train" in output, tail(output)
    assert final_sha(output) == sha
