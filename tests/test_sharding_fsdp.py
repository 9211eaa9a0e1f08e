"""ZeRO-3 (miniddp/sharding/fully_shard.py) against torch's fully_shard (FSDP2) and MiniDDP, all
training with AdamW: the full parameters after every step.

Bitwise at W = 2, where every sum has two terms (a + b = b + a) and halving is exact.
Within 1e-5 at W = 3 and 4: our ring adds chunk c's terms in gloo's order for chunk c, but we
cut parameters flat where torch cuts rows, so an element may fall in another chunk and be added
in another order; the last bits may differ, and Adam carries them on.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from miniddp.sharding import Formula
from miniddp.sharding.units import UNIT_NUMBER_BYTES
from tests import sharding_fsdp_tasks
from tests.harness.measurements import record_max
from tests.harness.properties import property_settings
from tests.sharding_fsdp_tasks import FsdpSpec

specs = st.builds(
    FsdpSpec,
    seed=st.integers(0, 1000),
    widths=st.lists(st.integers(1, 9), min_size=2, max_size=4).map(tuple),
    steps=st.integers(1, 3),
    accumulation=st.integers(1, 2),
    reshard_after_forward=st.booleans(),
)


UNITS = 3  # FsdpSpec's three Linear layers; the root holds no parameters of its own


def largest_difference(ours: list, reference: list) -> float:
    return max(
        (a - b).abs().max().item()
        for mine, theirs in zip(ours, reference, strict=True)
        for a, b in zip(mine, theirs, strict=True)
    )


def assert_bitwise(ours: list, reference: list, what: str) -> None:
    for step, (mine, theirs) in enumerate(zip(ours, reference, strict=True)):
        for index, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert torch.equal(a, b), f"{what}: parameter {index} differs after step {step}"


def test_one_fixed_example_at_w2_is_torchs_bits_its_memory_and_its_traffic(pool2):
    """6 parameters, Ψ = 135 elements; shards of ceil(n/2): 69 elements per rank, 3 padding.
    Per step each rank sends 3(W-1)·69 elements: all-gather, all-gather again, reduce-scatter;
    and leading each message of an all-gather, the 8-byte number of the unit it gathers (the
    check that every rank gathers the same unit)."""
    for rank, result in enumerate(pool2.run(sharding_fsdp_tasks.against_torch_and_ddp, FsdpSpec())):
        params = result["params"]
        assert_bitwise(params["ours"], params["torch"], f"rank {rank}: against FSDP2")
        assert_bitwise(params["ours"], params["ddp"], f"rank {rank}: against MiniDDP")
        assert result["shard_elements"] == 69
        assert result["memory"] == Formula("zero3", 135, 6, 2).expected(69)
        assert result["sent"] == [3 * 1 * 69 * 4 + 2 * UNITS * UNIT_NUMBER_BYTES] * 3


def test_accumulation_without_gradient_sync_sends_no_reduce_scatter(pool2):
    """set_requires_gradient_sync(False): the forward still gathers parameters (twice, with
    resharding), but gradients stay home, summed; the synced micro-step reduce-scatters it all."""
    spec = FsdpSpec(accumulation=3, steps=1)
    for result in pool2.run(sharding_fsdp_tasks.against_torch_and_ddp, spec):
        assert result["collectives"] == [["all_gather/ring"]] * 2 + [
            ["all_gather/ring", "reduce_scatter/ring"]
        ]
        assert result["sent"][:2] == [2 * 69 * 4 + 2 * UNITS * UNIT_NUMBER_BYTES] * 2
        assert_bitwise(result["params"]["ours"], result["params"]["ddp"], "no-sync vs no_sync()")
        assert_bitwise(result["params"]["ours"], result["params"]["torch"], "against FSDP2")


@pytest.mark.parametrize("world_size", [2, 3])
@property_settings(max_examples=3)
@given(spec=specs)
def test_fully_shard_trains_like_fsdp2_and_ddp(rank_pools, world_size, spec):
    results = rank_pools(world_size).run(sharding_fsdp_tasks.against_torch_and_ddp, spec)
    for rank, result in enumerate(results):
        params = result["params"]
        for reference in ("torch", "ddp"):
            if world_size == 2:
                assert_bitwise(params["ours"], params[reference], f"rank {rank}: {reference}")
            else:
                difference = largest_difference(params["ours"], params[reference])
                record_max(f"fully_shard vs {reference} at W = {world_size}", difference)
                assert difference <= 1e-5, f"rank {rank}: {reference} differs by {difference}"


def test_fully_shard_at_w4_within_1e5(rank_pools):
    spec = FsdpSpec(widths=(6, 9, 5), accumulation=2)
    for result in rank_pools(4).run(sharding_fsdp_tasks.against_torch_and_ddp, spec):
        for reference in ("torch", "ddp"):
            difference = largest_difference(result["params"]["ours"], result["params"][reference])
            record_max(f"fully_shard vs {reference} at W = 4", difference)
            assert difference <= 1e-5


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_a_module_called_twice_in_one_forward_trains_like_ddp(pool2, reshard_after_forward):
    """Each call gathers its own full parameters, and its backward refills and frees those.
    Not bitwise: each call reduce-scatters its own gradient, so the shard sums (g1 + g1')/2 +
    (g2 + g2')/2 where DDP averages (g1 + g2 + g1' + g2')/2 once."""
    spec = FsdpSpec(twice=True, reshard_after_forward=reshard_after_forward)
    kinds = ("ours", "ddp")
    for result in pool2.run(sharding_fsdp_tasks.against_torch_and_ddp, spec, kinds):
        difference = largest_difference(result["params"]["ours"], result["params"]["ddp"])
        record_max("fully_shard vs ddp, a layer called twice", difference)
        assert difference <= 1e-6


def test_a_forward_under_no_grad_gathers_and_frees_without_a_backward(pool2):
    """Evaluation between steps: the parameters are gathered for the forward and freed after
    it, with no backward to wait for; training goes on as before."""
    spec = FsdpSpec(steps=2)
    for result in pool2.run(sharding_fsdp_tasks.evaluation_between_steps, spec):
        for ours, ddp in zip(result["ours"], result["ddp"], strict=True):
            assert torch.equal(ours, ddp)


def test_a_sharded_checkpoint_resumes_bit_for_bit(pool2):
    """Each rank saves its own shards and its optimizer's state for them, and loads them back."""
    for result in pool2.run(sharding_fsdp_tasks.resumes_bitwise, FsdpSpec(steps=2)):
        for a, b in zip(result["straight"], result["resumed"], strict=True):
            assert torch.equal(a, b)


def test_sharding_a_module_twice_is_refused(pool2):
    outcome = pool2.run_expecting_errors(sharding_fsdp_tasks.shard_twice)[0]
    assert outcome.type_name == "ValueError" and "already fully sharded" in outcome.message


def test_different_models_on_different_ranks_are_named_on_every_rank(pool2):
    """Not a hang in the first all-gather: every rank raises before any shard is cut."""
    for outcome in pool2.run_expecting_errors(sharding_fsdp_tasks.shard_different_models):
        assert outcome.type_name == "ValueError" and "same model" in outcome.message


def test_mixed_dtypes_in_one_call_are_refused_with_the_fix(pool2):
    for outcome in pool2.run_expecting_errors(sharding_fsdp_tasks.shard_mixed_dtypes):
        assert outcome.type_name == "ValueError"
        assert "one dtype" in outcome.message and "submodules of each dtype" in outcome.message


def test_save_checkpoint_of_a_sharded_model_resumes_bit_for_bit(pool2, tmp_path):
    """save_checkpoint used to write rank 0's shards alone, and load_checkpoint put them on
    every rank: rank 1's rows came back as rank 0's, silently. Now it writes the full state."""
    path = str(tmp_path / "sharded.pt")
    for result in pool2.run(sharding_fsdp_tasks.resumes_through_save_checkpoint, FsdpSpec(), path):
        assert_bitwise([result["after"]], [result["before"]], "loaded against saved")
        assert_bitwise([result["resumed"]], [result["straight"]], "resumed against straight")


def test_a_sharded_checkpoint_holds_the_full_state_and_resumes_at_another_world_size(
    rank_pools, tmp_path
):
    """Saved by 2 ranks; it loads into the plain unsharded model, and into 3 ranks' shards."""
    from miniddp.checkpoint import load_checkpoint

    path = str(tmp_path / "sharded.pt")
    spec = FsdpSpec(steps=1)
    saved = rank_pools(2).run(sharding_fsdp_tasks.resumes_through_save_checkpoint, spec, path)
    plain = sharding_fsdp_tasks.build_model(replace(spec, seed=5))
    load_checkpoint(path, plain, allow_world_size_change=True)
    assert_bitwise([list(plain.state_dict().values())], [saved[0]["after"]], "unsharded")
    for result in rank_pools(3).run(sharding_fsdp_tasks.resume_at_this_world_size, spec, path):
        assert_bitwise([result["after"]], [saved[0]["after"]], "resharded for W = 3")
        assert result["steps"] and all(step == 2 * spec.steps for step in result["steps"])


@pytest.mark.parametrize("library", ["torch", "ours"])
def test_a_weight_tied_across_units_is_refused_naming_it(pool2, library):
    """torch refuses at the first forward; we refuse at fully_shard(root), the same words."""
    for outcome in pool2.run_expecting_errors(sharding_fsdp_tasks.tied_across_units, library):
        assert outcome.type_name == "ValueError", outcome
        assert re.search(
            r"Parameter '[01].weight' is shared with a parameter already managed by",
            outcome.message,
        )
        assert "fully_shard([module_a, module_b])" in outcome.message


def test_sharding_a_child_after_its_root_is_refused_naming_the_order(pool2):
    for outcome in pool2.run_expecting_errors(sharding_fsdp_tasks.child_after_root):
        assert outcome.type_name == "ValueError", outcome
        assert "Shard the submodules first, then the root" in outcome.message


def test_calling_a_submodule_whose_parameters_its_unit_holds_is_refused(pool2):
    for outcome in pool2.run_expecting_errors(sharding_fsdp_tasks.child_called_on_its_own):
        assert outcome.type_name == "RuntimeError", outcome
        assert "its parameters belong to fully_shard unit" in outcome.message


def test_a_unit_skipped_on_one_rank_is_named_on_every_rank(pool2):
    """gloo aborted the process (SIGABRT, "Received data size doesn't match expected size"),
    as it does under torch's fully_shard. Now every rank names both units."""
    outcomes = pool2.run_expecting_errors(sharding_fsdp_tasks.skip_a_unit_on_rank_1)
    for rank, outcome in enumerate(outcomes):
        assert outcome.type_name == "CollectiveFailed", outcome
        assert f"cannot be gathered on rank {rank}" in outcome.message
        assert "fully_shard unit" in outcome.message and "skipped on one rank" in outcome.message


def test_post_accumulate_grad_hooks_run_on_the_shards_as_torchs_fully_shard_runs_them(pool2):
    """An optimizer stepping inside backward, from each shard's post-accumulate-grad hook:
    each hook runs once a step with the shard's gradient set, and the training is bitwise
    the same loop stepping after backward, and torch's fully_shard's doing the same."""
    spec = sharding_fsdp_tasks.FsdpSpec()
    units = len(spec.widths) - 1
    kinds = ("ours", "plain", "torch")
    runs = {k: pool2.run(sharding_fsdp_tasks.optimizer_in_backward, k, spec) for k in kinds}
    for rank in range(2):
        ours, plain, torchs = (runs[k][rank] for k in kinds)
        assert ours["calls"] == [True] * (2 * units * spec.steps)  # weight and bias, each step
        assert ours["calls"] == torchs["calls"]
        for a, b, c in zip(ours["params"], plain["params"], torchs["params"]):
            assert torch.equal(a, b) and torch.equal(a, c)


def test_a_gradient_divide_factor_sums_and_divides_once(pool2):
    """torch's set_gradient_divide_factor (its own runs PREMUL_SUM, which gloo refuses, so the
    reference is the sum by hand): what expert parallelism's experts use (parallelize_experts)."""
    assert pool2.run(sharding_fsdp_tasks.divided_by_a_factor, 6.0, timeout=60) == [True, True]
