"""HSDP: fully_shard over a 2-D mesh ("replicate", "shard"), against torch's fully_shard over
the same mesh and MiniDDP over every rank, all training with AdamW.

At 2 x 2 every sum has two terms (a + b = b + a) and each average halves, exactly, so the bits
are torch's, whatever the order of the two reductions. Against MiniDDP, within rounding: DDP
scales each gradient by 1/4 before one sum over four ranks, in another order.
"""

from __future__ import annotations

import pytest
import torch

from miniddp.sharding.units import UNIT_NUMBER_BYTES
from tests import sharding_hsdp_tasks
from tests.harness.measurements import record_max
from tests.sharding_fsdp_tasks import FsdpSpec
from tests.test_sharding_fsdp import UNITS, assert_bitwise, largest_difference

SHARD = 69  # FsdpSpec()'s 135 elements over 2 shards: ceil(n/2) per parameter, 3 padding
BF16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
BF16_REDUCED = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16}


@pytest.mark.parametrize(
    "policy", [None, BF16, BF16_REDUCED], ids=["fp32", "bf16", "bf16 reduced in bf16"]
)
def test_hsdp_at_2x2_is_torchs_bits_over_adamw_steps(rank_pools, policy):
    """Prefetch on (the default) and off: the parameters after every step are torch's, on
    every rank; and each rank sends, per step,
    two gathers and a reduce-scatter inside its shard pair, 3(S-1)/S of the padded model,
    then the all-reduce of its 1/S shard over its replica pair, 2(R-1)/R of that."""
    spec = FsdpSpec(steps=3)
    kinds = ("ours", "torch") if policy else ("ours", "torch", "ddp", "unprefetched")
    for rank, result in enumerate(
        rank_pools(4).run(sharding_hsdp_tasks.against_torch, spec, (2, 2), policy, kinds)
    ):
        params = result["params"]
        assert_bitwise(params["ours"], params["torch"], f"rank {rank}: against torch's HSDP")
        if policy is None:
            difference = largest_difference(params["ours"], params["ddp"])
            record_max("HSDP 2 x 2 vs MiniDDP over 4", difference)
            assert difference <= 1e-6
            assert result["shard_elements"] == SHARD
            labels = 2 * UNITS * UNIT_NUMBER_BYTES
            assert_bitwise(params["unprefetched"], params["ours"], f"rank {rank}: no prefetch")
            for kind in ("ours", "unprefetched"):
                assert result["sent"][kind] == [(3 * SHARD + SHARD) * 4 + labels] * spec.steps
            assert result["collectives"][0] == [
                "all_gather/ring",
                "all_reduce/recursive_doubling",
                "reduce_scatter/ring",
            ]


def test_hsdp_accumulating_without_sync_is_torchs_bits(rank_pools):
    """set_requires_gradient_sync(False) skips both reductions, as torch's does: the full
    gradients stay home, summed, and the synced micro-step reduces the total."""
    spec = FsdpSpec(steps=2, accumulation=2)
    results = rank_pools(4).run(
        sharding_hsdp_tasks.against_torch, spec, (2, 2), None, ("ours", "torch")
    )
    for rank, result in enumerate(results):
        assert_bitwise(result["params"]["ours"], result["params"]["torch"], f"rank {rank}")
        assert "all_reduce" not in str(result["collectives"][0])


def test_a_1d_mesh_is_plain_fsdp_over_it_with_torchs_bits(pool2):
    spec = FsdpSpec(steps=2)
    for result in pool2.run(sharding_hsdp_tasks.against_torch, spec, (2,), None, ("ours", "torch")):
        assert_bitwise(result["params"]["ours"], result["params"]["torch"], "1-D mesh")
        assert "all_reduce" not in str(result["collectives"])


def test_clip_grad_norm_counts_each_shard_once_not_each_replica(rank_pools):
    """The true norm is that of the averaged gradient, which MiniDDP holds whole on every
    rank. Each HSDP rank holds 1/S of it, the same 1/S as its replica: summed along the shard
    axis only, the pieces count once; summed over all four ranks, twice (sqrt 2 too large)."""
    results = rank_pools(4).run(sharding_hsdp_tasks.clipped_norms, FsdpSpec(), 0.01)
    for result in results:
        ours, true = result["norms"]["ours"], result["norms"]["ddp"]
        assert result["shard_elements"] == SHARD
        assert torch.equal(ours, results[0]["norms"]["ours"])  # the same bits on every rank
        record_max("HSDP clip_grad_norm_ vs the true norm, relative", abs(ours / true - 1).item())
        assert ours == pytest.approx(true.item(), rel=1e-6)


def test_a_checkpoint_saved_on_2x2_resumes_on_a_1d_mesh_of_4(rank_pools, tmp_path):
    """The file holds the full state, gathered over each shard pair (the replicas hold the
    same): it loads cut in four, bit for bit, and trains on as HSDP would, within rounding
    (four-way sums in another order)."""
    path = str(tmp_path / "hsdp.pt")
    spec = FsdpSpec(steps=2)
    results = rank_pools(4).run(sharding_hsdp_tasks.resumes_at_another_mesh, spec, path, (4,))
    for result in results:
        assert result["shard_elements"] == 35  # ceil(n/4) per parameter: 1/4 now, not 1/2
        assert_bitwise([result["after"]], [result["before"]], "loaded against saved")
        difference = largest_difference([result["resumed"]], [result["straight"]])
        record_max("HSDP resumed on a 1-D mesh of 4 vs straight 2 x 2", difference)
        assert difference <= 1e-5


def test_a_mesh_of_three_axes_is_refused_on_every_rank_naming_the_two_it_takes(pool2):
    """torch's fully_shard takes 1 or 2 mesh dims; every rank refuses before any collective."""
    outcomes = pool2.run_expecting_errors(
        sharding_hsdp_tasks.shard_over_a_mesh_of, (2, 1, 1), ("pp", "dp", "tp")
    )
    for outcome in outcomes:
        assert outcome.type_name == "ValueError", outcome
        assert "1-D mesh" in outcome.message and "2-D mesh" in outcome.message
        assert "got 3 axes ('pp', 'dp', 'tp')" in outcome.message
        assert "mesh[('pp', 'dp')]" in outcome.message


def test_a_mesh_and_a_process_group_together_are_refused(pool2):
    for outcome in pool2.run_expecting_errors(sharding_hsdp_tasks.shard_over_a_mesh_and_a_group):
        assert outcome.type_name == "ValueError", outcome
        assert "a mesh or a process_group, not both" in outcome.message


def test_torchs_device_mesh_is_refused_naming_ours(pool2):
    for outcome in pool2.run_expecting_errors(sharding_hsdp_tasks.shard_over_torchs_mesh):
        assert outcome.type_name == "TypeError", outcome
        assert "miniddp.mesh.init_device_mesh" in outcome.message


def test_parallelize_takes_torchtitans_dp_replicate_and_dp_shard_and_trains_as_one_process(
    rank_pools,
):
    """The GPT (float64, dropout off) over (pp, dp_replicate, dp_shard, tp) = (1, 2, 2, 1):
    every step's loss, and every parameter after 3 AdamW steps, are one process's on the
    global batch, within rounding."""
    from tests import parallelize_tasks

    results = rank_pools(4).run(sharding_hsdp_tasks.parallel_gpt_over_hsdp, (1, 2, 2, 1))
    losses, reference = parallelize_tasks.one_process(replicas=4)
    for step, expected in enumerate(losses):
        mean = sum(result["losses"][step] for result in results) / 4
        assert mean == pytest.approx(expected, abs=1e-12), f"step {step}"
    for result in results:
        for name, tensor in result["params"].items():
            expected = reference["token.weight" if name == "head.weight" else name]  # tied
            difference = (tensor - expected).abs().max().item()
            record_max(
                "parallelize over dp_replicate x dp_shard: |param - one process's|", difference
            )
            assert difference < 1e-12, f"{name} is off by {difference:.3g}"


def test_parallelize_refuses_ddp_over_an_hsdp_mesh(pool2):
    for outcome in pool2.run_expecting_errors(sharding_hsdp_tasks.parallelize_hsdp_with_ddp):
        assert outcome.type_name == "ValueError", outcome
        assert 'data_parallel="fsdp"' in outcome.message
