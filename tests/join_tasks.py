"""Training that the pool's ranks run for tests/test_join.py: the same scenario under torch's
DistributedDataParallel and under MiniDDP, from the same weights on the same data, so the test can
compare the two bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from miniddp import MiniDDP, ZeroRedundancyOptimizer

WRAPPERS: dict[str, Callable[..., nn.Module]] = {
    "torch": DistributedDataParallel,
    "miniddp": MiniDDP,
}


class WithBatchNorm(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


class SometimesUnused(nn.Module):
    """`branch` joins the output only for inputs whose first feature sums positive, so it is
    used on some ranks and steps and not on others: find_unused_parameters territory."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 4)
        self.branch = nn.Linear(4, 2)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.trunk(x))
        out = self.head(hidden)
        return out + self.branch(hidden) if x[:, 0].sum() > 0 else out


class Deep(nn.Sequential):
    """Six layers: with a tiny bucket cap, several buckets."""

    def __init__(self) -> None:
        super().__init__(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(nn.functional.pad(x, (0, 4)))[:, :2]


class BlockRunTwice(nn.Module):
    """The same block applied twice, each time under reentrant checkpointing: each of its
    parameters gets two gradient contributions in two inner backward passes."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.stem(x)
        for _ in range(2):
            hidden = checkpoint(self.block, hidden, use_reentrant=True)
        return self.head(hidden)


class BlockRunTwiceAndUnused(BlockRunTwice):
    """static_graph also finds parameters that no backward ever reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.never_used = nn.Linear(8, 8)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "batchnorm": WithBatchNorm,
    "unused": SometimesUnused,
    "buckets": Deep,
    "twice": BlockRunTwice,
    "twice_and_unused": BlockRunTwiceAndUnused,
}


def make_optimizer(wrapper: str, model: nn.Module, zero: bool) -> torch.optim.Optimizer:
    """SGD, or AdamW sharded by ZeroRedundancyOptimizer (torch's, or MiniDDP's)."""
    if not zero:
        return torch.optim.SGD(model.parameters(), lr=0.1)
    if wrapper == "torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero  # slow import

        return TorchZero(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    return ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)


def batches(count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 4, generator=generator), torch.randn(6, 2, generator=generator))
            for _ in range(count)]  # fmt: skip


def train(
    wrapper: str,
    model_name: str,
    steps_per_rank: list[int],
    ddp_options: dict,
    join_options: dict | None,
) -> dict[str, object]:
    """Train `model_name` wrapped in `wrapper` for `steps_per_rank[rank]` steps (inside a Join
    when `join_options` is given; through `model.join()` with its "model.join" key, and with
    ZeroRedundancyOptimizer, joined too, with its "zero" key); return the final state, the last
    gradients and the losses."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = WRAPPERS[wrapper](MODELS[model_name](), **ddp_options)
    options = dict(join_options or {})
    zero = options.pop("zero", False)
    optimizer = make_optimizer(wrapper, model, zero)
    losses = []

    def run() -> None:
        for inputs, targets in batches(steps_per_rank[rank], seed=100 + rank):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())

    if join_options is None:
        run()
    else:
        joinables = [model, optimizer] if zero else [model]
        with (
            model.join(**options)
            if options.pop("model.join", False)
            else Join(joinables, **options)
        ):
            run()
    return {
        "state": {k: v.clone() for k, v in model.module.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "losses": losses,
    }


def both(model_name: str, steps_per_rank: list[int], ddp_options: dict,
         join_options: dict | None) -> dict[str, dict]:  # fmt: skip
    """The same training under torch's DDP and under MiniDDP, in one task."""
    return {
        wrapper: train(wrapper, model_name, steps_per_rank, ddp_options, join_options)
        for wrapper in WRAPPERS
    }


def early_termination(wrapper: str) -> int:
    """Rank 0 has one batch, the others three; with throw_on_early_termination every rank
    raises at the start of the second step (the test expects that)."""
    return len(train(wrapper, "buckets", [1] + [3] * (dist.get_world_size() - 1), {},
                     {"throw_on_early_termination": True})["losses"])  # fmt: skip


def torch_with_a_rank_adding_zeros(model_name: str, steps: int, ddp_options: dict) -> dict:
    """What Join promises for a rank that has no batch at all: it takes part as a rank whose
    gradients are zeros. Here rank 0 literally does that, with torch's DDP and no Join: every
    step it backpropagates its loss times 0, so the others' losses, gradients and weights are
    what a joined rank 0 would leave them."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = WRAPPERS["torch"](MODELS[model_name](), **ddp_options)
    optimizer = make_optimizer("torch", model, zero=False)
    losses = []
    for inputs, targets in batches(steps, seed=100 + rank):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        (loss * 0 if rank == 0 else loss).backward()
        optimizer.step()
        losses.append(loss.item())
    return {
        "state": {k: v.clone() for k, v in model.module.state_dict().items()},
        "losses": losses,
    }


def without_static_graph() -> None:
    """The block run twice under reentrant checkpointing, without static_graph: refused."""
    train("miniddp", "twice", [2] * dist.get_world_size(), {}, None)
