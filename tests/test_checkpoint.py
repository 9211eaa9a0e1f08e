"""Checkpoints: a resume continues bit for bit, a crash mid-write keeps the previous checkpoint,
and a broken or foreign file is a clear error naming it, never code run from it.

Most tests run in this process without a process group (the library then acts as one rank);
those about several ranks use the shared two-rank pool.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch
from torch import nn

import miniddp.checkpoint.save_load as checkpoint_module
from miniddp.checkpoint import (
    CheckpointError,
    Progress,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from tests import checkpoint_tasks
from tests.harness.pool import RankFailure, RankPool

REPO = Path(__file__).resolve().parents[1]


def new_training(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model with dropout (so the RNG matters) and Adam (so optimizer state matters)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 1))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    inputs = torch.linspace(-1, 1, 32).reshape(8, 4)
    for _ in range(steps):
        optimizer.zero_grad()
        model(inputs).pow(2).mean().backward()
        optimizer.step()


def every_draw() -> list[float]:
    """One number from each global generator a checkpoint restores."""
    numbers = [torch.rand(1).item(), random.random()]
    return numbers + [float(numpy.random.rand())]


def parameters(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_resume_continues_bit_for_bit(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    model, optimizer = new_training(seed=0)
    train(model, optimizer, steps=3)
    save_checkpoint(path, model, optimizer, Progress(3, 1, 2), extra={"note": "hello"})
    draws_after_save = every_draw()
    train(model, optimizer, steps=3)
    uninterrupted = parameters(model)

    resumed, resumed_optimizer = new_training(seed=1)  # other weights, other RNG state
    random.seed(1)
    numpy.random.seed(1)
    loaded = load_checkpoint(path, resumed, resumed_optimizer)
    assert loaded.progress == Progress(step=3, epoch=1, batches_done=2)
    assert loaded.extra == {"note": "hello"}
    assert (loaded.saved_world_size, loaded.rng_restored) == (1, True)
    assert every_draw() == draws_after_save
    train(resumed, resumed_optimizer, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(parameters(resumed), uninterrupted))


def test_optimizer_state_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    model, optimizer = new_training(seed=0)
    train(model, optimizer, steps=2)
    save_checkpoint(path, model, optimizer, Progress(2, 0, 2))
    fresh, fresh_optimizer = new_training(seed=0)
    load_checkpoint(path, fresh, fresh_optimizer)
    saved, restored = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert saved["param_groups"] == restored["param_groups"]
    for index, state in saved["state"].items():
        for name, value in state.items():
            assert torch.equal(value, restored["state"][index][name]), (index, name)


def test_write_that_fails_midway_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.pt"
    model, optimizer = new_training(seed=0)
    save_checkpoint(path, model, optimizer, Progress(1, 0, 1))

    def disk_full_halfway(obj, file) -> None:
        file.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module.torch, "save", disk_full_halfway)
    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        save_checkpoint(path, model, optimizer, Progress(2, 0, 2))
    monkeypatch.undo()
    assert read_checkpoint(path)["progress"]["step"] == 1
    assert list(tmp_path.iterdir()) == [path], "the temporary file was left behind"


# Saves step 1, then dies (os._exit, as a kill would) with half of step 2's file written.
KILLED_MID_WRITE = """
import io, os, sys
import torch
from torch import nn
from miniddp.checkpoint import Progress, save_checkpoint

model = nn.Linear(3, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
save_checkpoint(sys.argv[1], model, optimizer, Progress(1, 0, 1))
real_save = torch.save

def die_halfway(obj, file):
    whole = io.BytesIO()
    real_save(obj, whole)
    file.write(whole.getvalue()[: len(whole.getvalue()) // 2])
    file.flush()
    os._exit(3)

torch.save = die_halfway
save_checkpoint(sys.argv[1], model, optimizer, Progress(2, 0, 2))
"""


def test_process_killed_mid_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=python_path)
    writer = subprocess.run(
        [sys.executable, "-c", KILLED_MID_WRITE, str(path)], env=env, timeout=120, check=False
    )
    assert writer.returncode == 3
    leftovers = [p for p in tmp_path.iterdir() if p != path]
    assert len(leftovers) == 1 and leftovers[0].name.endswith(".tmp"), leftovers
    assert read_checkpoint(path)["progress"]["step"] == 1

    model = nn.Linear(3, 2)
    save_checkpoint(path, model, torch.optim.SGD(model.parameters(), lr=0.1), Progress(3, 0, 3))
    assert list(tmp_path.iterdir()) == [path], "the next save should clear the leftover"


def test_every_rank_gets_its_own_rng_state_back(pool2: RankPool, tmp_path: Path) -> None:
    results = pool2.run(checkpoint_tasks.rng_round_trip, str(tmp_path / "checkpoint.pt"))
    for rank, (after_save, after_load) in enumerate(results):
        assert after_save == after_load, f"rank {rank} did not get its own RNG state back"
    assert results[0][0] != results[1][0], "the ranks were seeded differently"
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["checkpoint.pt", "checkpoint.pt.rng/rank1.pt"], "rank 1 writes its own"


def test_resume_with_another_world_size_is_refused_unless_allowed(
    pool2: RankPool, tmp_path: Path
) -> None:
    path = tmp_path / "checkpoint.pt"
    pool2.run(checkpoint_tasks.rng_round_trip, str(path))
    model = nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match="saved by 2 ranks and this job has 1"):
        load_checkpoint(path, model)
    loaded = load_checkpoint(path, model, allow_world_size_change=True)
    assert (loaded.saved_world_size, loaded.rng_restored) == (2, False)
    assert loaded.progress == Progress(step=4, epoch=1, batches_done=2)


def test_bucket_layout_is_restored(pool2: RankPool, tmp_path: Path) -> None:
    results = pool2.run(checkpoint_tasks.bucket_layout_round_trip, str(tmp_path / "c.pt"))
    for trained, restored in results:
        assert len(trained) > 1 and restored == trained


def test_failed_write_on_rank0_raises_on_every_rank(pool2: RankPool, tmp_path: Path) -> None:
    outcomes = pool2.run_expecting_errors(
        checkpoint_tasks.save_where_rank0_cannot_write, str(tmp_path)
    )
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, RankFailure), f"rank {rank} did not raise"
        assert outcome.type_name == "CheckpointError", outcome
        assert f"Rank 0 could not write the checkpoint {tmp_path}" in outcome.message


def test_torchs_rank0_idiom_saves_and_every_rank_resumes(pool2: RankPool, tmp_path: Path) -> None:
    """`if rank == 0: save_checkpoint(...)`; `dist.barrier()`; load on every rank. Rank 0 used
    to raise CheckpointError after ~35 s (rank 1 sat in a barrier MiniDDP cannot see). Now rank
    0 writes model, optimizer, progress and its RNG state; every rank resumes them exactly, and
    rank 0 alone says, once, that rank 1's RNG state is not in the checkpoint."""
    results = pool2.run(checkpoint_tasks.rank0_idiom, str(tmp_path / "checkpoint.pt"))
    for rank, result in enumerate(results):
        assert all(torch.equal(a, b) for a, b in zip(result["saved"], result["loaded"]))
        saved, loaded = result["saved_optimizer"], result["loaded_optimizer"]
        for index, state in saved["state"].items():
            assert all(torch.equal(v, loaded["state"][index][k]) for k, v in state.items())
        assert result["progress"] == Progress(step=2, epoch=0, batches_done=2)
        assert result["ranks_without_rng"] == (1,)
        assert result["rng_restored"] == result["same_draws"] == (rank == 0)
    [warning] = results[0]["warnings"]
    assert "saved by rank 0 alone" in warning and "rank 1" in warning
    assert results[1]["warnings"] == []


def test_saving_an_unconsolidated_zero_optimizer_says_so_on_every_rank(
    pool2: RankPool, tmp_path: Path
) -> None:
    """It was a plain RuntimeError on rank 0, and rank 1 then blamed uneven steps."""
    outcomes = pool2.run_expecting_errors(
        checkpoint_tasks.save_with_unconsolidated_zero, str(tmp_path / "zero.pt")
    )
    for outcome in outcomes:
        assert isinstance(outcome, RankFailure) and outcome.type_name == "CheckpointError"
        assert "consolidate_state_dict(to=0) on every rank" in outcome.message


def test_the_rank0_idiom_after_an_every_rank_save_restores_no_stale_rng_file(
    pool2: RankPool, tmp_path: Path
) -> None:
    """Rank 1's RNG file on disk is step 1's; the checkpoint is step 2's, saved by rank 0 alone.
    Restoring that file would rewind rank 1's dropout masks to step 1, silently: the file is
    marked with the save it belongs to, and rank 1 keeps its own state."""
    path = str(tmp_path / "checkpoint.pt")
    results = pool2.run(checkpoint_tasks.rank0_idiom_after_an_every_rank_save, path)
    assert [r["step"] for r in results] == [2, 2]
    assert results[0]["rng_restored"]  # its own, saved just now
    assert results[1]["rng_restored"] is False
    assert results[1]["ranks_without_rng"] == (1,)
    assert results[1]["kept_its_own_stream"]


def test_a_slow_rng_write_on_rank_1_is_not_taken_for_a_rank_0_save(
    pool2: RankPool, tmp_path: Path
) -> None:
    """Every rank saved: the checkpoint is complete, however late rank 1's RNG file lands."""
    results = pool2.run(checkpoint_tasks.every_rank_saves_rank_1_slowly, str(tmp_path / "c.pt"))
    for rank, result in enumerate(results):
        assert result["rng_restored"], f"rank {rank}"
        assert result["ranks_without_rng"] == (), f"rank {rank}"
        assert result["warnings"] == [], f"rank {rank}: {result['warnings']}"
