"""Chapter 08's template resumes from its checkpoint as if it had never stopped.

(That it runs at all on 2 ranks is tests/test_tutorials.py's, like every chapter.) Here: train
one epoch, stop, run again asking for two: the second run must say it resumed, train only the
second epoch, and end with the same weights and optimizer state, bit for bit, as a run that
trained both epochs at once. The template saves at epoch ends and its model has no randomness,
so nothing but a broken resume (a lost optimizer state, a sampler that forgot its epoch) can
make them differ.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

from tests.harness.pool import RankFailure, RankPool
from tests.harness.processes import child_env, run_in_own_session, tail

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "tutorials" / "08_template.py"
TIMEOUT_S = 120


def train(epochs: int, checkpoint: Path, tmp_path: Path) -> str:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(TEMPLATE),
        f"--epochs={epochs}",
        f"--checkpoint={checkpoint}",
    ]
    returncode, output = run_in_own_session(command, child_env(tmp_path), TIMEOUT_S)
    assert returncode == 0, f"the template exited with {returncode}:\n{tail(output)}"
    return output


@pytest.mark.slow  # 17 s; test_failover and test_train_gpt resume bit-identical too
def test_template_resumes_bit_identical_to_an_uninterrupted_run(tmp_path: Path) -> None:
    stopped, uninterrupted = tmp_path / "stopped.pt", tmp_path / "uninterrupted.pt"
    first = train(1, stopped, tmp_path)
    assert "fresh" in first and "epoch 1/1" in first
    resumed = train(2, stopped, tmp_path)
    assert f"resumed after epoch 1 from {stopped}" in resumed
    assert "epoch 1/2" not in resumed and "epoch 2/2" in resumed
    train(2, uninterrupted, tmp_path)

    ours, reference = (torch.load(p, weights_only=True) for p in (stopped, uninterrupted))
    assert ours["epochs_done"] == reference["epochs_done"] == 2
    for name, tensor in reference["model"].items():
        assert torch.equal(ours["model"][name], tensor), name
    for index, moments in reference["optimizer"]["state"].items():
        for key, tensor in moments.items():
            assert torch.equal(ours["optimizer"]["state"][index][key], tensor), (index, key)


def _template() -> ModuleType:
    spec = importlib.util.spec_from_file_location("template", TEMPLATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_where_only_rank_0_has_a_checkpoint(directory: str) -> int:
    """Pool task: each rank looks in a folder of its own, as on nodes without shared storage;
    only rank 0's holds a checkpoint (2 epochs done)."""
    template, rank = _template(), dist.get_rank()
    model = template.build_model()
    optimizer = torch.optim.AdamW(model.parameters())
    path = Path(directory) / f"rank{rank}" / "last.pt"
    if rank == 0:
        path.parent.mkdir(parents=True)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save({**state, "epochs_done": 2}, path)
    return template.load_checkpoint(str(path), model, optimizer, torch.device("cpu"))


def test_ranks_that_find_different_checkpoints_refuse_instead_of_hanging(
    pool2: RankPool, tmp_path: Path
) -> None:
    """Resumed from different epochs, the ranks would run different numbers of steps and hang
    in a collective the others never reach: both must raise at once, saying why."""
    outcomes = pool2.run_expecting_errors(
        load_where_only_rank_0_has_a_checkpoint, str(tmp_path), timeout=60
    )
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, RankFailure), f"rank {rank} resumed: {outcome}"
        assert outcome.type_name == "RuntimeError", outcome.traceback
        assert "different epochs (0 to 2)" in outcome.message, outcome.message
