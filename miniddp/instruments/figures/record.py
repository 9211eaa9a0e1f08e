"""The data behind the figures that need no timing: recorded once, the same on every run.

- `run_rank_job`: 4 gloo ranks (spawned, with a deadline) log every message of each collective
  (`miniddp.collectives.record_messages`) and a MiniDDP's bucket layout before and after its
  rebuild.
- `accumulation_losses`: one process trains the same model on one big batch and on micro-batches.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from miniddp import MiniDDP, collectives
from miniddp.data_parallel.bucket import BucketInfo

WORLD_SIZE = 4
JOB_TIMEOUT_S = 240  # importing torch in 4 processes is most of it: ~10 s idle, more when busy
# (title, collective, algorithm): the tree and the ring, and the all-reduces built from them
ALGORITHMS = [
    ("broadcast, tree", "broadcast", "tree"),
    ("reduce, tree", "reduce", "tree"),
    ("all-reduce, reduce then broadcast (trees)", "all_reduce", "reduce_broadcast"),
    ("all-reduce, recursive doubling", "all_reduce", "recursive_doubling"),
    ("all-reduce, ring (reduce-scatter, then all-gather)", "all_reduce", "ring"),
]


def record_on_ranks(rank: int, store_path: str, out_path: str) -> None:
    """One rank of the 4-rank job: run each collective with its messages logged, and build a
    MiniDDP to see its buckets before and after the rebuild. Rank 0 writes what was seen."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD_SIZE)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=60)
    )
    runs = {}
    for title, name, algorithm in ALGORITHMS:
        tensor = torch.arange(8) + 100 * rank
        extra = {"src": 0} if name == "broadcast" else {"dst": 0} if name == "reduce" else {}
        with collectives.record_messages() as log:
            getattr(collectives, name)(tensor, algorithm=algorithm, **extra)
        everyone = [None] * WORLD_SIZE
        dist.all_gather_object(everyone, list(log))
        runs[title] = sorted((m for logs in everyone for m in logs), key=lambda m: (m.step, m.src))
    layouts = bucket_layouts()
    if rank == 0:
        Path(out_path).write_bytes(pickle.dumps((runs, layouts)))
    dist.destroy_process_group()


def bucket_layouts() -> dict[str, list[BucketInfo]]:
    """A 6-layer MLP of 1 MiB layers under MiniDDP with torch's default caps: one bucket in
    iteration 0 (gradients' order unknown yet), then buckets rebuilt in the order backward
    produced the gradients, the first closed at 1 MiB (the last layer alone, so its all-reduce
    starts early), the rest under the 25 MiB cap."""
    torch.manual_seed(0)
    layers = [nn.Linear(512, 512) for _ in range(6)]
    model = MiniDDP(nn.Sequential(*layers))
    before = model.buckets
    for _ in range(2):  # the rebuild happens at the start of the second forward
        model(torch.randn(4, 512)).sum().backward()
        model.finish_gradient_synchronization()
    return {
        "iteration 0\n(registration order)": before,
        "after the rebuild\n(ready order)": model.buckets,
    }


def run_rank_job(work_dir: Path) -> tuple[dict, dict]:
    """Spawn the 4 ranks, wait (with a deadline), and return rank 0's (messages, layouts)."""
    return spawn_and_collect(record_on_ranks, WORLD_SIZE, work_dir, JOB_TIMEOUT_S)


def spawn_and_collect(
    task: Callable[[int, str, str], None], ranks: int, work_dir: Path, timeout_s: float
) -> Any:
    """Run `task(rank, store_path, out_path)` on `ranks` spawned processes; past `timeout_s`,
    kill them all and raise. Returns what the task pickled to `out_path` (rank 0 writes it)."""
    out_path = work_dir / "recorded.pickle"
    context = mp.start_processes(
        task,
        args=(str(work_dir / "store"), str(out_path)),
        nprocs=ranks,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"the {ranks}-rank job did not finish in {timeout_s} s")
    return pickle.loads(out_path.read_bytes())


def accumulation_losses(steps: int = 25, micro: int = 4) -> dict[str, list[float]]:
    """Loss on the whole batch after each SGD step, for three recipes from the same start."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(32, 8, generator=generator, dtype=torch.float64)
    targets = inputs @ torch.randn(8, 1, generator=generator, dtype=torch.float64)
    recipes = {
        "one batch of 32": (1, 1.0),
        f"{micro} micro-batches of 8, each loss / {micro}": (micro, 1 / micro),
        f"{micro} micro-batches of 8, loss not divided": (micro, 1.0),
    }
    losses = {}
    for label, (chunks, scale) in recipes.items():
        torch.manual_seed(0)
        model = nn.Linear(8, 1, dtype=torch.float64)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
        curve = []
        for _ in range(steps):
            optimizer.zero_grad()
            for x, y in zip(inputs.chunk(chunks), targets.chunk(chunks)):
                (nn.functional.mse_loss(model(x), y) * scale).backward()
            optimizer.step()
            curve.append(nn.functional.mse_loss(model(inputs), targets).item())
        losses[label] = curve
    return losses
