"""What the pool's ranks run for tests/test_steps.py: a rung of the ladder and torch's DDP,
trained side by side on the same awkward little model and the same data."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp import MiniDDP
from miniddp.steps import LADDER


class Scrambled(nn.Module):
    """Layers registered in one order and used in another, so gradients arrive in neither
    registration order nor its reverse; BatchNorm statistics; optionally a float64 layer."""

    def __init__(self, seed: int, mixed_dtypes: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.head = nn.Linear(16, 3)
        self.first = nn.Linear(6, 16)
        self.norm = nn.BatchNorm1d(16)
        self.middle = nn.Linear(16, 16)
        self.wide = nn.Linear(16, 16).double() if mixed_dtypes else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.middle(self.norm(torch.tanh(self.first(x)))))
        if self.wide is not None:
            hidden = torch.tanh(self.wide(hidden.double())).float()
        return self.head(hidden)


def train(
    wrap: Callable[[nn.Module], nn.Module], mixed_dtypes: bool, steps: int, backwards_per_step: int
) -> dict:
    """Train one replica; gradients after each synchronized backward, state after each step.

    Each rank builds its model from its own seed: the wrapper must start every rank from
    rank 0's weights. Several backwards between optimizer steps accumulate into `.grad`.
    """
    rank = dist.get_rank()
    net = Scrambled(seed=rank, mixed_dtypes=mixed_dtypes)
    model = wrap(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    grads, states = [], []
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(backwards_per_step):
            data = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
            x, y = torch.randn(5, 6, generator=data), torch.randn(5, 3, generator=data)
            nn.functional.mse_loss(model(x), y).backward()
            if hasattr(model, "finish_gradient_synchronization"):  # torch's DDP has none
                model.finish_gradient_synchronization()
            grads.append([p.grad.clone() for p in net.parameters()])
        optimizer.step()
        states.append([t.clone() for t in net.state_dict().values()])
    return {"grads": grads, "states": states, "layout": bucket_layout(model, net)}


def bucket_layout(model: nn.Module, net: nn.Module) -> list[list[str]] | None:
    """Buckets in launch order, as parameter names; None for a rung without buckets."""
    if isinstance(model, DistributedDataParallel):
        name_of = {id(p): n for n, p in net.named_parameters()}
        buckets = model.reducer._get_zeros_like_grad_buckets()
        return [[name_of[id(p)] for p in bucket.parameters()] for bucket in buckets]
    if isinstance(model, MiniDDP):
        return [list(info.param_names) for info in model.buckets]
    if hasattr(model, "buckets"):
        return [[model.param_names[i] for i in bucket.params] for bucket in model.buckets]
    return None


def rung_and_torch(
    rung: int, bucket_cap_mb: float | None, mixed_dtypes: bool = False, steps: int = 3
) -> dict:
    """Rung `rung` (numbered from 1) and torch's DDP, with the same cap, one after the other."""
    cls = LADDER[rung - 1]
    return {
        "rung": train(lambda m: cls(m, bucket_cap_mb=bucket_cap_mb), mixed_dtypes, steps, 2),
        "torch": train(
            lambda m: DistributedDataParallel(m, bucket_cap_mb=bucket_cap_mb),
            mixed_dtypes,
            steps,
            2,
        ),
    }


class WithExtraLayer(nn.Module):
    """`extra` takes part in the loss only on the ranks in `used_on`."""

    def __init__(self, used_on: tuple[int, ...]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(4, 2)
        self.extra = nn.Linear(4, 2)
        self.use_extra = dist.get_rank() in used_on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x) + (self.extra(x) if self.use_extra else 0)


def backward_with_extra_layer(rung: int, used_on: tuple[int, ...]) -> str:
    """One backward of a rung whose `extra` layer some ranks (or none) do not use."""
    model = LADDER[rung - 1](WithExtraLayer(used_on))
    model(torch.randn(3, 4)).sum().backward()
    model.finish_gradient_synchronization()
    return "synchronized"


def construct(rung: int, case: str) -> None:
    """Build a rung from one kind of bad input; the test expects every rank to raise."""
    if case == "no_trainable":
        LADDER[rung - 1](nn.Linear(2, 2).requires_grad_(False))
    elif case == "cap_zero":
        LADDER[rung - 1](nn.Linear(2, 2), bucket_cap_mb=0)
    elif case == "cap_text":
        LADDER[rung - 1](nn.Linear(2, 2), bucket_cap_mb="25")
    else:
        raise AssertionError(f"unknown case {case}")


def all_reduces_per_micro_step(rung: int, micro_steps: int) -> tuple[list[list[int]], int]:
    """After one plain step (the buckets' rebuild), two optimizer steps of `micro_steps`
    micro-steps, all but the last inside no_sync(): the all-reduces each micro-step launched,
    and the number of buckets."""
    model = LADDER[rung - 1](Scrambled(seed=0, mixed_dtypes=False), bucket_cap_mb=0.0015)
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    for _ in range(2):  # the first records the order, the second's forward rebuilds
        nn.functional.mse_loss(model(x), y).backward()
    counts = []
    for _ in range(2):
        per_micro_step = []
        for micro in range(micro_steps):
            before = model.all_reduce_count
            last = micro == micro_steps - 1
            with contextlib.nullcontext() if last else model.no_sync():
                nn.functional.mse_loss(model(x), y).backward()
            per_micro_step.append(model.all_reduce_count - before)
        counts.append(per_micro_step)
    return counts, len(model.buckets)


def register_hook(case: str) -> None:
    """Rung 7's comm hook registered twice, or after training began: the test expects errors."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model = LADDER[6](nn.Linear(2, 2))
    if case == "after_a_backward":
        model(torch.randn(3, 2)).sum().backward()
    model.register_comm_hook(None, allreduce_hook)
    model.register_comm_hook(None, allreduce_hook)
