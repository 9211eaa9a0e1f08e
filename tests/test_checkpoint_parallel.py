"""Checkpoints of every parallelism: a tensor-parallel model, a pipeline stage and DP x TP x PP
each get their own state back, bit for bit, on every rank.

Before, rank 0 wrote its own model and optimizer state for all, and every rank loaded it: the
shapes match, so rank 1 resumed, silently, on rank 0's shard or stage. Now a checkpoint holds
the unsplit model (TP's full tensors, every stage keyed by index), so the references are the
state each rank held just before saving, and one process holding the unsplit model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from miniddp.checkpoint import CheckpointError, load_checkpoint, read_checkpoint
from tests import checkpoint_parallel_tasks as tasks
from tests.harness.pool import PROCESS_GROUP_TIMEOUT_S, RankPool

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def same_bits(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two of `state_of`'s results hold the same parameters and optimizer state, bit for bit."""
    if a["params"].keys() != b["params"].keys() or a["optimizer"].keys() != b["optimizer"].keys():
        return False
    params = all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    moments = all(
        a["optimizer"][i].keys() == b["optimizer"][i].keys()
        and all(torch.equal(v, b["optimizer"][i][name]) for name, v in a["optimizer"][i].items())
        for i in a["optimizer"]
    )
    return params and moments


def assert_each_rank_got_its_own(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert same_bits(result["saved"], result["loaded"]), f"rank {rank} got another's state"


def unsplit(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """The one-process model's parameters and AdamW state, from the TP ranks' `state_of`: a
    shard's entries concatenated along its split dim, a replicated one taken from rank 0."""
    names = list(shards[0]["params"])
    params, moments = {}, {}
    for index, name in enumerate(names):
        dim = tasks.SPLIT_DIMS.get(name)
        pieces = [shard["params"][name] for shard in shards]
        params[name] = pieces[0] if dim is None else torch.cat(pieces, dim)
        moments[index] = dict(shards[0]["optimizer"][index])
        for moment in ADAM_MOMENTS:
            pieces = [shard["optimizer"][index][moment] for shard in shards]
            moments[index][moment] = pieces[0] if dim is None else torch.cat(pieces, dim)
    return {"params": params, "optimizer": moments}


def chunk_of(full: dict[str, Any], world_size: int, rank: int) -> dict[str, Any]:
    """What rank `rank` of a TP group of `world_size` holds of the unsplit `full`."""

    def cut(name: str, tensor: torch.Tensor) -> torch.Tensor:
        dim = tasks.SPLIT_DIMS.get(name)
        return tensor if dim is None else torch.chunk(tensor, world_size, dim)[rank]

    names = list(full["params"])
    return {
        "params": {name: cut(name, t) for name, t in full["params"].items()},
        "optimizer": {
            index: {k: cut(names[index], v) if k in ADAM_MOMENTS else v for k, v in state.items()}
            for index, state in full["optimizer"].items()
        },
    }


def test_tensor_parallel_round_trip_gives_each_rank_its_own_shards(
    rank_pools: Callable[[int], RankPool], tmp_path: Path
) -> None:
    """Rank 1 used to resume on rank 0's shards (and rank 0's exp_avg, exp_avg_sq)."""
    results = rank_pools(2).run(tasks.tp_round_trip, str(tmp_path / "tp.pt"))
    assert not torch.equal(
        results[0]["saved"]["params"]["0.weight"], results[1]["saved"]["params"]["0.weight"]
    )
    assert_each_rank_got_its_own(results)


@pytest.mark.slow  # 11 s, a 4-rank job; the per-rank TP round trip runs by default
def test_a_tensor_parallel_checkpoint_holds_the_unsplit_model_and_resumes_at_tp_1_and_4(
    rank_pools: Callable[[int], RankPool], tmp_path: Path
) -> None:
    """Saved at TP = 2, the file is the unsplit model's state dict: one process (TP = 1) loads
    it into the plain block, and TP = 4 cuts its own chunks from it. Both compute what the TP =
    2 model computed."""
    path = tmp_path / "tp.pt"
    saved = rank_pools(2).run(tasks.tp_round_trip, str(path))
    full = unsplit([result["saved"] for result in saved])

    one_process = tasks.block(seed=3)
    optimizer = tasks.adamw(one_process)
    load_checkpoint(path, one_process, optimizer, allow_world_size_change=True)
    assert same_bits(tasks.state_of(one_process, optimizer), full)
    with torch.no_grad():
        output = one_process(tasks.inputs(1))
    torch.testing.assert_close(output, saved[0]["output"], rtol=0, atol=1e-6)

    resumed = rank_pools(4).run(tasks.tp_resume, str(path))
    for rank, result in enumerate(resumed):
        assert same_bits(result["loaded"], chunk_of(full, 4, rank)), f"TP = 4, rank {rank}"
        torch.testing.assert_close(result["output"], output, rtol=0, atol=1e-6)


def test_pipeline_round_trip_gives_each_stage_its_own_state(
    rank_pools: Callable[[int], RankPool], tmp_path: Path
) -> None:
    """Two stages of the same names and shapes: stage 1 used to resume, silently, as stage 0.
    The file holds both, keyed by stage; a plain model cannot load it by mistake."""
    path = tmp_path / "pp.pt"
    results = rank_pools(2).run(tasks.pp_round_trip, str(path))
    assert [result["stage"] for result in results] == [0, 1]
    assert not torch.equal(
        results[0]["saved"]["params"]["0.weight"], results[1]["saved"]["params"]["0.weight"]
    )
    assert_each_rank_got_its_own(results)
    checkpoint = read_checkpoint(path)
    assert checkpoint["stages"] == 2
    for stage, result in enumerate(results):
        for name, value in result["saved"]["params"].items():
            assert torch.equal(checkpoint["model"][stage][name], value), (stage, name)
    with pytest.raises(CheckpointError, match="holds the 2 stages of a pipeline"):
        load_checkpoint(path, tasks.stage_block(0, seed=0), allow_world_size_change=True)


@pytest.mark.slow  # 25 s; TP and PP round trips, each alone, are in the default suite
def test_dp_tp_pp_round_trip_on_8_ranks_gives_each_rank_its_own_state(
    rank_pools: Callable[[int], RankPool], tmp_path: Path
) -> None:
    """(pp, dp, tp) = (2, 2, 2): rank r is at (r // 4, r // 2 % 2, r % 2). Every rank gets its
    own shard of its own stage back, and the file holds each stage's unsplit state."""
    path = tmp_path / "3d.pt"
    results = rank_pools(8).run(tasks.three_d_round_trip, str(path), timeout=240)
    where = [tuple(result["where"][axis] for axis in ("pp", "dp", "tp")) for result in results]
    assert where == [(r // 4, r // 2 % 2, r % 2) for r in range(8)]
    weights = [result["saved"]["params"]["0.weight"] for result in results]
    assert not torch.equal(weights[0], weights[1]), "TP ranks hold different shards"
    assert not torch.equal(weights[0], weights[4]), "stages hold different layers"
    assert_each_rank_got_its_own(results)
    checkpoint = read_checkpoint(path)
    assert checkpoint["stages"] == 2
    for stage in (0, 1):
        full = unsplit([results[4 * stage]["saved"], results[4 * stage + 1]["saved"]])
        for name, value in full["params"].items():
            assert torch.equal(checkpoint["model"][stage][name], value), (stage, name)


def test_saving_a_tensor_parallel_model_on_rank_0_alone_is_refused_on_both_ranks(
    tmp_path: Path,
) -> None:
    """`if rank == 0: save_checkpoint(...)`, then cleanup(): rank 0 alone holds only its
    shards, so it must not write them as the model. Both ranks say what happened at once, and
    no file is written. A pool of its own: a failed meeting leaves the process group unusable."""
    path = tmp_path / "tp.pt"
    pool = RankPool(2)
    try:
        start = time.monotonic()
        saver, other = pool.run(tasks.save_on_rank_0_alone, str(path))
        seconds = time.monotonic() - start
    finally:
        pool.shutdown()
    assert saver.startswith("CheckpointError: save_checkpoint() on rank 0 cannot go on"), saver
    assert "rank 1: arrived at cleanup() instead" in saver
    assert "call save_checkpoint on every rank, not under `if rank == 0:`" in saver
    assert other.startswith("CollectiveFailed: cleanup() on rank 1 cannot go on"), other
    assert "rank 0: arrived at save_checkpoint() instead" in other
    assert not path.exists()
    # Seen, not waited for: well under the pool's process-group timeout (a busy machine makes
    # the training and the save themselves take seconds).
    assert seconds < PROCESS_GROUP_TIMEOUT_S / 2, f"took {seconds:.1f} s: waited for a timeout"
