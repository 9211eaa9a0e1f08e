"""The proof: MiniDDP, and every rung of the ladder below it, computes what torch's DDP computes,
bit for bit, and what one process training on the global batch computes, up to rounding.

It opens with one fixed example to read. Then each hypothesis example draws a random model
(depth, widths, frozen, tied and unused parameters, BatchNorm buffers, float64 or a float64
layer among float32 ones), a bucket cap from "every parameter alone" to "one bucket", gradient
accumulation and a few optimizer steps, and runs it on a pool of W ranks with ours and torch's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp import MiniDDP
from miniddp.steps import LADDER
from tests.harness.equivalence import (
    FIXED_SPEC,
    TOLERANCE,
    check_against_single_process,
    check_against_torch,
    check_claims,
    check_replicas_identical,
    train_specs,
)
from tests.harness.option_checks import check_ideas
from tests.harness.properties import property_settings
from tests.workloads import (
    ModelSpec,
    TrainSpec,
    model_dtype,
    train_both,
    train_ours_with_hook_and_torch_without,
)


def example_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one step: 8 samples, 4 for each of the 2 ranks."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def example_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def example_on_each_rank() -> dict[str, list]:
    """Runs on each of 2 ranks: the same net trained for 2 steps by MiniDDP and torch's DDP."""
    rank = dist.get_rank()
    gradients = {}
    for name, ddp in [("MiniDDP", MiniDDP), ("torch", DistributedDataParallel)]:
        net = example_net()
        model = ddp(net, bucket_cap_mb=0.0001)  # a tiny cap: a bucket per parameter
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        gradients[name] = []
        for step in range(2):
            x, y = (t[4 * rank : 4 * rank + 4] for t in example_batch(step))  # my 4 samples
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()  # averaged when it returns
            gradients[name].append([p.grad.clone() for p in net.parameters()])
            optimizer.step()
    return gradients


def test_first_example_miniddp_equals_torch_and_one_process(rank_pools):
    """Read this one first. One process on all 8 samples gets the mean gradient over 8; each DDP
    rank gets the mean over its 4, then the all-reduce averages the 2 ranks: the same number,
    summed in another order, so equal up to rounding. torch's DDP sums in our order: equal bits."""
    per_rank = rank_pools(2).run(example_on_each_rank, timeout=60)
    net = example_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(2):
        optimizer.zero_grad()
        nn.functional.mse_loss(net(example_batch(step)[0]), example_batch(step)[1]).backward()
        for rank, gradients in enumerate(per_rank):
            pairs = zip(gradients["MiniDDP"][step], gradients["torch"][step], net.parameters())
            for ours, torchs, one_process in pairs:
                assert torch.equal(ours, torchs), f"rank {rank} step {step}: not torch's bits"
                torch.testing.assert_close(ours, one_process.grad, rtol=1e-5, atol=1e-7)
        optimizer.step()


def run_and_check(rank_pools, world_size: int, spec: TrainSpec) -> None:
    results = rank_pools(world_size).run(train_both, spec, timeout=120)
    check_against_torch(results, one_dtype=spec.model.dtype != "mixed")
    check_replicas_identical(results)
    check_against_single_process(spec, results, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
@property_settings(max_examples=30)
@given(spec=train_specs())
def test_matches_torch_ddp_and_single_process(rank_pools, world_size, spec):
    run_and_check(rank_pools, world_size, spec)


@property_settings(max_examples=12)
@given(spec=train_specs(max_width=6))
def test_matches_torch_ddp_and_single_process_on_four_ranks(rank_pools, spec):
    run_and_check(rank_pools, 4, spec)


def check_torchs_comm_hook(rank_pools, spec: TrainSpec, hook: str) -> None:
    """register_comm_hook takes torch's hooks unchanged; results stay bitwise torch's."""
    spec = dataclasses.replace(spec, comm_hook=hook)
    results = rank_pools(3).run(train_both, spec, timeout=120)
    check_against_torch(results, one_dtype=spec.model.dtype != "mixed")
    check_replicas_identical(results)
    if hook == "allreduce":
        check_against_single_process(spec, results, 3)


@pytest.mark.parametrize("hook", ["allreduce", "fp16_compress"])
@property_settings(max_examples=10)
@given(spec=train_specs(max_width=8))
def test_torchs_comm_hooks_give_torchs_results(rank_pools, hook, spec):
    check_torchs_comm_hook(rank_pools, spec, hook)


@pytest.mark.parametrize("hook", ["allreduce", "fp16_compress"])
@property_settings(max_examples=6)
@given(spec=train_specs(max_width=8))
def test_torchs_comm_hooks_on_the_comm_hook_rung(rank_pools, hook, spec):
    """Rung 7 (miniddp/steps/comm_hooks.py) claims torch's hook protocol: the same check."""
    rung = "miniddp.steps.comm_hooks:CommHookDDP"
    check_torchs_comm_hook(rank_pools, dataclasses.replace(spec, implementation=rung), hook)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("algorithm", ["ring", "reduce_broadcast"])
@property_settings(max_examples=8)  # the algorithms' own properties: tests/test_collectives.py
@given(spec=train_specs(max_width=8))
def test_our_all_reduces_train_like_gloos(rank_pools, world_size, algorithm, spec):
    """MiniDDP over miniddp.collectives trains to torch DDP's parameters: bit for bit on 2 ranks
    (a + b = b + a), and on 3 within the single-process tolerance: the ring adds the three
    ranks' values in another order than gloo does."""
    spec = dataclasses.replace(spec, comm_hook=algorithm)
    results = rank_pools(world_size).run(train_ours_with_hook_and_torch_without, spec)
    check_replicas_identical(results)
    if world_size == 2:
        check_against_torch(results, one_dtype=spec.model.dtype != "mixed")
    else:
        tolerance = TOLERANCE[model_dtype(spec.model), spec.model.batchnorm]
        for ours, theirs in zip(results[0]["ours"]["params"], results[0]["torch"]["params"]):
            for a, b in zip(ours, theirs):
                torch.testing.assert_close(a, b, **tolerance)


def test_default_caps_on_a_model_larger_than_the_first_bucket(rank_pools):
    """bucket_cap_mb=None: one bucket in iteration 1, then a 1 MiB first bucket and 25 MiB ones."""
    spec = TrainSpec(
        model=ModelSpec(in_features=300, widths=(600, 600), out_features=300),
        steps=3,
        accumulation=2,
    )
    results = rank_pools(3).run(train_both, spec, timeout=120)
    check_against_torch(results)
    check_replicas_identical(results)
    assert len(results[0]["ours"]["layout"]) >= 2


RUNGS = [f"{rung.__module__}:{rung.__name__}" for rung in LADDER if rung is not MiniDDP]
# At 4 ranks (oversubscribed here): the first rung with torch's layout, and the top one.
_WITH_TORCHS_LAYOUT = [r for r in LADDER if r is not MiniDDP and "torch-layout" in r.claims]
TORCH_LAYOUT_RUNGS = [
    f"{rung.__module__}:{rung.__name__}"
    for rung in (_WITH_TORCHS_LAYOUT[0], _WITH_TORCHS_LAYOUT[-1])
]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("rung", RUNGS)
@property_settings(max_examples=5)  # 7 rungs x 2 world sizes; each rung's idea has its own test
@given(spec=train_specs(max_width=8))
def test_every_rung_of_the_ladder(rank_pools, rung, world_size, spec):
    check_claims(rank_pools, rung, world_size, spec)


@pytest.mark.parametrize("rung", TORCH_LAYOUT_RUNGS)
@property_settings(max_examples=4)
@given(spec=train_specs(max_width=6))
def test_the_torch_layout_rungs_on_four_ranks(rank_pools, rung, spec):
    check_claims(rank_pools, rung, 4, spec)


def with_unused_head(where: str) -> TrainSpec:
    model = dataclasses.replace(FIXED_SPEC.model, unused=where)
    return dataclasses.replace(FIXED_SPEC, model=model, find_unused_parameters=True)


# Each rung above torch's layout on the examples that exercise what it adds, at W = 3 (where a
# wrong layout or scaling changes bits): read these first; the random examples above search.
IDEAS_OF_THE_RUNGS = {
    # accumulation inside no_sync, with BatchNorm: buffers refreshed only after a synced forward
    "no_sync": ("miniddp.steps.no_sync:NoSyncDDP", FIXED_SPEC),
    # a head one rank of three skips: its gradient is the average with that rank's zeros
    "unused_on_one_rank": (
        "miniddp.steps.unused:UnusedParametersDDP",
        with_unused_head("some_ranks"),
    ),
    # a head no rank uses: its .grad stays None, as torch's, so momentum never moves it
    "unused_everywhere": (
        "miniddp.steps.unused:UnusedParametersDDP",
        with_unused_head("all_ranks"),
    ),
    # gradients living in the buckets, kept across steps by zero_grad(set_to_none=False)
    "bucket_views": (
        "miniddp.steps.comm_hooks:CommHookDDP",
        dataclasses.replace(FIXED_SPEC, gradient_as_bucket_view=True, set_grads_to_none=False),
    ),
}


@pytest.mark.parametrize("idea", list(IDEAS_OF_THE_RUNGS))
def test_each_rung_above_torchs_layout_on_the_example_of_its_idea(rank_pools, idea):
    rung, spec = IDEAS_OF_THE_RUNGS[idea]
    check_claims(rank_pools, rung, 3, spec)


@pytest.mark.parametrize("world_size", [2, 3])
def test_your_ddp_on_one_fixed_example(rank_pools, your_ddp, world_size):
    """Your own DDP class on one small, fixed example first: with -x, a mistake stops the run
    here, in seconds, before hypothesis searches (and shrinks) random ones."""
    implementation, claims = your_ddp
    check_claims(rank_pools, implementation, world_size, FIXED_SPEC, claims)


def test_your_ddp_carries_the_idea_it_claims(rank_pools, your_ddp):
    """The exercises' ideas that gradients cannot show (tests/harness/idea_checks.py and
    option_checks.py): with `--ddp-claims buckets`, one all-reduce per bucket; torch-layout,
    torch's two default caps and the rebuild from rank 0's order; no-sync, nothing sent inside
    no_sync(); find-unused-parameters, None where no rank used a parameter; comm-hook, the
    registered hook called as torch calls it. Without such a claim, nothing to check."""
    implementation, claims = your_ddp
    check_ideas(rank_pools, implementation, claims)


@pytest.mark.parametrize("world_size", [2, 3])
@property_settings(max_examples=10)
@given(spec=train_specs(max_width=8))
def test_your_ddp(rank_pools, your_ddp, world_size, spec):
    """Your own DDP class, given with `--ddp FILE.py:CLASS` (and `--ddp-claims a,b` for more
    than the base claims): the checks every rung of the ladder passes."""
    implementation, claims = your_ddp
    check_claims(rank_pools, implementation, world_size, spec, claims)
