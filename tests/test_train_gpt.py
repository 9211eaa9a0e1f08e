"""Chapter 12's claims, on a tiny GPT under a real torchrun with 2 ranks: torch's DDP and ZeRO-1
train bit for bit as MiniDDP after every step, one process on the global batch lands within
the stated tolerance, and a run whose rank crashed, restarted by `torchrun --max-restarts`,
ends with the final validation loss and parameters of a run that never crashed, its torch's DDP
and fully_shard replicas resumed from their own checkpoints and still in step with MiniDDP.

Under `--precision bf16` (bf16 compute, fp32 masters): MiniDDP and fully_shard train bit for bit
as torch's own fully_shard with the same policy (where clipping never acts: --clip 1e9), their
bytes are the formula's, the checkpoints hold fp32 masters, the bf16 curve lies near the fp32
one trained beside it, and a crashed bf16 run resumes to the bits of one that never stopped.

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
ONE_PROCESS = re.compile(r"one process on the global batch .*? parameter gap (\S+) \(tolerance")
BF16_GAP = re.compile(r"step +\d+: bf16 (\S+)  fp32 (\S+)  gap (\S+)")
BF16_COST = re.compile(r"what bf16 cost: (\S+) nats per character")
# Clipping never acts, so every sum is a sum of two terms in both designs: bitwise at W = 2.
BF16 = ["--precision", "bf16", "--shard", "zero3", "--clip", "1e9"]


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


def unwrapped(output: str) -> str:
    """The output with say()'s line breaks undone (every run of whitespace one space)."""
    return " ".join(output.split())


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
    gap = float(ONE_PROCESS.search(unwrapped(uninterrupted)).group(1))
    assert 0.0 <= gap <= 1e-4  # the chapter's ONE_PROCESS_TOLERANCE
    assert "zero1 (fp32): each rank's bytes" in uninterrupted
    assert unwrapped(uninterrupted).count(": the formula, to the byte") == 2  # both ranks
    assert "Verified on 2 ranks" in uninterrupted


@pytest.mark.slow  # 21 s; tests/test_failover.py resumes bit-identically under torchrun too
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


@pytest.fixture(scope="module")
def bf16(tmp_path_factory: pytest.TempPathFactory) -> str:
    """MiniDDP and fully_shard in bf16 beside torch's fully_shard in bf16 and MiniDDP in fp32."""
    return torchrun(BF16, tmp_path_factory.mktemp("bf16"))


def test_bf16_miniddp_and_fully_shard_train_bit_for_bit_as_torchs_fully_shard(bf16: str) -> None:
    said = unwrapped(bf16)
    assert "Replicas, from the same weights: miniddp (bf16), torch-fsdp (bf16), fp32" in said
    assert "clipping acted in 0 of 6 steps" in said
    for compared in ("torch-fsdp against MiniDDP", "zero3 against torch's fully_shard"):
        assert f"{compared}: 6 steps, bit for bit after every one" in said, tail(bf16)
    assert "Verified on 2 ranks" in said


def test_bf16_bytes_per_rank_are_the_formulas_with_the_bf16_copies(bf16: str) -> None:
    """MiniDDP keeps a bf16 copy of every parameter between steps; fully_shard frees its
    gathered bf16 parameters after each use, so after the step it holds fp32 alone."""
    bf16 = unwrapped(bf16)
    assert "miniddp (bf16): each rank's bytes" in bf16
    assert "zero3 (bf16): each rank's bytes" in bf16
    assert bf16.count(": the formula, to the byte") == 4  # two designs, two ranks
    copies = re.findall(r"compute_copies (\S+ \S+)", bf16)
    assert len(copies) == 2 and copies[0] != "0 B"  # MiniDDP's, on both ranks; none for zero3


def test_bf16_checkpoint_holds_fp32_masters_and_costs_little_loss(bf16: str) -> None:
    assert "the checkpoints hold the fp32 masters" in unwrapped(bf16)
    gaps = [(float(b), float(f), float(g)) for b, f, g in BF16_GAP.findall(bf16)]
    assert len(gaps) == 3  # steps 0, 3 and 6
    assert all(abs(b - f - g) < 1e-3 for b, f, g in gaps)
    assert any(b != f for b, f, _ in gaps), "bf16 and fp32 curves equal: bf16 never computed?"
    assert abs(float(BF16_COST.search(bf16).group(1))) <= 0.05  # the chapter's BF16_LOSS_COST


@pytest.mark.slow
def test_crashed_bf16_run_ends_as_the_uninterrupted_one(bf16: str, tmp_path: Path) -> None:
    """As the fp32 crash test: every replica resumes from its own checkpoint (torch's
    fully_shard from torch's full state dicts), and all end on the bits of a run that never
    stopped, still bit for bit with torch's fully_shard."""
    output = torchrun([*BF16, "--crash-at-step", "4"], tmp_path, max_restarts=2)
    said = unwrapped(output)
    assert "resumed from step 3 (epoch 1, step 0 of it)" in said, tail(output)
    for compared in ("torch-fsdp against MiniDDP", "zero3 against torch's fully_shard"):
        assert f"{compared}: 6 steps, bit for bit after every one" in said, tail(output)
    assert final(output) == final(bf16)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_bf16_zero1_and_zero2_train_bit_for_bit_as_miniddp(stage: str, tmp_path: Path) -> None:
    """ZeRO-1 and ZeRO-2 over MiniDDP's mixed precision: fp32 masters, their AdamW state
    sharded (and ZeRO-2's fp32 gradients), bitwise MiniDDP's at W = 2 with clipping idle."""
    output = torchrun(["--precision", "bf16", "--shard", stage, "--clip", "1e9"], tmp_path)
    said = unwrapped(output)
    assert f"{stage} against MiniDDP: 6 steps, bit for bit after every one" in said, tail(output)
    assert f"{stage} (bf16): each rank's bytes" in said
    assert said.count(": the formula, to the byte") == 4  # MiniDDP's and the stage's, two ranks
