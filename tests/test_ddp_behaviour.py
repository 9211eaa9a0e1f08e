"""MiniDDP's behaviour beyond the numbers: errors on bad input, construction-time broadcast,
overlap during backward, no_sync's savings and gradient_as_bucket_view.

Each scenario the ranks run is a module-level function (its models module-level classes) next to
the test that checks it: the pool's workers import them as `tests.test_ddp_behaviour.<name>`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp import MiniDDP
from miniddp.observe.events import Recorder
from tests.harness.pool import RankFailure


def every_rank_raised(outcomes: list, error: str, *phrases: str) -> None:
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, RankFailure), f"rank {rank} did not raise"
        assert outcome.type_name == error, f"rank {rank}: {outcome.type_name}: {outcome.message}"
        for phrase in phrases:
            assert phrase in outcome.message, f"rank {rank}: {phrase!r} not in {outcome.message!r}"


def small_mlp(seed: int = 0, width: int = 8) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.Linear(width, 2)]
    return nn.Sequential(*layers)


def rank_batch(rows: int = 8, features: int = 4) -> torch.Tensor:
    return torch.randn(rows, features, generator=torch.Generator().manual_seed(dist.get_rank()))


def gradients(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def same_gradients(ours: list, theirs: list) -> bool:
    return all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(ours, theirs, strict=True)
    )


@pytest.mark.skipif(dist.is_initialized(), reason="needs a process without a process group")
def test_without_a_process_group_says_how_to_launch():
    with pytest.raises(RuntimeError, match="no(ne)?.*torchrun"):
        MiniDDP(nn.Linear(2, 2))


def cap_zero() -> None:
    MiniDDP(small_mlp(), bucket_cap_mb=0)


def cap_nan() -> None:
    MiniDDP(small_mlp(), bucket_cap_mb=float("nan"))


def no_trainable() -> None:
    model = small_mlp()
    model.requires_grad_(False)
    MiniDDP(model)


def sparse() -> None:
    MiniDDP(nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Linear(3, 1)))


def shape_mismatch() -> None:
    MiniDDP(small_mlp(width=8 if dist.get_rank() == 0 else 9))


def count_mismatch() -> None:
    model = small_mlp()
    MiniDDP(model if dist.get_rank() == 0 else nn.Sequential(*model, nn.Linear(2, 2)))


def settings_mismatch() -> None:
    MiniDDP(small_mlp(), bucket_cap_mb=1 if dist.get_rank() == 0 else 2)


BAD_CONSTRUCTION = [
    (cap_zero, "ValueError", "bucket_cap_mb must be a positive", "got 0"),
    (cap_nan, "ValueError", "bucket_cap_mb must be a positive", "got nan"),
    (count_mismatch, "ValueError", "same model and settings", "6 parameters", "rank 1 has 8"),
    (no_trainable, "ValueError", "no parameter that requires grad"),
    (settings_mismatch, "ValueError", "bucket_cap_mb", "(1048576, 1048576) on rank 0"),
    (shape_mismatch, "ValueError", "same model and settings", "'0.weight'", "rank 1"),
    (sparse, "ValueError", "sparse gradients", "sparse=False"),
]


@pytest.mark.parametrize(
    "construct, error, phrases",
    [pytest.param(c, e, p, id=c.__name__) for c, e, *p in BAD_CONSTRUCTION],
)
def test_bad_construction_raises_on_every_rank(
    pool2, construct: Callable[[], None], error: str, phrases: list[str]
):
    outcomes = pool2.run_expecting_errors(construct, timeout=60)
    every_rank_raised(outcomes, error, *phrases)


def backward_twice() -> None:
    ddp = MiniDDP(small_mlp())
    loss = ddp(torch.randn(3, 4)).sum()
    loss.backward(retain_graph=True)
    loss.backward()


def test_backward_twice_on_one_synced_forward_raises(pool2):
    outcomes = pool2.run_expecting_errors(backward_twice, timeout=60)
    every_rank_raised(outcomes, "RuntimeError", "backward ran twice", "no_sync")


class WithExtraLayer(nn.Module):
    """`extra` is registered but never used in forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(4, 2)
        self.extra = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def unused_parameter_without_find_unused() -> None:
    ddp = MiniDDP(WithExtraLayer())
    ddp(torch.randn(3, 4)).sum().backward()


def test_unused_parameter_is_named_at_the_end_of_that_backward(pool2):
    outcomes = pool2.run_expecting_errors(unused_parameter_without_find_unused)
    every_rank_raised(
        outcomes, "RuntimeError", "extra.weight", "extra.bias", "find_unused_parameters=True"
    )


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


def test_training_continues_after_the_unused_parameter_error(pool2):
    # rank r feeds x = r + 1 to a sum over 3 samples: the averaged gradient is 3 * mean(1, 2).
    assert pool2.run(recovers_after_unused_parameter_error) == [4.5, 4.5]


def weights_after_construction() -> list[torch.Tensor]:
    """Every rank starts from a different random init; MiniDDP must copy rank 0's."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    torch.manual_seed(100 + dist.get_rank())
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.copy_(torch.randint(0, 50, tensor.shape).to(tensor.dtype))
    before = [t.clone() for t in model.state_dict().values()]
    MiniDDP(model)
    return [before, [t.clone() for t in model.state_dict().values()]]


def test_construction_copies_rank_0s_parameters_and_buffers(pool2):
    # (broadcast_buffers=False keeps buffers rank-local here, as torch does:
    # tests/test_ddp_torch213_args.py checks every buffer keyword against torch's DDP.)
    (rank0_before, rank0_after), (rank1_before, rank1_after) = pool2.run(weights_after_construction)
    assert any(not torch.equal(a, b) for a, b in zip(rank0_before, rank1_before))
    for original, on_rank0, on_rank1 in zip(rank0_before, rank0_after, rank1_after):
        assert torch.equal(original, on_rank0)
        assert torch.equal(original, on_rank1)


def events_of_second_iteration() -> list[tuple[str, str]]:
    """Iteration 1 is one big bucket; from iteration 2 on, small buckets launch during backward."""
    torch.manual_seed(0)
    layers = [nn.Linear(32, 32) for _ in range(6)]
    ddp = MiniDDP(nn.Sequential(*layers), bucket_cap_mb=0.005)
    x = torch.randn(16, 32)
    ddp(x).sum().backward()
    recorder = ddp.observer = Recorder()
    ddp(x).sum().backward()
    return [(e.kind, e.name) for e in recorder.events]


def test_buckets_launch_while_backward_is_still_running(rank_pools):
    for events in rank_pools(2).run(events_of_second_iteration):
        kinds = [kind for kind, _ in events]
        first_launch = kinds.index("launch")
        last_hook = len(kinds) - 1 - kinds[::-1].index("hook")
        assert first_launch < last_hook, "no bucket was launched before backward finished"
        launches = [name for kind, name in events if kind == "launch"]
        assert launches == sorted(launches, key=lambda n: int(n.split()[1])), "out of order"
        assert len(launches) >= 3


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


@pytest.mark.parametrize("steps", [1, 3])
def test_no_sync_communicates_once_per_accumulation(pool2, steps):
    (with_no_sync, buckets), _ = pool2.run(all_reduces_for_accumulation, steps, True)
    (without, _), _ = pool2.run(all_reduces_for_accumulation, steps, False)
    assert buckets > 1
    assert with_no_sync == buckets
    assert without == steps * buckets


def all_reduces_with_torchs_flag(steps: int) -> tuple[int, int]:
    """Accumulation as code written for torch's DDP may do it without no_sync() (accelerate
    does): by setting torch's public attribute require_backward_grad_sync before each forward."""
    ddp = MiniDDP(small_mlp(), bucket_cap_mb=0.0001)
    ddp(torch.randn(3, 4)).sum().backward()  # first step: learn the order, rebuild buckets
    ddp(torch.randn(3, 4)).sum().backward()
    before = ddp.all_reduce_count
    for micro in range(steps):
        ddp.require_backward_grad_sync = micro == steps - 1
        ddp(torch.randn(3, 4)).sum().backward()
    return ddp.all_reduce_count - before, len(ddp.buckets)


def test_torchs_require_backward_grad_sync_holds_back_like_no_sync(pool2):
    for count, buckets in pool2.run(all_reduces_with_torchs_flag, 3):
        assert buckets > 1
        assert count == buckets


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


def test_gradient_as_bucket_view_makes_grad_the_bucket(pool2):
    assert pool2.run(grad_is_bucket_view) == [True, True]


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
        ddp(rank_batch()).sum().backward()
        steps.append(gradients(model))
    return steps


def test_reentrant_checkpointing_of_the_block_whose_gradients_come_first(pool2):
    """The end-of-backward wait belongs to the outer backward, not to the checkpoint's inner
    one, so the earlier layers' gradients are still reduced: bitwise what torch's DDP gives."""
    ours = pool2.run(reentrant_checkpoint_of_the_last_block, False)
    theirs = pool2.run(reentrant_checkpoint_of_the_last_block, True)
    for rank in range(2):
        for step, (a, b) in enumerate(zip(ours[rank], theirs[rank])):
            assert same_gradients(a, b), f"rank {rank} step {step} differs from torch's DDP"


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
        ddp(rank_batch()).sum().backward()
    return gradients(net)


def test_a_module_wrapped_again_trains_like_torch(pool2):
    """The newer wrapper takes the module's hooks over: its backward averages as usual."""
    ours = pool2.run(gradients_after_wrapping, 2, False)
    theirs = pool2.run(gradients_after_wrapping, 2, True)
    assert all(same_gradients(a, b) for a, b in zip(ours, theirs))


def old_wrapper_after_a_new_one() -> None:
    net = nn.Linear(4, 1)
    old = MiniDDP(net)
    MiniDDP(net)
    old(rank_batch())


def test_the_older_wrapper_refuses_once_a_newer_one_owns_the_hooks(pool2):
    outcomes = pool2.run_expecting_errors(old_wrapper_after_a_new_one, timeout=60)
    every_rank_raised(outcomes, "RuntimeError", "newer MiniDDP")


class HeadPair(NamedTuple):
    used: torch.Tensor
    ignored: torch.Tensor


@dataclasses.dataclass
class HeadsDataclass:
    used: torch.Tensor
    ignored: torch.Tensor


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


def structured_output_with_an_ignored_head(kind: str, use_torch: bool) -> list:
    model = StructuredOutput(kind)
    wrapper = DistributedDataParallel if use_torch else MiniDDP
    ddp = wrapper(model, find_unused_parameters=True, bucket_cap_mb=0.0001)
    steps = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        out = ddp(rank_batch())
        if kind == "dataclass":  # both heads: torch 2.13 fails when a dataclass's head is ignored
            loss = out.used.sum() + out.ignored.sum()
        else:
            loss = (out["used"] if kind == "dict" else out[0]).sum()
        loss.backward()
        steps.append(gradients(model))
    return steps


@pytest.mark.parametrize("kind", ["dict", "tuple", "namedtuple", "dataclass"])
def test_structured_outputs_with_an_ignored_head_train_like_torch(pool2, kind):
    """find_unused_parameters finds tensors in dicts, tuples, namedtuples and dataclasses; a head
    reachable from the output but left out of the loss is unused: its .grad stays None. (With a
    dataclass both heads are used: torch's DDP itself refuses an ignored one there.)"""
    ours = pool2.run(structured_output_with_an_ignored_head, kind, False)
    theirs = pool2.run(structured_output_with_an_ignored_head, kind, True)
    for rank in range(2):
        for step, (a, b) in enumerate(zip(ours[rank], theirs[rank])):
            assert same_gradients(a, b), f"rank {rank} step {step} differs from torch's DDP"
        if kind != "dataclass":
            assert ours[rank][-1][-1] is None, "the ignored head should keep .grad None"


def model_on_meta() -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 2)
    MiniDDP(model)


def test_a_model_on_meta_is_refused_at_construction_with_the_fix(pool2):
    outcomes = pool2.run_expecting_errors(model_on_meta, timeout=60)
    every_rank_raised(outcomes, "ValueError", "meta device", "to_empty")


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


def test_a_fresh_forward_works_after_an_error_inside_backward(pool2):
    assert pool2.run(fresh_forward_after_an_error_in_backward) == [3.0, 3.0]
