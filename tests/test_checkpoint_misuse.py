"""Checkpoints misused across ranks: each rank learns what happened within a second or two,
instead of a hang until the process-group timeout, a raw gloo error, or gloo aborting the
process.

Real processes (tests/faulty_ranks.py), 2 ranks training MiniDDP, a 2 s process-group timeout.
Every rank saves a checkpoint together at step 1; at step 3 one rank misuses it.
"""

from __future__ import annotations

from pathlib import Path

from miniddp.checkpoint import read_checkpoint
from tests.faulty_ranks import FAULT_STEP, PROCESS_GROUP_TIMEOUT_S, record_detection, run_ranks

# Far more than the ~0.1-1.1 s measured, and still less than a timeout-based path would take
# here: the 2 s process-group timeout, then the 1 s grace period of faults.py.
WITHIN_S = 5 * PROCESS_GROUP_TIMEOUT_S


def test_saving_on_rank_0_alone_trains_on(tmp_path: Path) -> None:
    """`if rank == 0: save_checkpoint(...)`, the usual idiom with torch's DDP, while rank 1
    trains on. Rank 0 writes model, optimizer, progress and its own RNG state without waiting
    for anyone (it used to raise CheckpointError, and before that hang until the timeout);
    both ranks finish training."""
    run = run_ranks(tmp_path, "save-alone", "miniddp", victim=0)
    for rank in (0, 1):
        assert run.first(rank, "raised") is None, run.outputs[rank][-3000:]
        assert run.first(rank, "finished") is not None, run.outputs[rank][-3000:]
    checkpoint = read_checkpoint(tmp_path / "store.checkpoint.pt")
    assert checkpoint["progress"]["step"] == FAULT_STEP
    assert checkpoint["rng"][0] is not None and checkpoint["rng"][1] is None


def test_loading_on_one_rank_alone_is_refused_before_the_buckets_change(tmp_path: Path) -> None:
    """Loading into a MiniDDP wrapper on rank 1 only would give the ranks different bucket
    layouts, and gloo would abort the process (SIGABRT) at the next mismatched all-reduce."""
    run = run_ranks(tmp_path, "load-alone", "miniddp", victim=1)
    loader, trainer = run.raised(1), run.raised(0)
    assert loader["type"] == "CheckpointError", loader
    assert "rank 0: waits on collective #" in loader["message"]
    assert "Call load_checkpoint with a MiniDDP wrapper on every rank" in loader["message"]
    assert trainer["type"] == "CollectiveFailed" and "load_checkpoint()" in trainer["message"]
    for rank in (0, 1):
        assert "Aborted" not in run.outputs[rank] and "SIGABRT" not in run.outputs[rank]
        seconds = run.detection_s(rank, victim=1)
        record_detection(f"load_checkpoint on rank 1 alone: rank {rank}", seconds)
        assert seconds < WITHIN_S


def test_killing_rank_0_while_it_writes_names_it_on_the_survivor(tmp_path: Path) -> None:
    """The survivor waits, through the store, for rank 0's word that the file is written. Rank
    0 is killed (SIGKILL) halfway through the write, so it says nothing: the survivor names it
    after the process-group timeout (nothing tells a dead rank from a stuck one sooner; on one
    node torchrun usually stops the job first), and the previous checkpoint stays whole."""
    run = run_ranks(tmp_path, "killed-while-saving", "miniddp", victim=0)
    assert run.first(0, "raised") is None and run.first(0, "finished") is None
    survivor = run.raised(1)
    assert survivor["type"] == "CheckpointError", survivor
    assert "waits for rank 0's word" in survivor["message"]
    assert "rank 0: said nothing within the process group's timeout" in survivor["message"]
    seconds = run.detection_s(1, victim=0)
    record_detection("rank 0 killed while writing a checkpoint", seconds)
    assert seconds < WITHIN_S
    assert read_checkpoint(tmp_path / "store.checkpoint.pt")["progress"]["step"] == 1


def test_consolidating_zero_state_on_rank_0_alone_is_named_on_both_ranks(tmp_path: Path) -> None:
    """`if rank == 0: optimizer.consolidate_state_dict()` before a save, with ZeRO-1: each rank
    holds a share of the state, so every rank must take part. Rank 0 used to wait in the gather
    for the whole process-group timeout, then fail with gloo's bare "Timed out waiting", while
    rank 1 waited in its next step for rank 0."""
    run = run_ranks(tmp_path, "consolidate-alone", "miniddp", victim=0)
    consolidating, training = run.raised(0), run.raised(1)
    assert consolidating["type"] == training["type"] == "CollectiveFailed"
    assert "consolidate_state_dict() on rank 0 cannot go on" in consolidating["message"]
    assert "rank 1: waits on collective #" in consolidating["message"]
    assert "consolidate_state_dict(to=0) on every rank" in consolidating["message"]
    assert "consolidate_state_dict()" in training["message"]
    for rank in (0, 1):
        seconds = run.detection_s(rank, victim=0)
        record_detection(f"consolidate_state_dict on rank 0 alone: rank {rank}", seconds)
        assert seconds < WITHIN_S
