"""The mistakes zoo (tutorials/mistakes/) has teeth: every classic DDP mistake there is caught,
with the diagnosis a learner needs, by the same checks that the ladder passes; and each one's fix
passes the same checks on the same scenario, so it is the mistake that is caught, not the
scenario.

Six are caught by the property checks themselves (tests/harness/equivalence.py); one of
them, divide_after_sum, is a lesson in bit-reproducibility rather than a bug. The others are, by
design, invisible to them, because the numbers come out right or the scenario needs
ranks that disagree; each gets the check that does catch it, as its docstring says.

Where the zoo needs a scenario of its own (ranks whose backwards disagree on gradient order, a
peer that starts late, a model with an unused parameter), the pool's ranks run a module-level
function of this file (the workers import `tests.test_mistakes`), next to its test. Its results
have train()'s shape ({"ours": {"names", "grads", "params"}}) so the same checks
(tests/harness/equivalence.py) read them.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from tests.harness.equivalence import check_claims, check_replicas_identical
from tests.workloads import ModelSpec, TrainSpec, grads_of, load_implementation, params_of
from tutorials.mistakes.missing_set_epoch import indices_per_epoch

ZOO = "tutorials.mistakes"
MINIDDP = "miniddp.data_parallel.ddp:MiniDDP"
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
    Case(
        "hook_averages_weights",
        f"{ZOO}.hook_averages_weights:AveragesWeights",
        "miniddp.steps:OverlapDDP",
        2,
        SMALL,
        "a hook that reduced the parameter instead of its gradient",
    ),
    Case(
        "divide_after_sum",
        f"{ZOO}.divide_after_sum:DividesAfterSum",
        "miniddp.steps:TorchLayoutDDP",
        3,
        SMALL,
        "not torch's bits. torch multiplies each gradient by the float 1/W",
    ),
    Case(
        "no_buffer_broadcast",
        f"{ZOO}.no_buffer_broadcast:NoBufferBroadcast",
        "miniddp.steps:NaiveDDP",
        2,
        dataclasses.replace(SMALL, model=ModelSpec(seed=3, widths=(6,), batchnorm=True)),
        "'norm.running_mean' differs from torch's. A buffer",
    ),
    Case(
        "no_construction_broadcast",
        f"{ZOO}.no_construction_broadcast:NoConstructionBroadcast",
        "miniddp.steps:NaiveDDP",
        2,
        dataclasses.replace(SMALL, seed_by_rank=True),
        "Did construction copy rank 0's parameters",
    ),
    Case(
        "loss_not_divided",
        f"{ZOO}.loss_not_divided:train_step",
        f"{ZOO}.correct_loop:train_step",
        2,
        dataclasses.replace(SMALL, accumulation=3),
        "off by a factor of the accumulation steps",
    ),
    Case(
        "step_inside_no_sync",
        f"{ZOO}.step_inside_no_sync:train_step",
        f"{ZOO}.correct_loop:train_step",
        2,
        dataclasses.replace(SMALL, accumulation=2),
        "The gradients were not averaged across ranks",
    ),
]


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


def batch(rank: int, step: int, features: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, features, generator=g), torch.randn(4, features, generator=g)


def train_steps(
    net: nn.Module,
    implementation: str,
    steps: int,
    before_forward: Callable[[int], None] = lambda step: None,
    after_reading: Callable[[int], None] = lambda step: None,
) -> dict:
    """SGD on `net` (4 features in, 4 out) wrapped in `implementation`, every parameter in a
    bucket of its own; the gradients are read right after backward (and
    finish_gradient_synchronization), and each step calls the two callbacks around that."""
    model = load_implementation(implementation)(net, bucket_cap_mb=1e-6)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    grads, params = [], []
    for step in range(steps):
        before_forward(step)
        x, y = batch(dist.get_rank(), step, 4)
        nn.functional.mse_loss(model(x), y).backward()
        model.finish_gradient_synchronization()
        grads.append(grads_of(net))
        after_reading(step)
        optimizer.step()
        optimizer.zero_grad()
        params.append(params_of(net))
    names = [name for name, _ in net.named_parameters()]
    return {"ours": {"names": names, "grads": grads, "params": params}}


def train_rank_ordered_branches(implementation: str) -> dict:
    """tutorials/mistakes/ready_order.py's model: odd ranks produce its two gradients in the
    other order."""
    from tutorials.mistakes.ready_order import RankOrderedBranches

    torch.manual_seed(0)
    return train_steps(RankOrderedBranches(), implementation, steps=2)


def test_buckets_launched_in_ready_order_pair_up_different_buckets(rank_pools):
    """Odd ranks produce the two gradients in the other order: launched in bucket order they
    still pair up; launched as they fill, left's gradients are summed with right's."""
    pool = rank_pools(2)
    check_replicas_identical(pool.run(train_rank_ordered_branches, "miniddp.steps:BucketedDDP"))
    results = pool.run(train_rank_ordered_branches, f"{ZOO}.ready_order:LaunchesInReadyOrder")
    with pytest.raises(AssertionError, match="launched in a different order on each rank"):
        check_replicas_identical(results)


LATE_PEER_PATIENCE_S = 0.5  # how long rank 1 waits for rank 0's "read" before going on anyway


def train_with_a_late_peer(implementation: str, flag_dir: str) -> dict:
    """Rank 1 starts each step only once rank 0 has read its gradients (or after
    LATE_PEER_PATIENCE_S, for a DDP that makes rank 0 wait for rank 1): so a rank 0 that reads
    .grad before the all-reduce is done certainly reads its own share, never the sum."""
    rank = dist.get_rank()

    def flag(step: int) -> Path:
        return Path(flag_dir) / f"rank-0-has-read-step-{step}"

    def rank_1_waits(step: int) -> None:
        deadline = time.monotonic() + LATE_PEER_PATIENCE_S
        while rank == 1 and not flag(step).exists() and time.monotonic() < deadline:
            time.sleep(0.002)

    def rank_0_has_read(step: int) -> None:
        if rank == 0:
            flag(step).touch()

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    return train_steps(net, implementation, 2, rank_1_waits, rank_0_has_read)


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


def two_steps_with_an_unused_parameter(use_torch: bool) -> dict:
    """tutorials/mistakes/unused_parameter.py's model under torch's DDP or MiniDDP, both with
    find_unused_parameters=False: the gradients after the backwards that returned, and what
    each of the first two steps raised (None if nothing)."""
    from miniddp import MiniDDP
    from tutorials.mistakes.unused_parameter import SpareHead

    net = SpareHead()
    model = (DistributedDataParallel if use_torch else MiniDDP)(net)
    raised, grads, params = [], [], []
    for step in range(2):
        x, y = batch(dist.get_rank(), step, 4)
        try:
            nn.functional.mse_loss(model(x), y[:, :1]).backward()
            raised.append(None)
        except RuntimeError as error:
            raised.append(str(error))
            break
        grads.append(grads_of(net))
        params.append(params_of(net))  # no optimizer: only the gradients can differ
    names = [name for name, _ in net.named_parameters()]
    return {"ours": {"names": names, "grads": grads, "params": params}, "raised": raised}


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
