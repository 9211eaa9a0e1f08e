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
from hypothesis import strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp import MiniDDP
from miniddp.steps import LADDER
from tests.measurements import record_max
from tests.properties import property_settings
from tests.workloads import (
    ModelSpec,
    TrainSpec,
    claims_of,
    model_dtype,
    reference_training,
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


# Tolerances against single-process training. Not zero, because the two sum the same terms in a
# different order: DDP sums each rank's batch, scales by 1/W and sums across ranks; one process
# sums the whole global batch inside one matmul. Floating-point addition is not associative, so
# results differ by a few units in the last place (float32: ~1e-7 relative), amplified a little by
# a few optimizer steps. BatchNorm amplifies them a lot: it divides by the standard deviation of
# the 2-5 samples a rank holds, which can be tiny (seen in float32: 1.3e-4 absolute, 8e-4
# relative). A real bug (a missing 1/W, another rank's data, a stale gradient) is off by O(1).
TOLERANCE = {
    (torch.float32, False): {"rtol": 1e-4, "atol": 2e-5},
    (torch.float32, True): {"rtol": 2e-3, "atol": 1e-3},
    (torch.float64, False): {"rtol": 1e-10, "atol": 1e-12},
    (torch.float64, True): {"rtol": 1e-9, "atol": 1e-10},
}


@st.composite
def train_specs(draw, max_width: int = 12) -> TrainSpec:
    depth = draw(st.integers(1, 3))
    widths = tuple(draw(st.integers(1, max_width)) for _ in range(depth))
    unused = draw(st.sampled_from(["none", "none", "all_ranks", "some_ranks"]))
    batchnorm = draw(st.booleans())
    model = ModelSpec(
        seed=draw(st.integers(0, 2**16)),
        in_features=draw(st.integers(1, 6)),
        widths=widths,
        out_features=draw(st.integers(1, 4)),
        frozen=tuple(i for i in range(depth) if draw(st.integers(0, 3)) == 0),
        tied=draw(st.booleans()),
        unused=unused,
        batchnorm=batchnorm,
        dtype=draw(st.sampled_from(["float32", "float64", "mixed"])),
    )
    cap = draw(
        st.one_of(
            st.none(),
            st.sampled_from([1e-6, 1e-4, 4e-4, 1e-3, 25.0]),  # one param per bucket .. one bucket
            st.floats(1e-6, 2e-3),
        )
    )
    return TrainSpec(
        model=model,
        bucket_cap_mb=cap,
        accumulation=draw(st.integers(1, 4)),
        steps=draw(st.integers(1, 3)),
        micro_batch=draw(st.integers(2, 5)),  # BatchNorm needs two samples per rank
        gradient_as_bucket_view=draw(st.booleans()),
        set_grads_to_none=draw(st.booleans()),
        broadcast_buffers=draw(st.booleans()) if batchnorm else True,
        find_unused_parameters=unused != "none" or draw(st.integers(0, 4)) == 0,
        data_seed=draw(st.integers(0, 2**16)),
    )


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a, b)


def check_against_torch(results: list[dict], one_dtype: bool = True, layout: bool = True) -> None:
    """(a) every gradient, parameter and buffer equals torch DDP's, bit for bit, on every rank;
    and with `layout`, so do the buckets.

    With several dtypes, torch launches the partly filled buckets left at the end of the layout
    (one per dtype) in hash-map order; then only their membership and inner order must match.
    """
    for rank, result in enumerate(results):
        ours, theirs = result["ours"], result["torch"]
        if layout:
            assert sorted(ours["layout"]) == sorted(theirs["layout"]), f"rank {rank}: layouts"
        if layout and one_dtype:
            assert ours["layout"] == theirs["layout"], f"rank {rank}: bucket order differs"
        for step, (g_ours, g_theirs) in enumerate(zip(ours["grads"], theirs["grads"])):
            for i, (a, b) in enumerate(zip(g_ours, g_theirs)):
                assert same(a, b), f"rank {rank} step {step}: gradient {i} differs from torch's"
        for step, (s_ours, s_theirs) in enumerate(zip(ours["states"], theirs["states"])):
            for i, (a, b) in enumerate(zip(s_ours, s_theirs)):
                assert same(a, b), f"rank {rank} step {step}: state entry {i} differs from torch's"


def check_replicas_identical(results: list[dict]) -> None:
    """(c) after every step all replicas hold the same parameters and gradients."""
    first = results[0]["ours"]
    for rank, result in enumerate(results[1:], start=1):
        for step in range(len(first["params"])):
            for a, b in zip(first["params"][step], result["ours"]["params"][step]):
                assert torch.equal(a, b), f"rank {rank} step {step}: replica differs from rank 0"
            for a, b in zip(first["grads"][step], result["ours"]["grads"][step]):
                assert same(a, b), f"rank {rank} step {step}: gradient differs from rank 0"


def check_against_single_process(spec: TrainSpec, results: list[dict], world_size: int) -> None:
    """(b) gradients and parameters equal single-process training with accumulation."""
    reference = reference_training(spec, world_size)
    dtype = torch.float64 if spec.model.dtype == "float64" else torch.float32
    tolerance = TOLERANCE[dtype, spec.model.batchnorm]
    label = f"{dtype}, {'with' if spec.model.batchnorm else 'no'} BatchNorm"
    ours = results[0]["ours"]
    for kind in ("grads", "params"):
        for step, (mine, ref) in enumerate(zip(ours[kind], reference[kind])):
            for i, (a, b) in enumerate(zip(mine, ref)):
                assert (a is None) == (b is None), f"step {step}: {kind}[{i}] None-ness differs"
                if a is None:
                    continue
                torch.testing.assert_close(
                    a, b, **tolerance, msg=lambda m, s=step, k=kind, j=i: f"step {s} {k}[{j}]: {m}"
                )
                record_max(f"max |MiniDDP - single process| ({label})", (a - b).abs().max())


def run_and_check(rank_pools, world_size: int, spec: TrainSpec) -> None:
    results = rank_pools(world_size).run(train_both, spec, timeout=120)
    check_against_torch(results, one_dtype=spec.model.dtype != "mixed")
    check_replicas_identical(results)
    check_against_single_process(spec, results, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
@property_settings(max_examples=100)
@given(spec=train_specs())
def test_matches_torch_ddp_and_single_process(rank_pools, world_size, spec):
    run_and_check(rank_pools, world_size, spec)


@property_settings(max_examples=12)
@given(spec=train_specs(max_width=6))
def test_matches_torch_ddp_and_single_process_on_four_ranks(rank_pools, spec):
    run_and_check(rank_pools, 4, spec)


@pytest.mark.parametrize("hook", ["allreduce", "fp16_compress"])
@property_settings(max_examples=15)
@given(spec=train_specs(max_width=8))
def test_torchs_comm_hooks_give_torchs_results(rank_pools, hook, spec):
    """register_comm_hook takes torch's hooks unchanged; results stay bitwise torch's."""
    spec = dataclasses.replace(spec, comm_hook=hook)
    results = rank_pools(3).run(train_both, spec, timeout=120)
    check_against_torch(results, one_dtype=spec.model.dtype != "mixed")
    check_replicas_identical(results)
    if hook == "allreduce":
        check_against_single_process(spec, results, 3)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("algorithm", ["ring", "reduce_broadcast"])
@property_settings(max_examples=12)
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


def fit_to_claims(spec: TrainSpec, implementation: str) -> TrainSpec:
    """Keep only what `implementation` claims to support (miniddp.steps.CLAIMS) of a drawn spec;
    a DDP without torch's keyword options always broadcasts buffers."""
    claims = claims_of(implementation)
    model = spec.model
    if "batchnorm" not in claims:
        model = dataclasses.replace(model, batchnorm=False)
    if "mixed-dtypes" not in claims and model.dtype == "mixed":
        model = dataclasses.replace(model, dtype="float32")
    if "find-unused-parameters" not in claims:
        model = dataclasses.replace(model, unused="none")
    takes_torchs_options = {"find-unused-parameters", "gradient-as-bucket-view"} <= claims
    return dataclasses.replace(
        spec,
        model=model,
        implementation=implementation,
        find_unused_parameters=spec.find_unused_parameters and takes_torchs_options,
        gradient_as_bucket_view=spec.gradient_as_bucket_view and takes_torchs_options,
        broadcast_buffers=spec.broadcast_buffers or not takes_torchs_options,
        accumulate_with_no_sync="no-sync" in claims,
        comm_hook=spec.comm_hook if "comm-hook" in claims else None,
    )


def check_rung(rank_pools, implementation: str, world_size: int, spec: TrainSpec) -> None:
    """What every rung promises: identical replicas, one process's results up to rounding, and
    torch's bits at W = 2 (a + b = b + a: the layout cannot matter); with torch's layout,
    torch's bits and buckets at any W."""
    spec = fit_to_claims(spec, implementation)
    results = rank_pools(world_size).run(train_both, spec, timeout=120)
    check_replicas_identical(results)
    check_against_single_process(spec, results, world_size)
    torch_layout = "torch-layout" in claims_of(implementation)
    if world_size == 2 or torch_layout:
        one_dtype = spec.model.dtype != "mixed"
        check_against_torch(results, one_dtype=one_dtype, layout=torch_layout)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("rung", RUNGS)
@property_settings(max_examples=10)
@given(spec=train_specs(max_width=8))
def test_every_rung_of_the_ladder(rank_pools, rung, world_size, spec):
    check_rung(rank_pools, rung, world_size, spec)


@property_settings(max_examples=6)
@given(spec=train_specs(max_width=6))
def test_the_torch_layout_rung_on_four_ranks(rank_pools, spec):
    check_rung(rank_pools, "miniddp.steps.torch_layout:TorchLayoutDDP", 4, spec)
