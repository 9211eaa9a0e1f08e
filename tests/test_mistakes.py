"""The mistakes zoo (tutorials/mistakes/) has teeth: every classic DDP mistake there is caught,
with the diagnosis a learner needs, by the same checks that the ladder passes; and each one's fix
passes the same checks on the same scenario, so it is the mistake that is caught, not the
scenario.

Six are caught by the property checks themselves (tests/harness/equivalence.py); one of
them, divide_after_sum, is a lesson in bit-reproducibility rather than a bug. The others are, by
design, invisible to them, because the numbers come out right or the scenario needs
ranks that disagree; each gets the check that does catch it, as its docstring says.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import pytest
import torch
from torch.utils.data import DistributedSampler

from tests.harness.equivalence import check_claims, check_replicas_identical
from tests.mistakes_tasks import (
    train_rank_ordered_branches,
    train_with_a_late_peer,
    two_steps_with_an_unused_parameter,
)
from tests.workloads import ModelSpec, TrainSpec
from tutorials.mistakes.missing_set_epoch import indices_per_epoch

ZOO = "tutorials.mistakes"
MINIDDP = "miniddp.ddp:MiniDDP"
SMALL = TrainSpec(model=ModelSpec(seed=3, widths=(6,)), steps=2)


@dataclass(frozen=True)
class Case:
    name: str
    mistake: str  # "module:Class", or "module:train_step" for a training-loop mistake
    fix: str
    world_size: int
    spec: TrainSpec
    diagnosis: str  # a phrase the failure's message must contain


def run_checks(rank_pools, case: Case, implementation: str) -> list[dict]:
    """The property checks on a DDP class, or on MiniDDP driven by a training loop."""
    if implementation.endswith(":train_step"):
        spec = dataclasses.replace(case.spec, training_step=implementation)
        return check_claims(rank_pools, MINIDDP, case.world_size, spec)
    return check_claims(rank_pools, implementation, case.world_size, case.spec)


CAUGHT_BY_THE_PROPERTY_CHECKS = [
    Case("hook_averages_weights", f"{ZOO}.hook_averages_weights:AveragesWeights",
         "miniddp.steps:OverlapDDP", 2, SMALL,
         "a hook that reduced the parameter instead of its gradient"),
    Case("divide_after_sum", f"{ZOO}.divide_after_sum:DividesAfterSum",
         "miniddp.steps:TorchLayoutDDP", 3, SMALL,
         "not torch's bits. torch multiplies each gradient by the float 1/W"),
    Case("no_buffer_broadcast", f"{ZOO}.no_buffer_broadcast:NoBufferBroadcast",
         "miniddp.steps:NaiveDDP", 2,
         dataclasses.replace(SMALL, model=ModelSpec(seed=3, widths=(6,), batchnorm=True)),
         "'norm.running_mean' differs from torch's. A buffer"),
    Case("no_construction_broadcast", f"{ZOO}.no_construction_broadcast:NoConstructionBroadcast",
         "miniddp.steps:NaiveDDP", 2, dataclasses.replace(SMALL, seed_by_rank=True),
         "Did construction copy rank 0's parameters"),
    Case("loss_not_divided", f"{ZOO}.loss_not_divided:train_step",
         f"{ZOO}.correct_loop:train_step", 2, dataclasses.replace(SMALL, accumulation=3),
         "off by a factor of the accumulation steps"),
    Case("step_inside_no_sync", f"{ZOO}.step_inside_no_sync:train_step",
         f"{ZOO}.correct_loop:train_step", 2, dataclasses.replace(SMALL, accumulation=2),
         "The gradients were not averaged across ranks"),
]  # fmt: skip


@pytest.mark.parametrize("case", CAUGHT_BY_THE_PROPERTY_CHECKS, ids=lambda case: case.name)
def test_the_property_checks_catch_it(rank_pools, case):
    run_checks(rank_pools, case, case.fix)
    with pytest.raises(AssertionError, match=case.diagnosis):
        run_checks(rank_pools, case, case.mistake)


def all_reduces_per_step(results: list[dict], steps: int, expected: int, hint: str) -> None:
    """Every rank issued `expected` all-reduces per optimizer step."""
    for rank, result in enumerate(results):
        got = result["ours"]["all_reduces"]
        assert got == expected * steps, (
            f"rank {rank}: {got} all-reduces in {steps} optimizer steps, expected {expected} per "
            f"step. {hint}"
        )


def test_no_sync_around_backward_only_syncs_every_micro_step(rank_pools):
    """The numbers are right (the property checks pass); the communication is k times too much.
    The model is small enough for one bucket: one all-reduce per synchronized backward."""
    k = 3
    spec = dataclasses.replace(SMALL, accumulation=k)
    hint = "Every micro-step synchronized: is the forward inside no_sync()?"

    def checked(loop: str) -> list[dict]:
        loop_spec = dataclasses.replace(spec, training_step=f"{ZOO}.{loop}:train_step")
        return check_claims(rank_pools, MINIDDP, 2, loop_spec)

    all_reduces_per_step(checked("correct_loop"), spec.steps, 1, hint)
    results = checked("no_sync_backward_only")  # the property checks pass: numbers are right
    with pytest.raises(AssertionError, match=re.escape(hint)):
        all_reduces_per_step(results, spec.steps, 1, hint)
    assert results[0]["ours"]["all_reduces"] == k * spec.steps


def test_torchs_hook_and_torchs_reducer_scale_to_other_bits_at_w_3():
    """divide_after_sum's claim about torch's own recipes: the reducer multiplies by the float
    1/W (`mul_out(bucket_view, grad, 1/W)`), the default allreduce_hook divides (`div_(W)`).
    At W = 2 both are exact; at W = 3 they differ in the last bit for many float32 values."""
    gradients = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    for world_size, differ in [(2, False), (4, False), (3, True)]:
        reducer = gradients * torch.tensor(1 / world_size, dtype=torch.float32)
        hook = gradients.clone().div_(world_size)
        assert (not torch.equal(reducer, hook)) == differ, world_size
    reducer, hook = gradients * torch.tensor(1 / 3), gradients / 3
    assert (reducer != hook).float().mean() > 0.1  # a third of them, in this sample


def test_buckets_launched_in_ready_order_pair_up_different_buckets(rank_pools):
    """Odd ranks produce the two gradients in the other order: launched in bucket order they
    still pair up; launched as they fill, left's gradients are summed with right's."""
    pool = rank_pools(2)
    check_replicas_identical(pool.run(train_rank_ordered_branches, "miniddp.steps:BucketedDDP"))
    results = pool.run(train_rank_ordered_branches, f"{ZOO}.ready_order:LaunchesInReadyOrder")
    with pytest.raises(AssertionError, match="launched in a different order on each rank"):
        check_replicas_identical(results)


def test_gradients_read_before_the_wait_are_one_ranks_share(rank_pools, tmp_path):
    """Rank 1 starts late, so rank 0's all-reduces cannot have finished when it reads .grad."""
    pool = rank_pools(2)
    for run in ("fix", "mistake"):
        (tmp_path / run).mkdir()
    fixed = pool.run(train_with_a_late_peer, "miniddp.steps:OverlapDDP", str(tmp_path / "fix"))
    check_replicas_identical(fixed)
    mistake = f"{ZOO}.grad_before_wait:ReadsBeforeWait"
    results = pool.run(train_with_a_late_peer, mistake, str(tmp_path / "mistake"))
    with pytest.raises(AssertionError, match="one not waited for"):
        check_replicas_identical(results)


def new_order_each_epoch(orders: list[list[int]]) -> None:
    for epoch in range(1, len(orders)):
        assert orders[epoch] != orders[epoch - 1], (
            f"epochs {epoch - 1} and {epoch} visit the same samples in the same order "
            f"{orders[epoch]}: is sampler.set_epoch(epoch) called before each epoch?"
        )


def test_a_missing_set_epoch_repeats_every_epoch():
    """torch's own DistributedSampler, 24 samples on 3 ranks, rank 1's view of 3 epochs."""
    sampler = DistributedSampler(range(24), num_replicas=3, rank=1, shuffle=True, seed=0)
    fixed = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        fixed.append(list(sampler))
    new_order_each_epoch(fixed)
    sampler.set_epoch(0)
    with pytest.raises(AssertionError, match=r"is sampler.set_epoch\(epoch\) called"):
        new_order_each_epoch(indices_per_epoch(sampler, 3))


def test_an_unused_parameter_is_silent_in_torch_and_named_by_miniddp(rank_pools):
    """find_unused_parameters=False. torch's first backward returns with nothing averaged (the
    replicas' gradients differ) and only the next forward raises; MiniDDP raises at the end of
    the first backward, naming the parameter and the fix."""
    pool = rank_pools(2)
    torch_ddp = pool.run(two_steps_with_an_unused_parameter, True)
    assert [result["raised"][0] for result in torch_ddp] == [None, None]
    with pytest.raises(AssertionError, match="not averaged across ranks"):
        check_replicas_identical(torch_ddp)
    for result in torch_ddp:
        assert "Expected to have finished reduction in the prior iteration" in result["raised"][1]
    for result in pool.run(two_steps_with_an_unused_parameter, False):
        message = result["raised"][0]
        assert "spare_head.weight, spare_head.bias" in message, message
        assert "find_unused_parameters=True" in message, message
