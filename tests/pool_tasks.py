"""Task functions for tests/test_pool.py. They run inside the pool's workers, which import them
by module name, so they live here rather than in the test file."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def all_reduce_contributions(contributions: list[int]) -> int:
    """Rank r contributes `contributions[r]`; every rank should see the sum."""
    total = torch.tensor([contributions[dist.get_rank()]], dtype=torch.int64)
    dist.all_reduce(total)
    return int(total.item())


def raise_on_rank(failing_rank: int, message: str) -> int:
    """Fails before any collective, so the other ranks are not left waiting."""
    if dist.get_rank() == failing_rank:
        raise ValueError(message)
    return dist.get_rank()


def raise_everywhere(message: str) -> None:
    raise KeyError(f"{message} on rank {dist.get_rank()}")


def sleep_on_rank(slow_rank: int, seconds: float) -> int:
    if dist.get_rank() == slow_rank:
        time.sleep(seconds)
    return dist.get_rank()


def exit_on_rank(dying_rank: int, exit_code: int) -> int:
    if dist.get_rank() == dying_rank:
        os._exit(exit_code)
    return dist.get_rank()


def leave_ranks_out_of_step(failing_rank: int) -> None:
    """The other ranks start an all_reduce that `failing_rank` never joins, then carry on, so
    their collectives are numbered one ahead of its own from now on."""
    if dist.get_rank() == failing_rank:
        raise RuntimeError("failed before the all_reduce")
    dist.all_reduce(torch.full((1,), 100), async_op=True)


def process_id() -> int:
    return os.getpid()
