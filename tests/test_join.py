"""Uneven inputs under Join, and static_graph=True: MiniDDP against torch's DDP doing the same
training on the same data (tests/join_tasks.py), bit for bit, at W = 2 and 3."""

from __future__ import annotations

import pytest
import torch

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


def test_join_with_static_graph_is_refused_on_every_rank(pool2):
    outcomes = pool2.run_expecting_errors(join_tasks.join_with_static_graph, timeout=60)
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, RankFailure), f"rank {rank} did not raise"
        assert outcome.type_name == "NotImplementedError", outcome
        assert "static_graph" in outcome.message, outcome
