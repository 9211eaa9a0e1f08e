"""Uneven inputs under Join, and static_graph=True: MiniDDP against torch's DDP doing the same
training on the same data, bit for bit, at W = 2 and 3.

Every scenario runs on the ranks as `both`: the same training under torch's
DistributedDataParallel and under MiniDDP, from the same weights on the same data. Its models
and tasks are module-level, next to the tests that use them: the pool's workers import them as
`tests.test_join.<name>`."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from miniddp import MiniDDP, ZeroRedundancyOptimizer
from tests.harness.pool import RankFailure

WRAPPERS: dict[str, Callable[..., nn.Module]] = {
    "torch": DistributedDataParallel,
    "miniddp": MiniDDP,
}
Model = Callable[[], nn.Module]


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
    return [
        (torch.randn(6, 4, generator=generator), torch.randn(6, 2, generator=generator))
        for _ in range(count)
    ]


def train(
    wrapper: str,
    model_class: Model,
    steps_per_rank: list[int],
    ddp_options: dict,
    join_options: dict | None,
) -> dict[str, object]:
    """Train `model_class()` wrapped in `wrapper` for `steps_per_rank[rank]` steps (inside a Join
    when `join_options` is given; through `model.join()` with its "model.join" key, and with
    ZeroRedundancyOptimizer, joined too, with its "zero" key); return the final state, the last
    gradients and the losses."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = WRAPPERS[wrapper](model_class(), **ddp_options)
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


def both(
    model_class: Model, steps_per_rank: list[int], ddp_options: dict, join_options: dict | None
) -> dict[str, dict]:
    """The same training under torch's DDP and under MiniDDP, in one task."""
    return {
        wrapper: train(wrapper, model_class, steps_per_rank, ddp_options, join_options)
        for wrapper in WRAPPERS
    }


def assert_bitwise_equal(results: list[dict]) -> None:
    """On every rank, MiniDDP's losses, last gradients and final weights and buffers are
    torch's, bit for bit; and the replicas end identical (Join's final model sync)."""
    for rank, result in enumerate(results):
        ours, theirs = result["miniddp"], result["torch"]
        assert ours["losses"] == theirs["losses"], f"rank {rank}: losses differ"
        for name, value in theirs["state"].items():
            assert torch.equal(ours["state"][name], value), f"rank {rank}: {name} differs"
        for index, (mine, reference) in enumerate(zip(ours["grads"], theirs["grads"])):
            assert (mine is None) == (reference is None), f"rank {rank}: grad {index} presence"
            if mine is not None:
                assert torch.equal(mine, reference), f"rank {rank}: grad {index} differs"
    for result in results[1:]:
        for name, value in results[0]["miniddp"]["state"].items():
            assert torch.equal(result["miniddp"]["state"][name], value), f"replicas differ: {name}"


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


JOIN_SCENARIOS = {
    # model, extra DDP options, Join options
    "batchnorm": (WithBatchNorm, {}, {}),
    "find_unused": (SometimesUnused, {"find_unused_parameters": True}, {}),
    "several_buckets": (Deep, {"bucket_cap_mb": 0.0002}, {}),
    "zero_redundancy_optimizer": (Deep, {"bucket_cap_mb": 0.0002}, {"zero": True}),
    "effective_world_size": (
        Deep,
        {"bucket_cap_mb": 0.0002},
        {"divide_by_initial_world_size": False},
    ),
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("scenario", sorted(JOIN_SCENARIOS))
def test_join_with_uneven_inputs_is_torchs_join(rank_pools, world_size, scenario):
    """Rank r has 2 + 2r batches: rank 0 joins first, after two steps (so buffers must come
    from another rank), and the others keep training and rebuilding their buckets."""
    model, ddp_options, join_options = JOIN_SCENARIOS[scenario]
    steps = [2 + 2 * rank for rank in range(world_size)]
    results = rank_pools(world_size).run(both, model, steps, ddp_options, join_options, timeout=120)
    assert_bitwise_equal(results)
    assert [len(r["miniddp"]["losses"]) for r in results] == steps


@pytest.mark.parametrize("world_size", [2, 3])
def test_model_join_trains_a_rank_with_no_batch_at_all(rank_pools, world_size):
    """The last rank has no batch: it joins before any bucket layout was observed."""
    steps = [3] * (world_size - 1) + [0]
    results = rank_pools(world_size).run(both, Deep, steps, {}, {"model.join": True}, timeout=120)
    assert_bitwise_equal(results)


def early_termination(wrapper: str) -> int:
    """Rank 0 has one batch, the others three; with throw_on_early_termination every rank
    raises at the start of the second step (the test expects that)."""
    steps = [1] + [3] * (dist.get_world_size() - 1)
    result = train(wrapper, Deep, steps, {}, {"throw_on_early_termination": True})
    return len(result["losses"])


def test_throw_on_early_termination_raises_on_every_rank(pool2):
    outcomes = pool2.run_expecting_errors(early_termination, "miniddp", timeout=60)
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, RankFailure), f"rank {rank} did not raise"
        assert "exhausted" in outcome.message, outcome.message


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


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("bucket_cap_mb", [None, 0.0002])
def test_static_graph_trains_a_block_run_twice_under_reentrant_checkpointing(
    rank_pools, world_size, bucket_cap_mb
):
    """Four steps: the first counts hooks, the second records the order, the third rebuilds."""
    options = {"static_graph": True, "bucket_cap_mb": bucket_cap_mb}
    results = rank_pools(world_size).run(
        both, BlockRunTwice, [4] * world_size, options, None, timeout=120
    )
    assert_bitwise_equal(results)


class BlockRunTwiceAndUnused(BlockRunTwice):
    """static_graph also finds parameters that no backward ever reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.never_used = nn.Linear(8, 8)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("find_unused_parameters", [False, True])
def test_static_graph_finds_a_parameter_never_used(rank_pools, world_size, find_unused_parameters):
    """`never_used` fires no hook in the first backward: it is marked ready at once after that
    (find_unused_parameters=True adds nothing under static_graph, as in torch)."""
    options = {
        "static_graph": True,
        "bucket_cap_mb": 0.0002,
        "find_unused_parameters": find_unused_parameters,
    }
    results = rank_pools(world_size).run(
        both, BlockRunTwiceAndUnused, [4] * world_size, options, None, timeout=120
    )
    assert_bitwise_equal(results)


def without_static_graph() -> None:
    """The block run twice under reentrant checkpointing, without static_graph: refused."""
    train("miniddp", BlockRunTwice, [2] * dist.get_world_size(), {}, None)


def test_without_static_graph_the_block_run_twice_is_refused(pool2):
    outcomes = pool2.run_expecting_errors(without_static_graph, timeout=60)
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, RankFailure), f"rank {rank} did not raise"
        assert "twice" in outcome.message and "static_graph=True" in outcome.message, outcome


STATIC_UNDER_JOIN = {
    "buckets": (Deep, {"bucket_cap_mb": 0.0002}),
    "block run twice": (BlockRunTwice, {}),
    "a parameter never used": (BlockRunTwiceAndUnused, {"bucket_cap_mb": 0.0002}),
}


@pytest.mark.parametrize("steps", [[2, 5], [5, 2]], ids=["2-5", "5-2"])
@pytest.mark.parametrize("scenario", sorted(STATIC_UNDER_JOIN))
def test_static_graph_under_join_is_torchs(pool2, scenario, steps):
    """static_graph's first backward asks every rank which parameters it used before any bucket
    goes, and its buckets rebuild a step later: a joined rank must shadow both."""
    model, options = STATIC_UNDER_JOIN[scenario]
    results = pool2.run(both, model, steps, {"static_graph": True, **options}, {}, timeout=120)
    assert_bitwise_equal(results)
    assert [len(r["miniddp"]["losses"]) for r in results] == steps


def torch_with_a_rank_adding_zeros(model_class: Model, steps: int, ddp_options: dict) -> dict:
    """What Join promises for a rank that has no batch at all: it takes part as a rank whose
    gradients are zeros. Here rank 0 literally does that, with torch's DDP and no Join: every
    step it backpropagates its loss times 0, so the others' losses, gradients and weights are
    what a joined rank 0 would leave them."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(model_class(), **ddp_options)
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


@pytest.mark.parametrize("scenario", sorted(STATIC_UNDER_JOIN))
def test_static_graph_under_join_with_a_rank_that_has_no_batch(pool2, scenario):
    """A rank that joins before its own first backward: torch's DDP aborts here (gloo's
    "collective mismatch": its joined rank does not shadow the first backward's usage
    all-reduce). MiniDDP's joined rank answers it, and training ends bit for bit where torch's
    DDP ends when that rank instead trains on with a loss times 0."""
    model, options = STATIC_UNDER_JOIN[scenario]
    options = {"static_graph": True, **options}
    ours = pool2.run(train, "miniddp", model, [0, 3], options, {}, timeout=60)
    reference = pool2.run(torch_with_a_rank_adding_zeros, model, 3, options)
    assert ours[1]["losses"] == reference[1]["losses"]
    for name, value in reference[1]["state"].items():
        for rank in (0, 1):  # Join's post_hook gives rank 0 the last joiner's model
            assert torch.equal(ours[rank]["state"][name], value), f"rank {rank}: {name} differs"


class SecondLayerOnlyAtFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 1)
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        hidden = self.first(x)
        return self.second(hidden) if self.steps == 1 else hidden.sum(dim=1, keepdim=True)


def static_graph_then_a_parameter_goes_unused() -> None:
    """Both layers take part in the first backward; from the second on, only the first."""
    model = MiniDDP(SecondLayerOnlyAtFirst(), static_graph=True)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()


def test_static_graph_names_a_changed_graph_not_find_unused_parameters(pool2):
    """static_graph turns find_unused_parameters off, so advising it would change nothing: say
    what torch says, that the graph changed."""
    outcomes = pool2.run_expecting_errors(static_graph_then_a_parameter_goes_unused, timeout=60)
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, RankFailure), f"rank {rank} did not raise"
        assert "the graph changed" in outcome.message, outcome.message
        assert "second.weight" in outcome.message, outcome.message
        assert "find_unused_parameters=True)." not in outcome.message, outcome.message
