"""What the pool's ranks run for tests/test_mistakes.py where the zoo needs a scenario of its
own: ranks whose backwards disagree on gradient order, a peer that starts late, a model with an
unused parameter. Results have train()'s shape ({"ours": {"names", "grads", "params"}}) so the
same checks (tests/harness/equivalence.py) read them."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.workloads import grads_of, load_implementation, params_of

LATE_PEER_PATIENCE_S = 0.5  # how long rank 1 waits for rank 0's "read" before going on anyway


def batch(rank: int, step: int, features: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, features, generator=g), torch.randn(4, features, generator=g)


def train_steps(
    net: nn.Module,
    implementation: str,
    steps: int,
    before_forward: Callable[[int], None] = lambda step: None,
    after_reading: Callable[[int], None] = lambda step: None,
) -> dict:
    """SGD on `net` (4 features in, 4 out) wrapped in `implementation`, every parameter in a
    bucket of its own; the gradients are read right after backward (and
    finish_gradient_synchronization), and each step calls the two callbacks around that."""
    model = load_implementation(implementation)(net, bucket_cap_mb=1e-6)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    grads, params = [], []
    for step in range(steps):
        before_forward(step)
        x, y = batch(dist.get_rank(), step, 4)
        nn.functional.mse_loss(model(x), y).backward()
        model.finish_gradient_synchronization()
        grads.append(grads_of(net))
        after_reading(step)
        optimizer.step()
        optimizer.zero_grad()
        params.append(params_of(net))
    names = [name for name, _ in net.named_parameters()]
    return {"ours": {"names": names, "grads": grads, "params": params}}


def train_rank_ordered_branches(implementation: str) -> dict:
    """tutorials/mistakes/ready_order.py's model: odd ranks produce its two gradients in the
    other order."""
    from tutorials.mistakes.ready_order import RankOrderedBranches

    torch.manual_seed(0)
    return train_steps(RankOrderedBranches(), implementation, steps=2)


def train_with_a_late_peer(implementation: str, flag_dir: str) -> dict:
    """Rank 1 starts each step only once rank 0 has read its gradients (or after
    LATE_PEER_PATIENCE_S, for a DDP that makes rank 0 wait for rank 1): so a rank 0 that reads
    .grad before the all-reduce is done certainly reads its own share, never the sum."""
    rank = dist.get_rank()

    def flag(step: int) -> Path:
        return Path(flag_dir) / f"rank-0-has-read-step-{step}"

    def rank_1_waits(step: int) -> None:
        deadline = time.monotonic() + LATE_PEER_PATIENCE_S
        while rank == 1 and not flag(step).exists() and time.monotonic() < deadline:
            time.sleep(0.002)

    def rank_0_has_read(step: int) -> None:
        if rank == 0:
            flag(step).touch()

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    return train_steps(net, implementation, 2, rank_1_waits, rank_0_has_read)


def two_steps_with_an_unused_parameter(use_torch: bool) -> dict:
    """tutorials/mistakes/unused_parameter.py's model under torch's DDP or MiniDDP, both with
    find_unused_parameters=False: the gradients after the backwards that returned, and what
    each of the first two steps raised (None if nothing)."""
    from miniddp import MiniDDP
    from tutorials.mistakes.unused_parameter import SpareHead

    net = SpareHead()
    model = (DistributedDataParallel if use_torch else MiniDDP)(net)
    raised, grads, params = [], [], []
    for step in range(2):
        x, y = batch(dist.get_rank(), step, 4)
        try:
            nn.functional.mse_loss(model(x), y[:, :1]).backward()
            raised.append(None)
        except RuntimeError as error:
            raised.append(str(error))
            break
        grads.append(grads_of(net))
        params.append(params_of(net))  # no optimizer: only the gradients can differ
    names = [name for name, _ in net.named_parameters()]
    return {"ours": {"names": names, "grads": grads, "params": params}, "raised": raised}
