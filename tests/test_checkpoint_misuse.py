"""Checkpoints misused across ranks: each rank learns what happened within a second or two,
instead of a hang until the process-group timeout, a raw gloo error, or gloo aborting the
process.

Real processes (tests/faulty_ranks.py), 2 ranks training MiniDDP, a 2 s process-group timeout.
Every rank saves a checkpoint together at step 1; at step 3 one rank misuses it.
"""

from __future__ import annotations

from pathlib import Path

from miniddp.checkpoint import read_checkpoint
from tests.faulty_ranks import PROCESS_GROUP_TIMEOUT_S, record_detection, run_ranks

# Far more than the ~0.1-1.1 s measured, and still less than a timeout-based path would take
# here: the 2 s process-group timeout, then the 1 s grace period of faults.py.
WITHIN_S = 5 * PROCESS_GROUP_TIMEOUT_S


def test_saving_on_rank_0_alone_is_refused_at_once(tmp_path: Path) -> None:
    """`if rank == 0: save_checkpoint(...)`, the usual idiom with torch's DDP, while rank 1
    trains on. It used to hang until the timeout, then fail in gloo's words."""
    run = run_ranks(tmp_path, "save-alone", "miniddp", victim=0)
    saver, trainer = run.raised(0), run.raised(1)
    assert saver["type"] == "CheckpointError", saver
    assert "rank 1: waits on collective #" in saver["message"]
    assert "Call save_checkpoint on every rank, not under `if rank == 0:`" in saver["message"]
    assert trainer["type"] == "CollectiveFailed", trainer
    assert (
        "rank 0: waiting on #" in trainer["message"] and "save_checkpoint()" in trainer["message"]
    )
    assert read_checkpoint(tmp_path / "store.checkpoint.pt")["progress"]["step"] == 1
    for rank in (0, 1):
        seconds = run.detection_s(rank, victim=0)
        record_detection(f"save_checkpoint on rank 0 alone: rank {rank}", seconds)
        assert seconds < WITHIN_S


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
    """The survivor waits for rank 0's word that the file is written. Rank 0 is killed
    (SIGKILL) halfway through the write: the survivor gets the named CollectiveFailed, not
    gloo's raw "Connection closed by peer"; the previous checkpoint stays whole."""
    run = run_ranks(tmp_path, "killed-while-saving", "miniddp", victim=0)
    assert run.first(0, "raised") is None and run.first(0, "finished") is None
    survivor = run.raised(1)
    assert survivor["type"] == "CollectiveFailed" and survivor["missing"] == [0], survivor
    assert "broadcast of whether rank 0 wrote the checkpoint" in survivor["collective"]
    assert "rank 0: posted nothing" in survivor["message"]
    assert "died abruptly" in survivor["message"]
    seconds = run.detection_s(1, victim=0)
    record_detection("rank 0 killed while writing a checkpoint", seconds)
    assert seconds < WITHIN_S
    assert read_checkpoint(tmp_path / "store.checkpoint.pt")["progress"]["step"] == 1
