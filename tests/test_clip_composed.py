"""miniddp.sharding.clip_grad_norm_ over composed parallelisms, against one process's clip.

The claim: whatever a rank holds a part of (a TP shard, a fully_shard piece of one, a pipeline
stage, a replica counted elsewhere), the norm it returns is the norm one process computes over
the whole model and the whole batch, in the same bits on every rank, and the gradients it leaves
are that process's clipped gradients, cut as the rank holds them. Before the marks were read,
each rank clipped by the norm of its own part: a different factor on every rank, each too
large, and the replicated parameters drifted apart.

Float32 throughout. Not bitwise one process's: the p-th powers are added per piece and then
across ranks, another order, so the norm may differ in the last bits (measured below).
"""

from __future__ import annotations

import pytest
import torch

from tests import clip_composed_tasks as tasks
from tests.harness.measurements import record_max

NORM_RTOL = 1e-6  # float32: a few roundings of a sum of a few hundred squares
GRAD_ATOL = 1e-7  # the clipped gradients are below 0.1 in size: a few float32 roundings


def check_against_one_process(results: list[dict], case: str) -> None:
    """Every rank: one process's norm within rounding, rank 0's bits, one process's gradients."""
    for rank, by_norm in enumerate(results):
        for norm_type, got in by_norm.items():
            what = f"{case}, p={norm_type:g}, rank {rank}"
            relative = ((got["norm"] - got["reference"]).abs() / got["reference"]).item()
            record_max(f"clip_grad_norm_ under {case}: norm vs one process (relative)", relative)
            record_max(
                f"clip_grad_norm_ under {case}: clipped gradients vs one process",
                got["grad_difference"],
            )
            torch.testing.assert_close(
                got["norm"], got["reference"], rtol=NORM_RTOL, atol=0, msg=what
            )
            assert torch.equal(got["norm"], results[0][norm_type]["norm"]), f"{what}: ranks differ"
            assert got["grad_difference"] <= GRAD_ATOL, f"{what}: {got['grad_difference']}"


def test_tensor_parallel_norm_counts_every_shard_and_the_replicated_bias_once(pool2):
    check_against_one_process(pool2.run(tasks.tensor_parallel), "TP")


def test_dp_tp_fully_shard_norm_adds_the_pieces_of_the_shards(rank_pools):
    """(dp, tp) = (2, 2), fully_shard over dp of a TP model: each piece's mark says both."""
    check_against_one_process(rank_pools(4).run(tasks.data_tensor_fully_sharded), "DPxTPxFSDP")


def test_dp_tp_zero_over_the_dp_axis_counts_each_gradient_on_its_owner(rank_pools):
    """(dp, tp) = (2, 2), ZeRO-1 over mesh["dp"] only: its owners are ranks of that group."""
    check_against_one_process(rank_pools(4).run(tasks.data_tensor_zero), "DPxTP, ZeRO-1 over dp")


def test_pipeline_norm_adds_the_stages_and_counts_a_tied_replica_once(pool2):
    check_against_one_process(pool2.run(tasks.pipeline), "PP")


def test_pipeline_stage_s_own_mark_is_enough(pool2):
    """Through PipelineStage and ScheduleGPipe: the norm with no argument but the parameters."""
    check_against_one_process(pool2.run(tasks.pipeline_scheduled), "PP, scheduled")


@pytest.mark.slow  # 13 s of 8-rank start-up; TP, DP x TP x FSDP and PP each run by default
def test_three_d_norm_is_one_process_s(rank_pools):
    """(pp, dp, tp) = (2, 2, 2): every piece on 8 ranks, one norm."""
    check_against_one_process(rank_pools(8).run(tasks.three_d), "(pp, dp, tp)")


@pytest.mark.parametrize(
    "which, named",
    [
        ("two tensor groups", "two different tensor groups"),
        ("crossing groups", "the data group and the tensor group share ranks"),
    ],
)
def test_marks_no_mesh_gives_are_refused_on_every_rank(pool2, which, named):
    """The sums run once along each axis of a mesh: two groups of one kind, or two axes that
    share ranks, would count some pieces twice or never. Refused before any communication."""
    outcomes = pool2.run_expecting_errors(tasks.mixed_groups, which)
    for outcome in outcomes:
        assert getattr(outcome, "type_name", None) == "ValueError", outcome
        assert named in outcome.message
