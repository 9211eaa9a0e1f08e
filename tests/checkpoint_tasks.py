"""Task functions for tests/test_checkpoint.py. They run inside the pool's workers, which import
them by module name, so they live here rather than in the test file."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
from torch import nn

from miniddp import MiniDDP
from miniddp.checkpoint import CheckpointError, Progress, load_checkpoint, save_checkpoint


def draws() -> list[float]:
    """A few numbers from every global generator a training step might use."""
    return [torch.rand(1).item(), random.random()]


def rng_round_trip(path: str) -> tuple[list[float], list[float]]:
    """Seed per rank, save, draw; draw something else; load, draw again. Returns the draws
    right after saving and right after loading: equal if this rank got its own state back."""
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    random.seed(100 + rank)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(path, model, optimizer, Progress(step=4, epoch=1, batches_done=2))
    after_save = draws()
    draws()  # move on, as training would
    load_checkpoint(path, model, optimizer)
    return after_save, draws()


def four_layers() -> nn.Sequential:
    widths = [4, 16, 16, 16, 1]
    return nn.Sequential(*(nn.Linear(a, b) for a, b in zip(widths, widths[1:])))


def bucket_layout_round_trip(path: str) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """Train two steps (so the buckets are rebuilt), save, and load into a fresh wrapper.
    Returns the layouts of the trained wrapper and of the restored one."""
    torch.manual_seed(0)
    ddp = MiniDDP(four_layers(), bucket_cap_mb=0.0005)  # 512 bytes: several buckets
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        ddp(torch.randn(8, 4)).sum().backward()
        optimizer.step()
    save_checkpoint(path, ddp, optimizer, Progress(step=2, epoch=0, batches_done=2))
    restored = MiniDDP(four_layers(), bucket_cap_mb=0.0005)
    load_checkpoint(path, restored, torch.optim.SGD(restored.parameters(), lr=0.1))
    assert restored.has_rebuilt_buckets
    model = ddp.module
    trained_keys = set(torch.load(path, weights_only=True)["model"])
    assert trained_keys == set(model.state_dict()), "saved keys should be the inner module's"
    return (
        [info.param_names for info in ddp.buckets],
        [info.param_names for info in restored.buckets],
    )


def save_where_rank0_cannot_write(path: str) -> None:
    """`path` is an existing directory, so rank 0's rename fails: every rank must raise."""
    model = nn.Linear(2, 2)
    save_checkpoint(path, model, torch.optim.SGD(model.parameters(), lr=0.1), Progress(1, 0, 1))


def load_expecting_error(path: str) -> str:
    """Every rank reads the same broken file; return the error message it raised."""
    model = nn.Linear(3, 2)
    try:
        load_checkpoint(path, model)
    except CheckpointError as error:
        return str(error)
    return "no error"


def dropout_training(seed: int) -> tuple[MiniDDP, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 1))
    ddp = MiniDDP(model)
    return ddp, torch.optim.Adam(ddp.parameters(), lr=0.01)


def train_steps(ddp: MiniDDP, optimizer: torch.optim.Optimizer, steps: int) -> None:
    inputs = torch.linspace(-1, 1, 32).reshape(8, 4) + dist.get_rank()
    for _ in range(steps):
        optimizer.zero_grad()
        ddp(inputs).pow(2).mean().backward()
        optimizer.step()


def rank0_idiom(path: str) -> dict:
    """torch's idiom: `if rank == 0: save_checkpoint(...)`, `dist.barrier()`, then
    load_checkpoint on every rank into a fresh wrapper. Returns what was saved and what came
    back, the draws after the save and after the load, and the warnings the load gave."""
    import warnings

    torch.manual_seed(100 + dist.get_rank())
    ddp, optimizer = dropout_training(seed=0)
    train_steps(ddp, optimizer, 2)
    if dist.get_rank() == 0:
        save_checkpoint(path, ddp, optimizer, Progress(step=2, epoch=0, batches_done=2))
    dist.barrier()
    after_save = draws()
    saved = [p.detach().clone() for p in ddp.parameters()]
    saved_optimizer = optimizer.state_dict()
    fresh, fresh_optimizer = dropout_training(seed=1)
    draws()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_checkpoint(path, fresh, fresh_optimizer)
    return {
        "saved": saved,
        "loaded": [p.detach().clone() for p in fresh.parameters()],
        "saved_optimizer": saved_optimizer,
        "loaded_optimizer": fresh_optimizer.state_dict(),
        "progress": loaded.progress,
        "rng_restored": loaded.rng_restored,
        "ranks_without_rng": loaded.ranks_without_rng,
        "same_draws": after_save == draws(),
        "warnings": [str(w.message) for w in caught],
    }


def save_with_unconsolidated_zero(path: str) -> None:
    from miniddp import ZeroRedundancyOptimizer

    ddp = MiniDDP(nn.Linear(4, 2))
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.01)
    ddp(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    save_checkpoint(path, ddp, optimizer, Progress(1, 0, 1))


def rank0_idiom_after_an_every_rank_save(path: str) -> dict:
    """An every-rank save at step 1 (rank 1 writes its RNG file beside it), then torch's idiom
    at step 2 (`if rank == 0: save_checkpoint(...)`), then a load on every rank. Rank 1's RNG
    file is step 1's: it belongs to another save and must not be restored. Returns what the
    load reports, and whether this rank's RNG stream went on as if nothing were loaded."""
    torch.manual_seed(100 + dist.get_rank())
    random.seed(100 + dist.get_rank())
    ddp, optimizer = dropout_training(seed=0)
    train_steps(ddp, optimizer, 1)
    save_checkpoint(path, ddp, optimizer, Progress(step=1, epoch=0, batches_done=1))
    train_steps(ddp, optimizer, 1)
    if dist.get_rank() == 0:
        save_checkpoint(path, ddp, optimizer, Progress(step=2, epoch=0, batches_done=2))
    dist.barrier()
    before = (torch.get_rng_state(), random.getstate())
    loaded = load_checkpoint(path, ddp, optimizer)
    after_load = draws()
    torch.set_rng_state(before[0])
    random.setstate(before[1])
    return {
        "step": loaded.progress.step,
        "rng_restored": loaded.rng_restored,
        "ranks_without_rng": loaded.ranks_without_rng,
        "kept_its_own_stream": after_load == draws(),
    }


def every_rank_saves_rank_1_slowly(path: str) -> dict:
    """Every rank saves, rank 1 writing its RNG file a second late; then every rank loads at
    once. Rank 0, done first, must not take rank 1's file for missing."""
    import time
    import warnings

    import miniddp.checkpoint.save_load as save_load

    torch.manual_seed(100 + dist.get_rank())
    ddp, optimizer = dropout_training(seed=0)
    train_steps(ddp, optimizer, 1)
    write = save_load.write_atomically
    if dist.get_rank() == 1:

        def slowly(obj, where):
            time.sleep(1.0)
            write(obj, where)

        save_load.write_atomically = slowly
    try:
        save_checkpoint(path, ddp, optimizer, Progress(step=1, epoch=0, batches_done=1))
    finally:
        save_load.write_atomically = write
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_checkpoint(path, ddp, optimizer)
    return {
        "rng_restored": loaded.rng_restored,
        "ranks_without_rng": loaded.ranks_without_rng,
        "warnings": [str(w.message) for w in caught],
    }
