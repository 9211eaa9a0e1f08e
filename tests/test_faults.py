"""A rank that dies, stalls or stops early becomes an error naming the collective and the rank.

Each test starts its own ranks: plain Python processes running this very file (see `worker`
at the bottom), joined through a FileStore, with a short process-group timeout. Not the shared
pool: these tests kill and stall ranks on purpose. Every run has a deadline, after which all of
its processes are killed.

Two layers are tested with the same faults: `wait_for` around a raw async all-reduce (the
mechanism alone), and MiniDDP training (the mechanism where users meet it). The MiniDDP cases
need ddp.py to route its waits through `miniddp.faults.wait_for`; until it does they are skipped,
with that reason.

The time from the fault to the survivor's error is printed in the "measured" summary.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROCESS_GROUP_TIMEOUT_S = 2.0  # how long a silent rank is waited for
RUN_DEADLINE_S = 90.0  # a whole run, process start included: beyond it, everything is killed
STEPS = 5
FAULT_STEP = 3  # the victim misbehaves just before this step's forward
STALL_S = 120.0  # "alive but silent": far longer than anyone waits for it
SLOW_S = 0.6  # "slow but fine": longer than the fault poll, much shorter than the timeout
RESULT = "RESULT "
MID_TRAINING_FAULTS = ("exit", "stall", "slow", "raise")


@dataclass(frozen=True)
class Run:
    """What every rank printed: its RESULT records and its whole output."""

    records: dict[int, list[dict]]
    outputs: dict[int, str]

    def first(self, rank: int, event: str) -> dict | None:
        return next((r for r in self.records[rank] if r["event"] == event), None)

    def raised(self, rank: int) -> dict:
        record = self.first(rank, "raised")
        assert record is not None, f"rank {rank} raised nothing:\n{self.outputs[rank][-3000:]}"
        return record

    def detection_s(self, rank: int, victim: int) -> float:
        return self.raised(rank)["time"] - self.first(victim, "fault")["time"]


def miniddp_waits_are_watched() -> bool:
    import miniddp.ddp

    return hasattr(miniddp.ddp, "wait_for")


NEEDS_WIRING = pytest.mark.skipif(
    not miniddp_waits_are_watched(),
    reason="miniddp/ddp.py does not yet wait through miniddp.faults.wait_for",
)
LAYERS = ["wait_for", pytest.param("miniddp", marks=NEEDS_WIRING)]


def run_ranks(tmp_path: Path, fault: str, layer: str, world_size: int = 2, victim: int = 1) -> Run:
    """Start `world_size` ranks, let `victim` commit `fault`, and collect what each reported.

    Waits for every rank but a stalled victim to exit, then kills whatever is left.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    common = [sys.executable, __file__, "--world-size", str(world_size), "--victim", str(victim)]
    common += ["--store", str(tmp_path / "store"), "--fault", fault, "--layer", layer]
    processes = {
        rank: subprocess.Popen(
            [*common, "--rank", str(rank)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # Ctrl-C on pytest must not reach them first; we kill them
        )
        for rank in range(world_size)
    }
    outputs: dict[int, str] = {}
    deadline = time.monotonic() + RUN_DEADLINE_S
    try:
        for rank, process in processes.items():
            if rank == victim and fault == "stall":
                continue  # it sleeps on; killed below once the others are done
            remaining = max(0.1, deadline - time.monotonic())
            try:
                outputs[rank], _ = process.communicate(timeout=remaining)
            except subprocess.TimeoutExpired:
                break  # killed below; the test then shows everyone's output
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        for rank, process in processes.items():
            if rank not in outputs:
                outputs[rank], _ = process.communicate()
    records = {rank: _records(output) for rank, output in outputs.items()}
    return Run(records, outputs)


def _records(output: str) -> list[dict]:
    lines = output.splitlines()
    return [json.loads(line.removeprefix(RESULT)) for line in lines if line.startswith(RESULT)]


def record_detection(name: str, seconds: float) -> None:
    from tests.measurements import record_max

    record_max(f"fault detection s, {name}", seconds)


@dataclass(frozen=True)
class Fault:
    """One row of the table: what rank 1 does, and what rank 0 must then raise, how soon."""

    fault: str  # the victim's misbehaviour, as `worker` below implements it
    says: tuple[str, ...]  # phrases rank 0's CollectiveFailed must contain
    within_s: tuple[float, float]  # seconds from the fault to rank 0's error: (at least, at most)


T = PROCESS_GROUP_TIMEOUT_S
FAULTS = {
    # A closed connection needs no timeout: the others hear within the 1 s grace period.
    "exits abruptly (os._exit)": Fault("exit", ("rank 1 is missing", "died abruptly"), (0, 3)),
    # Alive but silent looks like slow until the timeout: not before it, soon after it.
    "stalls, alive but silent": Fault(
        "stall", ("rank 1 is missing", "alive but not taking part"), (T - 0.5, T + 4)
    ),
    "raises an exception": Fault(
        "raise", ("rank 1 is missing", "ValueError: a bug that only rank 1 has"), (0, 3)
    ),
    "takes one step fewer, then exits": Fault(
        "fewer-steps", ("ended normally", "different numbers of steps"), (0, 3)
    ),
    # Both ranks wait in different collectives until the timeout; whether rank 1's own timeout
    # error ends its process before rank 0 stops listening is a race: only the name is certain.
    "takes one step fewer, then waits in a barrier": Fault(
        "fewer-steps-then-barrier", ("rank 1 is missing",), (T - 0.5, T + 4)
    ),
    "takes one step fewer, then all-gathers": Fault(
        "fewer-steps-then-gather", ("rank 1 is missing",), (T - 0.5, T + 4)
    ),
    # One collective, two sizes: gloo aborts the process whose buffer is too small ("Is there a
    # distributed collective mismatch in your code?"), here rank 1. Rank 0 names it.
    "takes one step fewer, then all-reduces a smaller tensor (gloo aborts it)": Fault(
        "fewer-steps-then-mismatch", ("rank 1 is missing", "died abruptly"), (0, 3)
    ),
}
# Through MiniDDP: the faults a user meets in training. The others need no model.
IN_TRAINING = (
    "exits abruptly (os._exit)",
    "stalls, alive but silent",
    "raises an exception",
    "takes one step fewer, then exits",
)
ROWS = [pytest.param(name, "wait_for", id=f"{name} [wait_for]") for name in FAULTS]
ROWS += [
    pytest.param(name, "miniddp", id=f"{name} [MiniDDP]", marks=NEEDS_WIRING)
    for name in IN_TRAINING
]


@pytest.mark.parametrize(("name", "layer"), ROWS)
def test_a_faulty_rank_is_named_by_the_others(tmp_path: Path, name: str, layer: str) -> None:
    row = FAULTS[name]
    run = run_ranks(tmp_path, row.fault, layer)
    error = run.raised(0)
    assert error["type"] == "CollectiveFailed" and error["missing"] == [1], error["message"]
    assert "all-reduce" in error["collective"] and error["collective"] in error["message"]
    for phrase in row.says:
        assert phrase in error["message"], error["message"]
    seconds = run.detection_s(0, victim=1)
    record_detection(f"rank 1 {name} ({layer})", seconds)
    low, high = row.within_s
    assert low <= seconds <= high, f"rank 0 raised {seconds:.2f} s after the fault"


def test_every_survivor_names_the_missing_rank(tmp_path: Path) -> None:
    run = run_ranks(tmp_path, "exit", "wait_for", world_size=3, victim=2)
    for survivor in (0, 1):
        error = run.raised(survivor)
        assert error["missing"] == [2], error["message"]
        assert "ranks 0, 1: waiting on it" in error["message"]
    record_detection("rank 2 of 3 exits abruptly", max(run.detection_s(r, 2) for r in (0, 1)))


def test_a_slow_rank_is_not_a_fault(tmp_path: Path) -> None:
    run = run_ranks(tmp_path, "slow", "wait_for")
    for rank in (0, 1):
        assert run.first(rank, "raised") is None, run.first(rank, "raised")
        assert run.first(rank, "finished") is not None, run.outputs[rank][-3000:]


def worker(args: argparse.Namespace) -> None:
    """One rank: train STEPS steps; the victim commits the fault at FAULT_STEP."""
    import torch
    import torch.distributed as dist

    from miniddp.faults import CollectiveFailed

    def report(event: str, **fields) -> None:
        print(RESULT + json.dumps({"event": event, "time": time.time(), **fields}), flush=True)

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(args.store, args.world_size),
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
    )
    victim = args.rank == args.victim
    steps = STEPS - 1 if victim and args.fault.startswith("fewer-steps") else STEPS
    step = _miniddp_step() if args.layer == "miniddp" else _all_reduce_step
    try:
        for number in range(steps):
            if victim and number == FAULT_STEP and args.fault in MID_TRAINING_FAULTS:
                report("fault")
                if args.fault == "exit":
                    os._exit(1)  # no atexit, no goodbye: like a kill or a segfault
                elif args.fault == "stall":
                    time.sleep(STALL_S)
                elif args.fault == "slow":
                    time.sleep(SLOW_S)
                elif args.fault == "raise":
                    raise ValueError("a bug that only rank 1 has")
            step(number)
        if victim and args.fault == "fewer-steps":
            report("fault")  # it stops here, one step early, and ends normally
        if victim and args.fault == "fewer-steps-then-barrier":
            report("fault")
            dist.barrier()
        if victim and args.fault == "fewer-steps-then-gather":
            report("fault")
            dist.all_gather_object([None] * args.world_size, "done")
        if victim and args.fault == "fewer-steps-then-mismatch":
            report("fault")
            dist.all_reduce(torch.ones(10))
    except CollectiveFailed as error:
        report(
            "raised",
            type=type(error).__name__,
            message=str(error),
            collective=error.collective,
            missing=error.missing_ranks,
        )
        os._exit(3)  # the group is broken: tearing it down could hang
    report("finished")
    dist.destroy_process_group()


def _all_reduce_step(number: int) -> None:
    import torch
    import torch.distributed as dist

    from miniddp.faults import wait_for

    work = dist.all_reduce(torch.ones(1024), async_op=True)
    wait_for(work.get_future(), f"all-reduce of step {number}")


def _miniddp_step():
    import torch
    from torch import nn

    from miniddp import MiniDDP

    torch.manual_seed(0)
    model = MiniDDP(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(number: int) -> None:
        optimizer.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()

    return step


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="One rank of a test_faults.py run.")
    for name in ("--rank", "--world-size", "--victim"):
        parser.add_argument(name, type=int, required=True)
    for name in ("--store", "--fault", "--layer"):
        parser.add_argument(name, required=True)
    worker(parser.parse_args())
