"""Task functions for tests/test_link.py, run inside the pool's workers."""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp import MiniDDP
from miniddp.job.faults import wait_for
from miniddp.observe.link import Link, all_reduce_hook, simulated_link


def all_reduces_over_the_link(link_text: str, numel: int) -> dict:
    """Two async all-reduces issued back to back, waited through MiniDDP's `wait_for`, and one
    blocking one: their sums, and when each was seen complete (seconds after the first issue)."""
    rank = dist.get_rank()
    first = torch.full((numel,), float(rank + 1))
    second = torch.full((numel,), 10.0 * (rank + 1))
    blocking = torch.full((numel,), 100.0 * (rank + 1))
    dist.barrier()
    with simulated_link(Link.parse(link_text)):
        start = time.perf_counter()
        works = [dist.all_reduce(t, async_op=True) for t in (first, second)]
        issued = time.perf_counter() - start
        done = []
        for index, work in enumerate(works):
            wait_for(work, f"test all-reduce {index}")
            done.append(time.perf_counter() - start)
        returned = dist.all_reduce(blocking)
        done.append(time.perf_counter() - start)
    return {
        "issued_s": issued,
        "done_s": done,
        "returned": returned,
        "sums": [first[0].item(), second[0].item(), blocking[0].item()],
        "work_type": type(works[0]).__name__,
        "restored": not hasattr(dist.all_reduce, "simulated_link"),
    }


def gradients_over_the_link(link_text: str) -> bool:
    """MiniDDP, and torch's DDP through `all_reduce_hook`, on the link: bit-identical gradients."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    grads = []
    with simulated_link(Link.parse(link_text)):
        ours = MiniDDP(copy.deepcopy(net), bucket_cap_mb=0.0005)
        theirs = DistributedDataParallel(copy.deepcopy(net), bucket_cap_mb=0.0005)
        theirs.register_comm_hook(None, all_reduce_hook)
        for model in (ours, theirs):
            model(batch).square().mean().backward()
            grads.append([p.grad for p in model.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*grads))
