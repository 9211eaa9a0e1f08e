"""Chapter 12's claims, on a tiny GPT under a real torchrun with 2 ranks: torch's DDP and ZeRO-1
train bit for bit as MiniDDP after every step, one process on the global batch lands within
the stated tolerance, and a run whose rank crashed, restarted by `torchrun --max-restarts`,
ends with the final validation loss and parameters of a run that never crashed, its torch's DDP
and fully_shard replicas resumed from their own checkpoints and still in step with MiniDDP.

The chapter runs its own checks (asserts: exit code 0 means they held); these tests read what
it printed, so that a check the chapter skipped cannot pass silently.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.harness.processes import child_env, run_in_own_session, run_ranks_like_torchrun, tail

REPO = Path(__file__).resolve().parents[1]
CHAPTER = REPO / "tutorials" / "12_train_gpt.py"
TIMEOUT_SECONDS = 120
# A GPT of one block, width 32, context 16: ~10k parameters, ~1 s of training for 6 steps.
TINY = ["--steps", "6", "--layers", "1", "--width", "32", "--heads", "2", "--context", "16"]
TINY += ["--batch", "4", "--accum", "2", "--eval-every", "3", "--checkpoint-every", "3"]
# 1,100 characters: 61 training windows, an epoch of 3 steps, so the crash after step 4 resumes
# in the second epoch, mid-way, after set_epoch has reshuffled.
TINY += ["--max-characters", "1100", "--one-process-steps", "3"]
FINAL = re.compile(r"^final-val-loss: (\S+)\nfinal-params-sha256: ([0-9a-f]{64})$", re.MULTILINE)
ONE_PROCESS = re.compile(r"one process on the global batch .* parameter gap (\S+) \(tolerance")


def torchrun(arguments: list[str], workdir: Path, max_restarts: int = 0) -> str:
    """The chapter on 2 ranks from `workdir`, under torchrun if it may restart; its output,
    failing on a non-zero exit."""
    temporary = workdir / "tmp"
    temporary.mkdir(parents=True, exist_ok=True)
    chapter = [str(CHAPTER), *TINY, "--checkpoint-dir", str(workdir / "checkpoints"), *arguments]
    if max_restarts:  # restarts need torchrun's agent
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc_per_node=2", f"--max-restarts={max_restarts}", *chapter]
        returncode, output = run_in_own_session(
            command, child_env(temporary), TIMEOUT_SECONDS, cwd=workdir
        )
    else:  # its workers alone: 3 s sooner (tests/harness/processes.py)
        command = [sys.executable, *chapter]
        returncode, output = run_ranks_like_torchrun(
            command, 2, child_env(temporary), TIMEOUT_SECONDS, cwd=workdir
        )
    assert returncode == 0, f"exit code {returncode}:\n{tail(output)}"
    return output


def final(output: str) -> tuple[str, str]:
    """(final validation loss, parameters' SHA-256): the chapter's last two lines."""
    found = FINAL.findall(output)
    assert len(found) == 1, f"expected the final two lines once:\n{tail(output)}"
    return found[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    """MiniDDP beside torch's DDP and ZeRO-1, never interrupted."""
    return torchrun(["--shard", "zero1"], tmp_path_factory.mktemp("uninterrupted"))


def test_torch_ddp_and_zero1_train_bit_for_bit_as_miniddp(uninterrupted: str) -> None:
    for name in ("torch", "zero1"):
        assert f"{name} against MiniDDP: 6 steps, bit for bit after every one" in uninterrupted
    gap = float(ONE_PROCESS.search(uninterrupted).group(1))
    assert 0.0 <= gap <= 1e-4  # the chapter's ONE_PROCESS_TOLERANCE
    assert "zero1: each rank's bytes" in uninterrupted
    assert uninterrupted.count(": the formula, to the byte") == 2  # both ranks
    assert "Verified on 2 ranks" in uninterrupted


def test_crashed_and_restarted_run_ends_as_the_uninterrupted_one(
    uninterrupted: str, tmp_path: Path
) -> None:
    """Rank 1 dies after step 4; torchrun restarts both, and they resume from step 3's
    checkpoints. MiniDDP's run does not depend on which replicas train beside it (every
    micro-step reseeds the generator), so the uninterrupted run with ZeRO-1 is the reference.
    fully_shard clips by a norm summed over shards, so it agrees within the chapter's tolerance
    (which the chapter asserts): here it must also have been compared at every step."""
    output = torchrun(["--crash-at-step", "4", "--shard", "zero3"], tmp_path, max_restarts=2)
    assert "[rank 1] exits abruptly after step 4" in output
    assert "torchrun attempt 1" in output, tail(output)
    assert "resumed from step 3 (epoch 1, step 0 of it)" in output, tail(output)
    assert "torch against MiniDDP: 6 steps, bit for bit after every one" in output
    assert "zero3 against MiniDDP: 6 steps" in output
    assert final(output) == final(uninterrupted)
