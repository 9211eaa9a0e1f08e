"""ZeRO-1 and ZeRO-2 (miniddp/sharding/zero.py, zero2.py) against torch's ZeroRedundancyOptimizer
and plain AdamW under MiniDDP: the same parameters, bit for bit, after every step.

Why bitwise is the right bar: Adam's update is elementwise, so which rank computes an element
cannot change its value, and the parameters that travel afterwards are copied, not summed.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from miniddp import ZeroRedundancyOptimizer, fully_shard
from miniddp.sharding import Formula, partition, reduce_scatter_hook
from tests import sharding_tasks
from tests.harness import your_code
from tests.harness.properties import property_settings
from tests.sharding_tasks import ShardSpec

specs = st.builds(
    ShardSpec,
    seed=st.integers(0, 1000),
    widths=st.lists(st.integers(1, 9), min_size=2, max_size=4).map(tuple),
    steps=st.integers(1, 3),
    groups=st.sampled_from([1, 2]),
)


def assert_bitwise(ours: list, reference: list, what: str) -> None:
    for step, (mine, theirs) in enumerate(zip(ours, reference, strict=True)):
        for index, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert torch.equal(a, b), f"{what}: parameter {index} differs after step {step}"


def test_without_a_process_group_each_says_how_to_launch():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="torchrun"):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW)
    with pytest.raises(RuntimeError, match="torchrun"):
        fully_shard(model)


def test_the_hook_refuses_a_state_that_is_not_the_zero_optimizer():
    with pytest.raises(TypeError, match="register_comm_hook\\(optimizer, reduce_scatter_hook\\)"):
        reduce_scatter_hook(None, bucket=None)


def test_mixed_dtypes_are_refused_with_the_fix(pool2):
    for outcome in pool2.run_expecting_errors(sharding_tasks.zero_with_mixed_dtypes):
        assert outcome.type_name == "ValueError"
        assert "one dtype" in outcome.message and "each dtype its own" in outcome.message


def test_the_partition_is_torchs_sorted_greedy_one():
    sizes = [3, 10, 4, 10, 1]  # sorted: 10, 10, 4, 3, 1 -> ranks 0, 1, 0, 1, 1 at W = 2
    params = [torch.zeros(n) for n in sizes]
    shares = partition([{"params": params, "lr": 1.0}], world_size=2)
    assert [[p.numel() for p in g["params"]] for [g] in shares] == [[10, 4], [10, 3, 1]]
    assert shares[1][0]["lr"] == 1.0  # every rank's copy of a group keeps its settings


def test_zero1_one_fixed_example_at_w2(pool2):
    results = pool2.run(sharding_tasks.zero1_against_torch_and_plain, ShardSpec(steps=3))
    for rank, result in enumerate(results):
        assert_bitwise(result["params"]["ours"], result["params"]["plain"], f"rank {rank} plain")
        assert_bitwise(result["params"]["ours"], result["params"]["torch"], f"rank {rank} torch")
        assert result["owned"] == result["torch_owned"]
    # each parameter's Adam state lives on exactly one rank: 2 states x Ψ over all ranks
    psi = sum(p.numel() for p in sharding_tasks.build_model(ShardSpec()).parameters())
    assert sum(r["local_state_elements"] for r in results) == 2 * psi


@pytest.mark.parametrize("world_size", [2, 3])
@property_settings(max_examples=4)
@given(spec=specs)
def test_zero1_equals_torch_zero_and_plain_adamw(rank_pools, world_size, spec):
    results = rank_pools(world_size).run(sharding_tasks.zero1_against_torch_and_plain, spec)
    for rank, result in enumerate(results):
        assert_bitwise(result["params"]["ours"], result["params"]["plain"], f"rank {rank} plain")
        assert_bitwise(result["params"]["ours"], result["params"]["torch"], f"rank {rank} torch")
        assert result["owned"] == result["torch_owned"], "not torch's partition"


def test_zero1_at_w4_with_two_groups(rank_pools):
    spec = ShardSpec(widths=(6, 7, 5, 2), groups=2)
    for result in rank_pools(4).run(sharding_tasks.zero1_against_torch_and_plain, spec):
        assert_bitwise(result["params"]["ours"], result["params"]["torch"], "torch at W = 4")
        assert result["owned"] == result["torch_owned"]


@pytest.mark.parametrize("to", [0, 1])
def test_consolidated_state_dict_is_torchs_and_plain_adamws(pool2, to):
    spec = ShardSpec(groups=2)
    results = pool2.run(sharding_tasks.state_dicts_on_rank, spec, to)
    dicts = results[to]
    for reference in ("torch", "plain"):
        assert dicts["ours"]["param_groups"] == dicts[reference]["param_groups"], reference
        assert dicts["ours"]["state"].keys() == dicts[reference]["state"].keys(), reference
        for index, state in dicts["ours"]["state"].items():
            for key, value in state.items():
                assert torch.equal(value, dicts[reference]["state"][index][key]), (index, key)


def test_state_dict_before_consolidating_says_what_to_call(pool2):
    outcomes = pool2.run_expecting_errors(sharding_tasks.state_dict_unconsolidated)
    for outcome in outcomes:
        assert outcome.type_name == "RuntimeError"
        assert "consolidate_state_dict" in outcome.message


def test_a_resumed_zero1_run_continues_bit_for_bit(pool2):
    for result in pool2.run(sharding_tasks.zero1_resumes_bitwise, ShardSpec(steps=2)):
        for a, b in zip(result["straight"], result["resumed"], strict=True):
            assert torch.equal(a, b)


def test_zero1_through_miniddps_checkpoints_resumes_bit_for_bit(pool2, tmp_path):
    """save_checkpoint after consolidate_state_dict(to=0), load_checkpoint on every rank."""
    path = str(tmp_path / "zero1.pt")
    spec = ShardSpec(steps=2, groups=2)
    for result in pool2.run(sharding_tasks.zero1_resumes_through_save_checkpoint, spec, path):
        for a, b in zip(result["straight"], result["resumed"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("world_size", [2, 3])
def test_zero2_keeps_only_its_own_averaged_gradients(rank_pools, world_size):
    """Owned parameters get MiniDDP's averages (bitwise at W = 2, where a + b = b + a; within
    1e-6 at W = 3, where the ring sums in another order than gloo); the others no gradient. The
    parameters end within 1e-6 of one process training on the global batch."""
    spec = ShardSpec(widths=(6, 9, 7, 3), steps=3)
    for rank, result in enumerate(
        rank_pools(world_size).run(sharding_tasks.zero2_against_plain, spec)
    ):
        for step, (ours, plain) in enumerate(zip(result["ours"], result["plain"], strict=True)):
            for index, (mine, reference, owned) in enumerate(zip(ours, plain, result["owned"])):
                if not owned:
                    assert mine is None, f"rank {rank} kept parameter {index}'s gradient"
                elif world_size == 2:
                    assert torch.equal(mine, reference), f"rank {rank} step {step} grad {index}"
                else:
                    torch.testing.assert_close(mine, reference, rtol=0, atol=1e-6)
        if world_size == 2:
            assert_bitwise(result["ours_params"], result["plain_params"], f"rank {rank} ZeRO-2")
        alone = sharding_tasks.single_process(spec, world_size)[-1]
        for ours, reference in zip(result["ours_params"][-1], alone, strict=True):
            torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)


def test_memory_per_rank_matches_the_formulas(rank_pools):
    """DDP: 4Ψ + 4Ψ + 4Ψ + 8Ψ (+ Adam's 4-byte step per tensor); ZeRO-1 shards the states,
    ZeRO-2 the gradients too, to what this rank owns."""
    spec = ShardSpec(widths=(6, 9, 7, 3), steps=2)
    model = sharding_tasks.build_model(spec)
    psi, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    results = rank_pools(3).run(sharding_tasks.memory_of_each_stage, spec)
    for result in results:
        owned, owned_tensors = result["owned_elements"], result["owned_tensors"]
        memory = result["memory"]
        assert memory["plain"] == Formula("ddp", psi, tensors, 3).expected()
        for kind, stage in (("ours", "zero1"), ("zero2", "zero2")):
            expected = Formula(stage, psi, owned_tensors, 3).expected(owned)
            assert memory[kind] == expected, kind
    assert sum(r["owned_elements"] for r in results) == psi


def test_add_param_group_is_torchs_partition_and_its_bits(pool2):
    """torch's ZeroRedundancyOptimizer accepts a group after construction: the partition is
    redone over every group, which leaves the earlier ones where they were."""
    for result in pool2.run(
        sharding_tasks.zero_with_a_group_added_later, ShardSpec(widths=(6, 9, 7, 3))
    ):
        assert result["ours"]["owned"] == result["torch"]["owned"]
        assert_bitwise(result["ours"]["params"], result["torch"]["params"], "after add_param_group")


def test_zero2_scaling_at_w3_is_the_rings_order_bit_for_bit(rank_pools):
    """At W = 2, g/W and g·fl(1/W) agree and a + b = b + a, so any order gives DDP's bits. At
    W = 3 neither holds (a third of the float32 values differ in the last bit), so the
    reference redoes our order: every rank's gradient times fl(1/3), summed as the ring does."""
    spec = ShardSpec(widths=(6, 9, 7, 3), steps=2)
    results = rank_pools(3).run(sharding_tasks.zero2_gradients_and_their_ring_order_reference, spec)
    for rank, result in enumerate(results):
        assert result["ours"], f"rank {rank} owns nothing"
        for index, (mine, expected) in enumerate(
            zip(result["ours"], result["expected"], strict=True)
        ):
            assert torch.equal(mine, expected), f"rank {rank}: owned gradient {index}"
    differ = [
        not torch.equal(a, b) for r in results for a, b in zip(r["ours"], r["divided"], strict=True)
    ]
    assert any(differ), "the reference would not tell the ring's order from sum-then-divide"


# Your own ZeRO-1, with `--zero1 FILE.py:CLASS` (tutorials/exercises/zero1.py), against torch's
# ZeroRedundancyOptimizer. Without --zero1 these are skipped; with it, only these run.


def check_zero1_class(rank_pools, where: str, world_size: int, spec: ShardSpec) -> None:
    """The parameters bit for bit torch's after every step, and each rank keeping Adam's
    state for exactly its partition's parameters, torch's."""
    results = rank_pools(world_size).run(your_code.zero1_against_torch, spec, where)
    for rank, result in enumerate(results):
        assert_bitwise(result["params"]["yours"], result["params"]["torch"], f"rank {rank}")
        kept, torchs = result["kept"]["yours"], result["kept"]["torch"]
        assert kept is not None, (
            "your optimizer has no .optim: keep this rank's local optimizer there, as torch's "
            "ZeroRedundancyOptimizer does, so that its state can be checked"
        )
        assert kept == torchs, (
            f"rank {rank} keeps optimizer state for parameters {kept}; torch's "
            f"ZeroRedundancyOptimizer keeps it for {torchs} only, this rank's partition. ZeRO-1's "
            "idea: each rank keeps and steps the state of its own share, 1/W of it"
        )


@pytest.mark.parametrize("world_size", [2, 3])
def test_your_zero1_on_one_fixed_example(rank_pools, your_zero1, world_size):
    check_zero1_class(rank_pools, your_zero1, world_size, ShardSpec(steps=3, groups=2))


@pytest.mark.parametrize("world_size", [2, 3])
@property_settings(max_examples=4)
@given(spec=specs)
def test_your_zero1_equals_torchs(rank_pools, your_zero1, world_size, spec):
    check_zero1_class(rank_pools, your_zero1, world_size, spec)
