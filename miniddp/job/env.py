"""Where am I in the job? Read torchrun's environment and start the process group.

torchrun starts one process per rank and tells each who it is through environment variables:

    RANK              global rank, 0 .. WORLD_SIZE-1 across every node
    LOCAL_RANK        rank within this node: picks this process's GPU
    WORLD_SIZE        processes in the whole job
    LOCAL_WORLD_SIZE  processes on this node
    GROUP_RANK        which node this is (the "node rank")
    MASTER_ADDR/PORT  where the rendezvous store lives
    TORCHELASTIC_RESTART_COUNT  how many times torchrun has restarted the workers

`init_distributed()` reads them, picks the backend (NCCL when there is a GPU, gloo otherwise) and
the device, and starts the default process group.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from miniddp.job.meet import leave_together
from miniddp.job.notes import any_broken, forget_boards

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

HOW_TO_LAUNCH = (
    "Launch the script with torchrun, for example\n"
    "    torchrun --nproc_per_node=2 your_script.py\n"
    "or ./launch.sh your_script.py, then call miniddp.init_distributed() (or "
    "torch.distributed.init_process_group) first."
)


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, as torchrun described it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    restart_count: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 prints and writes files; the others stay quiet."""
        return self.rank == 0


def size_and_rank_in(group: dist.ProcessGroup | None, what: str, fix: str) -> tuple[int, int]:
    """The size of `group` and this rank's place in it, or a clear error where there is no
    process group yet, or where this rank is no member: torch answers rank -1 and size -1
    there, and a shard cut or a table sized from them fails later saying nothing useful.
    `what` names the group ("pipeline"), `fix` how to give each rank its own."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"A {what} group needs a process group, and none exists. {HOW_TO_LAUNCH}"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        ranks = ", ".join(map(str, dist.get_process_group_ranks(group)))
        raise ValueError(
            f"rank {dist.get_rank()} is not in this {what} group (ranks {ranks}): {fix}"
        )
    return dist.get_world_size(group), rank


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def _int_env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def init_distributed(
    backend: str | None = None, timeout: timedelta = timedelta(minutes=5)
) -> DistEnv:
    """Start the default process group from torchrun's environment and return where we are.

    Safe to call twice: a second call just describes the running group.
    """
    if not launched_by_torchrun():
        missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
        raise RuntimeError(
            f"Not launched by torchrun: {', '.join(missing)} not set. {HOW_TO_LAUNCH}"
        )
    local_rank = _int_env("LOCAL_RANK", 0)
    local_world_size = _int_env("LOCAL_WORLD_SIZE", 1)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:
            # Two compute threads per rank on a 2-core machine made a DDP step ~15x slower:
            # the ranks fight over the cores. Share them out instead.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))

    restart_count = _int_env("TORCHELASTIC_RESTART_COUNT", 0)
    if not dist.is_initialized():
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        if _int_env("GROUP_WORLD_SIZE", 1) == 1:
            # torchrun's agent keeps one store for all restart attempts; a restarted group could
            # read the dead attempt's addresses from it (pytorch#135712). A prefix per attempt
            # keeps each attempt's keys apart, so `torchrun --max-restarts=N` just works. With
            # several nodes each agent counts its own restarts, so the nodes would disagree on
            # the prefix: there launch.sh sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 instead,
            # which gives each attempt a fresh store.
            store = dist.PrefixStore(f"miniddp/attempt-{restart_count}", store)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        atexit.register(_end_the_group_at_exit)
    return DistEnv(
        rank=dist.get_rank(),
        local_rank=local_rank,
        world_size=dist.get_world_size(),
        local_world_size=local_world_size,
        node_rank=_int_env("GROUP_RANK", 0),
        restart_count=restart_count,
        backend=dist.get_backend(),
        device=device,
    )


def cleanup() -> None:
    """Leave the process group (call at the end of a script, on every rank).

    First every rank waits for the others to be done with their collectives, so that no rank
    tears its connections down while a peer still finishes the last one (in two-node runs
    here, gloo occasionally aborted a worker at exit with "terminate called without an active
    exception" without this wait). The wait goes through the store (miniddp/job/meet.py), not a
    gloo barrier: a rank that ran more or fewer steps than the others then gets a
    `CollectiveFailed` saying so within a second, on every rank, instead of a barrier that
    waits out the whole timeout and then blames the wrong cause.
    """
    if not dist.is_initialized():
        return
    try:
        leave_together()
    finally:
        # This rank has no collective in flight, so the group can go even if the wait failed.
        forget_boards()  # nobody waits for an exit note from this rank any more
        dist.destroy_process_group()


def _end_the_group_at_exit() -> None:
    """For a script that ends without cleanup(): the same, while Python is still whole.

    A group left to the interpreter's shutdown (pytorch#190489), or destroyed at exit without
    first waiting for the other ranks (seen here), sometimes aborts a process with "terminate
    called without an active exception" after its work is done. Not when an exception is
    ending the process or a collective failed here: the other ranks may never arrive, and this
    rank's exit note has told them what they need.
    """
    if not dist.is_initialized() or getattr(sys, "last_value", None) is not None or any_broken():
        return
    cleanup()
