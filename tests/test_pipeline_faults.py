"""A stage that dies mid-step is named by its neighbour, through miniddp.faults.wait_for: the
transfer it waits on, and the rank that is missing, instead of gloo's bare "Connection closed".

Real processes (not the shared pool: this run kills a rank and leaves its group unusable), with
a short process-group timeout and a deadline on the whole run.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RUN_DEADLINE_S = 120.0


def stage_that_may_die(rank: int, store_path: str, out_dir: str) -> None:
    """Two stages of GPipe; in the second step the last stage's process ends inside its loss."""
    from miniddp.pipeline import PipelineStage, ScheduleGPipe

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    timeout = timedelta(seconds=10)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    stage = PipelineStage(torch.nn.Linear(4, 4), rank, 2, "cpu")
    schedule = ScheduleGPipe(stage, 2, lambda output, target: (output - target).pow(2).mean())
    x = torch.randn(4, 4)
    for step in range(2):
        if rank == 1 and step == 1:
            schedule.loss_fn = lambda output, target: os._exit(3)
        try:
            schedule.step(x) if rank == 0 else schedule.step(target=x)
        except Exception as error:
            Path(out_dir, f"rank{rank}.txt").write_text(f"{type(error).__name__}: {error}")
            os._exit(0)
    os._exit(0)


def run_processes(
    task, world_size: int, tmp_path: Path, deadline_s: float = RUN_DEADLINE_S
) -> list[str]:
    """Each rank's report, after all ended (or the deadline passed and they were killed)."""
    context = mp.start_processes(
        task,
        args=(str(tmp_path / "store"), str(tmp_path)),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + deadline_s
    for process in context.processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in context.processes:
        if process.is_alive():
            process.kill()
    files = [tmp_path / f"rank{rank}.txt" for rank in range(world_size)]
    return [file.read_text() if file.exists() else "(no report)" for file in files]


def test_a_stage_that_dies_is_named_by_the_stage_waiting_for_it(tmp_path: Path) -> None:
    report = run_processes(stage_that_may_die, 2, tmp_path)[0]
    first_line = report.splitlines()[0]
    # Waiting for it, or (gloo sends at once) posting it with the next send: either is named.
    assert first_line.startswith("CollectiveFailed: the "), report
    assert "the receive of gradient 0 from stage 1 could not finish" in first_line, report
    assert "rank 1 is missing" in first_line, report


def stages_whose_loss_fn_returns_a_tuple(rank: int, store_path: str, out_dir: str) -> None:
    """Two stages of GPipe whose loss_fn returns (loss, aux), as a training loop that logs
    something beside the loss might write it. Each rank reports what it raised; the last
    stage's process then ends, as it would with the error uncaught."""
    from miniddp.pipeline import PipelineStage, ScheduleGPipe

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    timeout = timedelta(seconds=10)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    stage = PipelineStage(torch.nn.Linear(4, 4), rank, 2, "cpu")
    schedule = ScheduleGPipe(stage, 2, lambda out, target: ((out - target).pow(2).mean(), out))
    x = torch.randn(4, 4)
    try:
        schedule.step(x) if rank == 0 else schedule.step(target=x)
        Path(out_dir, f"rank{rank}.txt").write_text("accepted")
    except Exception as error:
        Path(out_dir, f"rank{rank}.txt").write_text(f"{type(error).__name__}: {error}")
    os._exit(1 if rank == 1 else 0)


def test_a_loss_fn_returning_a_tuple_is_named_with_the_fix(tmp_path: Path) -> None:
    """torch says "Expected output to be a torch.Tensor"-like; a bare "unsupported operand
    type(s) for /: 'tuple' and 'int'" from inside the schedule names neither loss_fn nor
    the fix. The first stage, waiting for the gradient, names the rank that stopped."""
    last, first = reversed(run_processes(stages_whose_loss_fn_returns_a_tuple, 2, tmp_path))
    assert last.startswith("TypeError: loss_fn must return the loss, one tensor"), last
    assert "returned a tuple" in last and "return the loss alone" in last, last
    assert "rank 1 is missing" in first, first
