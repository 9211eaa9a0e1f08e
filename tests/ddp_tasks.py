"""Small MiniDDP scenarios that the pool's ranks run for tests/test_ddp_behaviour.py."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp import MiniDDP


def small_mlp(seed: int = 0, width: int = 8) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.Linear(width, 2)]
    return nn.Sequential(*layers)


class WithExtraLayer(nn.Module):
    """`extra` is registered but never used in forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(4, 2)
        self.extra = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def construct(case: str) -> None:
    """Build MiniDDP from one kind of bad input; the test expects every rank to raise."""
    rank = dist.get_rank()
    if case == "cap_zero":
        MiniDDP(small_mlp(), bucket_cap_mb=0)
    elif case == "cap_nan":
        MiniDDP(small_mlp(), bucket_cap_mb=float("nan"))
    elif case == "no_trainable":
        model = small_mlp()
        model.requires_grad_(False)
        MiniDDP(model)
    elif case == "sparse":
        MiniDDP(nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Linear(3, 1)))
    elif case == "shape_mismatch":
        MiniDDP(small_mlp(width=8 if rank == 0 else 9))
    elif case == "settings_mismatch":
        MiniDDP(small_mlp(), bucket_cap_mb=1 if rank == 0 else 2)
    elif case == "count_mismatch":
        model = small_mlp()
        MiniDDP(model if rank == 0 else nn.Sequential(*model, nn.Linear(2, 2)))
    else:
        raise AssertionError(f"unknown case {case}")


def backward_twice() -> None:
    ddp = MiniDDP(small_mlp())
    loss = ddp(torch.randn(3, 4)).sum()
    loss.backward(retain_graph=True)
    loss.backward()


def unused_parameter_without_find_unused() -> None:
    ddp = MiniDDP(WithExtraLayer())
    ddp(torch.randn(3, 4)).sum().backward()


def recovers_after_unused_parameter_error() -> float:
    """After the error, a step that uses every parameter synchronizes normally."""
    model = WithExtraLayer()
    ddp = MiniDDP(model)
    try:
        ddp(torch.randn(3, 4)).sum().backward()
    except RuntimeError:
        pass
    model.zero_grad()
    x = torch.full((3, 4), float(dist.get_rank() + 1))
    (ddp(x).sum() + model.extra(x).sum()).backward()
    return model.used.weight.grad[0, 0].item()


def weights_after_construction(broadcast_buffers: bool) -> list[torch.Tensor]:
    """Every rank starts from a different random init; MiniDDP must copy rank 0's."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    torch.manual_seed(100 + dist.get_rank())
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.copy_(torch.randint(0, 50, tensor.shape).to(tensor.dtype))
    before = [t.clone() for t in model.state_dict().values()]
    MiniDDP(model, broadcast_buffers=broadcast_buffers)
    return [before, [t.clone() for t in model.state_dict().values()]]


def events_of_second_iteration() -> list[tuple[str, str]]:
    """Iteration 1 is one big bucket; from iteration 2 on, small buckets launch during backward."""
    torch.manual_seed(0)
    layers = [nn.Linear(32, 32) for _ in range(6)]
    ddp = MiniDDP(nn.Sequential(*layers), bucket_cap_mb=0.005)
    x = torch.randn(16, 32)
    ddp(x).sum().backward()
    ddp.record_events(True)
    ddp(x).sum().backward()
    return [(e.kind, e.name) for e in ddp.events]


def all_reduces_for_accumulation(steps: int, use_no_sync: bool) -> tuple[int, int]:
    ddp = MiniDDP(small_mlp(), bucket_cap_mb=0.0001)
    ddp(torch.randn(3, 4)).sum().backward()  # first step: learn the order, rebuild buckets
    ddp(torch.randn(3, 4)).sum().backward()
    before = ddp.all_reduce_count
    for micro in range(steps):
        if use_no_sync and micro < steps - 1:
            with ddp.no_sync():
                ddp(torch.randn(3, 4)).sum().backward()
        else:
            ddp(torch.randn(3, 4)).sum().backward()
    return ddp.all_reduce_count - before, len(ddp.buckets)


def grad_is_bucket_view() -> bool:
    model = small_mlp()
    ddp = MiniDDP(model, gradient_as_bucket_view=True, bucket_cap_mb=0.0001)
    for _ in range(3):
        ddp(torch.randn(3, 4)).sum().backward()
        model.zero_grad(set_to_none=False)
    flats = [bucket.flat for bucket in ddp._layout.buckets]
    return all(
        any(p.grad.untyped_storage().data_ptr() == f.untyped_storage().data_ptr() for f in flats)
        for p in model.parameters()
    )


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _rank_batch(rows: int = 8, features: int = 4) -> torch.Tensor:
    return torch.randn(rows, features, generator=torch.Generator().manual_seed(dist.get_rank()))


class LastBlockCheckpointed(nn.Module):
    """The block whose gradients arrive first runs under reentrant checkpointing: its inner
    backward ends before the layers below it get their gradients."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l0, self.l1 = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.l1, torch.tanh(self.l0(x)), use_reentrant=True)


def reentrant_checkpoint_of_the_last_block(use_torch: bool) -> list:
    model = LastBlockCheckpointed()
    wrapper = DistributedDataParallel if use_torch else MiniDDP
    ddp = wrapper(model, bucket_cap_mb=0.0001)
    steps = []
    for _ in range(3):
        model.zero_grad()
        ddp(_rank_batch()).sum().backward()
        steps.append(_grads(model))
    return steps


def gradients_after_wrapping(times: int, use_torch: bool) -> list:
    """Wrap the same module `times` times, one backward under each wrapper; the gradients of
    the last. Each wrapper is kept in a variable: torch's DDP, used as a temporary
    (`DDP(net)(x).sum().backward()`), is garbage-collected before backward and averages nothing."""
    wrapper = DistributedDataParallel if use_torch else MiniDDP
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    for _ in range(times):
        net.zero_grad()
        ddp = wrapper(net)
        ddp(_rank_batch()).sum().backward()
    return _grads(net)


def old_wrapper_after_a_new_one() -> None:
    net = nn.Linear(4, 1)
    old = MiniDDP(net)
    MiniDDP(net)
    old(_rank_batch())


class StructuredOutput(nn.Module):
    """Two heads; the loss uses only one. The other head is reachable from the output but
    gets no gradient, which torch's find_unused_parameters treats as unused."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.body, self.used, self.ignored = nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor):
        h = torch.tanh(self.body(x))
        a, b = self.used(h), self.ignored(h)
        if self.kind == "dict":
            return {"used": a, "ignored": b}
        if self.kind == "tuple":
            return (a, b)
        if self.kind == "namedtuple":
            return HeadPair(a, b)
        return HeadsDataclass(a, b)


class HeadPair(NamedTuple):
    used: torch.Tensor
    ignored: torch.Tensor


@dataclasses.dataclass
class HeadsDataclass:
    used: torch.Tensor
    ignored: torch.Tensor


def structured_output_with_an_ignored_head(kind: str, use_torch: bool) -> list:
    model = StructuredOutput(kind)
    wrapper = DistributedDataParallel if use_torch else MiniDDP
    ddp = wrapper(model, find_unused_parameters=True, bucket_cap_mb=0.0001)
    steps = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        out = ddp(_rank_batch())
        if kind == "dataclass":  # both heads: torch 2.13 fails when a dataclass's head is ignored
            loss = out.used.sum() + out.ignored.sum()
        else:
            loss = (out["used"] if kind == "dict" else out[0]).sum()
        loss.backward()
        steps.append(_grads(model))
    return steps


def model_on_meta() -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 2)
    MiniDDP(model)


class FailsOnce(torch.autograd.Function):
    """Identity whose backward raises the first time: an error inside backward, on every rank."""

    failed = False

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if not FailsOnce.failed:
            FailsOnce.failed = True
            raise ValueError("deliberate failure inside backward")
        return grad


def fresh_forward_after_an_error_in_backward() -> float:
    """A backward that raised halfway, then a normal step: it must synchronize normally."""
    FailsOnce.failed = False
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    ddp = MiniDDP(model, bucket_cap_mb=0.0001)
    x = torch.full((3, 4), float(dist.get_rank() + 1))
    try:
        FailsOnce.apply(ddp(x)).sum().backward()
    except ValueError:
        pass
    model.zero_grad()
    ddp(x).sum().backward()
    return model[1].bias.grad.item()  # d(sum)/d(bias) = 3 samples on every rank
