"""Uneven inputs under Join, and static_graph=True: MiniDDP against torch's DDP doing the same
training on the same data (tests/join_tasks.py), bit for bit, at W = 2 and 3."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from miniddp import MiniDDP
from tests import join_tasks
from tests.harness.pool import RankFailure


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


JOIN_SCENARIOS = {
    # model, extra DDP options, Join options
    "batchnorm": ("batchnorm", {}, {}),
    "find_unused": ("unused", {"find_unused_parameters": True}, {}),
    "several_buckets": ("buckets", {"bucket_cap_mb": 0.0002}, {}),
    "zero_redundancy_optimizer": ("buckets", {"bucket_cap_mb": 0.0002}, {"zero": True}),
    "effective_world_size": (
        "buckets",
        {"bucket_cap_mb": 0.0002},
        {"divide_by_initial_world_size": False},
    ),  # fmt: skip
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("scenario", sorted(JOIN_SCENARIOS))
def test_join_with_uneven_inputs_is_torchs_join(rank_pools, world_size, scenario):
    """Rank r has 2 + 2r batches: rank 0 joins first, after two steps (so buffers must come
    from another rank), and the others keep training and rebuilding their buckets."""
    model, ddp_options, join_options = JOIN_SCENARIOS[scenario]
    steps = [2 + 2 * rank for rank in range(world_size)]
    results = rank_pools(world_size).run(
        join_tasks.both, model, steps, ddp_options, join_options, timeout=120
    )
    assert_bitwise_equal(results)
    assert [len(r["miniddp"]["losses"]) for r in results] == steps


@pytest.mark.parametrize("world_size", [2, 3])
def test_model_join_trains_a_rank_with_no_batch_at_all(rank_pools, world_size):
    """The last rank has no batch: it joins before any bucket layout was observed."""
    steps = [3] * (world_size - 1) + [0]
    results = rank_pools(world_size).run(
        join_tasks.both, "buckets", steps, {}, {"model.join": True}, timeout=120
    )
    assert_bitwise_equal(results)


def test_throw_on_early_termination_raises_on_every_rank(pool2):
    outcomes = pool2.run_expecting_errors(join_tasks.early_termination, "miniddp", timeout=60)
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, RankFailure), f"rank {rank} did not raise"
        assert "exhausted" in outcome.message, outcome.message


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("bucket_cap_mb", [None, 0.0002])
def test_static_graph_trains_a_block_run_twice_under_reentrant_checkpointing(
    rank_pools, world_size, bucket_cap_mb
):
    """Four steps: the first counts hooks, the second records the order, the third rebuilds."""
    options = {"static_graph": True, "bucket_cap_mb": bucket_cap_mb}
    results = rank_pools(world_size).run(
        join_tasks.both, "twice", [4] * world_size, options, None, timeout=120
    )
    assert_bitwise_equal(results)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("find_unused_parameters", [False, True])
def test_static_graph_finds_a_parameter_never_used(rank_pools, world_size, find_unused_parameters):
    """`never_used` fires no hook in the first backward: it is marked ready at once after that
    (find_unused_parameters=True adds nothing under static_graph, as in torch)."""
    options = {"static_graph": True, "bucket_cap_mb": 0.0002,
               "find_unused_parameters": find_unused_parameters}  # fmt: skip
    results = rank_pools(world_size).run(
        join_tasks.both, "twice_and_unused", [4] * world_size, options, None, timeout=120
    )
    assert_bitwise_equal(results)


def test_without_static_graph_the_block_run_twice_is_refused(pool2):
    outcomes = pool2.run_expecting_errors(join_tasks.without_static_graph, timeout=60)
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, RankFailure), f"rank {rank} did not raise"
        assert "twice" in outcome.message and "static_graph=True" in outcome.message, outcome


STATIC_UNDER_JOIN = {
    "buckets": ("buckets", {"bucket_cap_mb": 0.0002}),
    "block run twice": ("twice", {}),
    "a parameter never used": ("twice_and_unused", {"bucket_cap_mb": 0.0002}),
}


@pytest.mark.parametrize("steps", [[2, 5], [5, 2]], ids=["2-5", "5-2"])
@pytest.mark.parametrize("scenario", sorted(STATIC_UNDER_JOIN))
def test_static_graph_under_join_is_torchs(pool2, scenario, steps):
    """static_graph's first backward asks every rank which parameters it used before any bucket
    goes, and its buckets rebuild a step later: a joined rank must shadow both."""
    model, options = STATIC_UNDER_JOIN[scenario]
    results = pool2.run(
        join_tasks.both, model, steps, {"static_graph": True, **options}, {}, timeout=120
    )
    assert_bitwise_equal(results)
    assert [len(r["miniddp"]["losses"]) for r in results] == steps


@pytest.mark.parametrize("scenario", sorted(STATIC_UNDER_JOIN))
def test_static_graph_under_join_with_a_rank_that_has_no_batch(pool2, scenario):
    """A rank that joins before its own first backward: torch's DDP aborts here (gloo's
    "collective mismatch": its joined rank does not shadow the first backward's usage
    all-reduce). MiniDDP's joined rank answers it, and training ends bit for bit where torch's
    DDP ends when that rank instead trains on with a loss times 0."""
    model, options = STATIC_UNDER_JOIN[scenario]
    options = {"static_graph": True, **options}
    ours = pool2.run(join_tasks.train, "miniddp", model, [0, 3], options, {}, timeout=60)
    reference = pool2.run(join_tasks.torch_with_a_rank_adding_zeros, model, 3, options)
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
