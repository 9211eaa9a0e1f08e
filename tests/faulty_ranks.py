"""Ranks that misbehave on purpose, as real processes: the harness behind test_faults.py and
test_checkpoint_misuse.py.

`run_ranks` starts plain Python processes running this very file (see `worker` at the bottom),
joined through a FileStore, with a short process-group timeout. Not the shared pool: these
runs kill and stall ranks, and leave the group unusable. Every run has a deadline, after which
all of its processes are killed. Each rank prints what happened to it as RESULT lines.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROCESS_GROUP_TIMEOUT_S = 2.0  # how long a silent rank is waited for
# Not a fault: a rank saving alone keeps the other waiting at the next all-reduce for as long as
# its write takes, seconds on a busy machine. That run waits as long as a real job would.
TIMEOUT_S = {"save-alone": 60.0}
RUN_DEADLINE_S = 90.0  # a whole run, process start included: beyond it, everything is killed
STEPS = 5
FAULT_STEP = 3  # the victim misbehaves just before this step's forward
STALL_S = 120.0  # "alive but silent": far longer than anyone waits for it
SLOW_S = 0.6  # "slow but fine": longer than the fault poll, much shorter than the timeout
RESULT = "RESULT "
MID_TRAINING_FAULTS = ("exit", "stall", "slow", "raise")
# Checkpoint misuse, at FAULT_STEP (MiniDDP layer only): every rank saves together at step 1.
CHECKPOINT_FAULTS = ("save-alone", "load-alone", "killed-while-saving")
# ZeRO-1's state consolidated on one rank alone, at FAULT_STEP (MiniDDP layer only).
CONSOLIDATE_ALONE = "consolidate-alone"
# fully_shard layer only: at FAULT_STEP the victim joins the check before unit 2's prefetched
# all-gather, then dies instead of issuing the gather: the others are left waiting on it.
EXIT_DURING_PREFETCH = "exit-during-prefetched-gather"


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
    from tests.harness.measurements import record_max

    record_max(f"fault detection s, {name}", seconds)


def worker(args: argparse.Namespace) -> None:
    """One rank: train STEPS steps; the victim commits the fault at FAULT_STEP."""
    import torch
    import torch.distributed as dist

    from miniddp.checkpoint import CheckpointError
    from miniddp.job.env import cleanup
    from miniddp.job.faults import CollectiveFailed

    def report(event: str, **fields) -> None:
        print(RESULT + json.dumps({"event": event, "time": time.time(), **fields}), flush=True)

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(args.store, args.world_size),
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=TIMEOUT_S.get(args.fault, PROCESS_GROUP_TIMEOUT_S)),
    )
    excepthook = sys.excepthook  # torch's own, installed by init_process_group
    victim = args.rank == args.victim
    steps = STEPS - 1 if victim and args.fault.startswith("fewer-steps") else STEPS
    steps_of = {"miniddp": _miniddp_step, "fully_shard": _fully_shard_step}
    step = steps_of[args.layer](args, report) if args.layer in steps_of else _all_reduce_step
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
        if victim and args.fault in ("fewer-steps", "fewer-steps-then-cleanup"):
            report("fault")  # it stops here, one step early
        if victim and args.fault == "fewer-steps-then-barrier":
            report("fault")
            dist.barrier()
        if victim and args.fault == "fewer-steps-then-gather":
            report("fault")
            dist.all_gather_object([None] * args.world_size, "done")
        if victim and args.fault == "fewer-steps-then-mismatch":
            report("fault")
            dist.all_reduce(torch.ones(10))
        if victim and args.fault == "fewer-steps":
            report("finished")
            dist.destroy_process_group()
            return  # its process ends without cleanup(); the others hear of it at exit
        cleanup()
    except (CollectiveFailed, CheckpointError) as error:
        report(
            "raised",
            type=type(error).__name__,
            message=str(error),
            collective=getattr(error, "collective", None),
            missing=getattr(error, "missing_ranks", None),
        )
        os._exit(3)  # the group is broken: tearing it down could hang
    # MiniDDP names a crash from sys.last_value: it has no excepthook of its own to install.
    report("finished", excepthook_untouched=sys.excepthook is excepthook)


def _all_reduce_step(number: int) -> None:
    import torch
    import torch.distributed as dist

    from miniddp.job.faults import wait_for

    work = dist.all_reduce(torch.ones(1024), async_op=True)
    wait_for(work.get_future(), f"all-reduce of step {number}")


def _miniddp_step(args: argparse.Namespace, report: Callable[..., None]) -> Callable[[int], None]:
    import torch
    from torch import nn

    from miniddp import MiniDDP, ZeroRedundancyOptimizer
    from miniddp.checkpoint import Progress, load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    model = MiniDDP(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)))
    # The checkpoint misuses save and load a real optimizer, and ZeRO-1's misuse consolidates
    # one. The other faults step SGD by hand:
    # a process's first torch.optim optimizer imports torch._dynamo, 1.8 s a rank here, and
    # what they test is the waits.
    optimizer: torch.optim.Optimizer | None = None
    if args.fault in CHECKPOINT_FAULTS:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    elif args.fault == CONSOLIDATE_ALONE:
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    path = f"{args.store}.checkpoint.pt"
    victim = args.rank == args.victim

    def save(number: int) -> None:
        save_checkpoint(path, model, optimizer, Progress(number, epoch=0, batches_done=number))

    def step(number: int) -> None:
        if args.fault in CHECKPOINT_FAULTS and number == 1:
            save(number)  # every rank, as it should: the file the misuse below needs
        if number == FAULT_STEP and args.fault == "killed-while-saving":
            if victim:
                _die_halfway_through_the_next_save(report)
            save(number)  # every rank; the victim dies inside
        elif number == FAULT_STEP and args.fault == CONSOLIDATE_ALONE and victim:
            report("fault")
            optimizer.consolidate_state_dict(to=0)  # as in `if rank == 0: ...`, before a save
        elif number == FAULT_STEP and args.fault in CHECKPOINT_FAULTS and victim:
            report("fault")
            if args.fault == "save-alone":
                save(number)  # as in `if rank == 0: save_checkpoint(...)`
            else:
                load_checkpoint(path, model, optimizer)  # on this rank only
        model.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        if optimizer is not None:
            optimizer.step()
        else:
            with torch.no_grad():
                for param in model.parameters():
                    param -= 0.1 * param.grad

    return step


def _fully_shard_step(
    args: argparse.Namespace, report: Callable[..., None]
) -> Callable[[int], None]:
    """Three fully_shard units in a chain, stepped by hand with SGD (see _miniddp_step)."""
    import torch
    from torch import nn

    from miniddp import fully_shard
    from miniddp.sharding.sharded_parameters import ShardedParameters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 1))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    start_gather = ShardedParameters.start_gather

    def die_instead_of_gathering(unit: ShardedParameters, dtype=None):
        report("fault")  # the others have issued this gather, prefetched: it never completes
        os._exit(1)

    def step(number: int) -> None:
        if number == FAULT_STEP and args.fault == EXIT_DURING_PREFETCH and args.rank == args.victim:
            unit_2 = model[1]._sharded
            ShardedParameters.start_gather = lambda unit, dtype=None: (
                die_instead_of_gathering(unit) if unit is unit_2 else start_gather(unit, dtype)
            )
        model(torch.randn(4, 8)).square().mean().backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= 0.1 * param.grad
                param.grad = None

    return step


def _die_halfway_through_the_next_save(report: Callable[..., None]) -> None:
    """Make the next checkpoint write stop halfway with SIGKILL: no exit note, no goodbye."""
    import miniddp.checkpoint.save_load

    def die_halfway(obj, path) -> None:
        path.with_name(f".{path.name}.{os.getpid()}.tmp").write_bytes(b"PK\x03\x04 half a file")
        report("fault")
        os.kill(os.getpid(), signal.SIGKILL)

    miniddp.checkpoint.save_load.write_atomically = die_halfway


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="One rank of a faulty_ranks.py run.")
    for name in ("--rank", "--world-size", "--victim"):
        parser.add_argument(name, type=int, required=True)
    for name in ("--store", "--fault", "--layer"):
        parser.add_argument(name, required=True)
    worker(parser.parse_args())
