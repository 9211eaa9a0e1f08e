"""fully_shard under a MixedPrecisionPolicy (miniddp/sharding/mixed_precision.py) against torch's
fully_shard with the same policy, both training with AdamW: the forward's outputs, the full
gradients and the full parameters after every step, bit for bit, at W = 2 and 3 (our ring
reduce-scatter adds in gloo's order and divides once, as gloo's AVG); the dtypes inside and
outside the forward; the bytes each collective moves; and the policies refused, with the fix.
"""

from __future__ import annotations

import pytest
import torch

from miniddp.sharding import MixedPrecisionPolicy
from miniddp.sharding.units import UNIT_NUMBER_BYTES
from tests import sharding_mixed_precision_tasks as tasks
from tests.sharding_fsdp_tasks import FsdpSpec

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
UNITS = 3  # FsdpSpec's three Linear layers; the root holds no parameters of its own


def assert_bitwise(ours: list, theirs: list, what: str) -> None:
    for step, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        mine, reference = (mine, reference) if isinstance(mine, list) else ([mine], [reference])
        for index, (a, b) in enumerate(zip(mine, reference, strict=True)):
            assert a.dtype == b.dtype, f"{what} {index}, step {step}: {a.dtype} vs {b.dtype}"
            assert torch.equal(a, b), f"{what} {index} differs at step {step}"


@pytest.mark.parametrize(
    "policy",
    [
        {"param_dtype": BF16, "reduce_dtype": FP32},
        {"param_dtype": BF16, "reduce_dtype": BF16},
        {"param_dtype": BF16, "output_dtype": FP32},  # reduce_dtype None: param_dtype's
    ],
    ids=["reduce fp32", "reduce bf16", "reduce default, output fp32"],
)
def test_bf16_compute_is_torchs_bits_at_w2_over_adamw_steps(pool2, policy):
    """69 shard elements per rank (tests/test_sharding_fsdp.py). Each step sends two bf16
    all-gathers (the shards are cast before the gather) and one reduce-scatter in reduce_dtype,
    plus the units' numbers: gathering in fp32 and casting after would give the same bits,
    and only these bytes show it."""
    reduce = policy.get("reduce_dtype") or BF16
    for rank, runs in enumerate(pool2.run(tasks.against_torch, FsdpSpec(steps=3), policy)):
        ours, torchs = runs["ours"], runs["torch"]
        assert_bitwise(ours["outputs"], torchs["outputs"], f"rank {rank}: output")
        assert_bitwise(ours["grads"], torchs["grads"], f"rank {rank}: gradient")
        assert_bitwise(ours["params"], torchs["params"], f"rank {rank}: parameter")
        shard = ours["shard_elements"]
        gathers, reduce_scatter = 2 * shard * BF16.itemsize, shard * reduce.itemsize
        assert ours["sent"] == [gathers + reduce_scatter + 2 * UNITS * UNIT_NUMBER_BYTES] * 3


def test_bf16_inside_the_forward_fp32_masters_grads_and_adam_state_outside(pool2):
    policy = {"param_dtype": BF16, "reduce_dtype": FP32}
    for runs in pool2.run(tasks.against_torch, FsdpSpec(steps=1), policy):
        for kind in ("ours", "torch"):
            assert runs[kind]["inside"] == {"weight": BF16, "input": BF16, "output": BF16}, kind
            assert runs[kind]["outside"] == {
                "shards": {FP32},
                "grads": {FP32},
                "optimizer state": {FP32},
            }, kind


def test_at_w3_fp32_reduction_is_torchs_bits_and_bf16_reduction_within_two_ulps(rank_pools):
    """Sums of three. In fp32 a sum of bf16 gradients is exact, so dividing once after it, as
    gloo's AVG does, gives torch's bits (a 1/W multiply first lands an ulp away, and Adam
    carries it on). In bf16 the sum rounds, in an order that depends on where the ring's chunks
    fall, which differs from torch's (rows, not flat): an ulp or two of bf16 in the gradient."""
    spec, pool = FsdpSpec(steps=2), rank_pools(3)
    exact = {"param_dtype": BF16, "reduce_dtype": FP32}
    for rank, runs in enumerate(pool.run(tasks.against_torch, spec, exact)):
        for what in ("outputs", "grads", "params"):
            assert_bitwise(runs["ours"][what], runs["torch"][what], f"rank {rank}: {what}")
    rounded = {"param_dtype": BF16, "reduce_dtype": BF16}
    for runs in pool.run(tasks.against_torch, spec, rounded):
        for what, tolerance in (("grads", 2**-7), ("params", 1e-4)):
            for ours, theirs in zip(runs["ours"][what], runs["torch"][what], strict=True):
                for a, b in zip(ours, theirs, strict=True):
                    scale = b.abs().max() if what == "grads" else 1  # ulps of the largest term
                    assert (a - b).abs().max() <= tolerance * scale, what


def test_one_unit_of_two_dtypes_is_allowed_under_a_policy(pool2):
    """Without a policy it is refused (tests/test_sharding_fsdp.py); with a param_dtype, every
    parameter is gathered in it, and each gradient comes back in its master's dtype."""
    for result in pool2.run(tasks.two_dtypes_in_one_unit, FsdpSpec()):
        mixed, fp32 = result["mixed"], result["fp32"]
        assert torch.equal(mixed["output"], fp32["output"])
        assert [g.dtype for g in mixed["grads"]] == [FP32, FP32, torch.float64, torch.float64]
        for a, b in zip(mixed["grads"], fp32["grads"], strict=True):
            assert torch.equal(a.float(), b)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, "bfloat16"])
def test_a_policy_dtype_that_is_not_floating_is_refused(dtype):
    with pytest.raises(ValueError, match="param_dtype must be a floating-point torch.dtype"):
        MixedPrecisionPolicy(param_dtype=dtype)


# Overflows at the third step in one rank's shards only (scale 2^18, growth every step).
SCALER = {"init_scale": 2.0**16, "growth_interval": 1}


@pytest.mark.parametrize("reduce_dtype", [FP16, FP32], ids=["reduce fp16", "reduce fp32"])
def test_float16_with_the_sharded_loss_scaler_is_torchs_bits(pool2, reduce_dtype):
    """fp16 compute under fully_shard, trained with ShardedGradScaler, against torch's
    fully_shard with the same policy and torch.amp.GradScaler: the scale, the unscaled full
    gradients (inf and NaN where it overflowed) and the full parameters after each AdamW step
    (a skipped one included), bit for bit. An fp16 reduce-scatter divides by W in two parts
    around the sum, as torch's does (sharded_parameters.float16_divide_factors)."""
    policy = {"param_dtype": FP16, "reduce_dtype": reduce_dtype}
    runs = pool2.run(tasks.fp16_against_torch, FsdpSpec(steps=3), policy, SCALER)
    for rank, run in enumerate(runs):
        ours, torchs = run["ours"], run["torch"]
        assert ours["scales"] == torchs["scales"] == runs[0]["ours"]["scales"], rank
        assert ours["scales"][1] > ours["scales"][2], "no step overflowed: the test is blind"
        for what in ("grads", "params"):
            for step, (mine, theirs) in enumerate(zip(ours[what], torchs[what], strict=True)):
                for a, b in zip(mine, theirs, strict=True):
                    where = f"rank {rank}'s {what} at step {step}"
                    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=where)


def test_with_torchs_scaler_the_ranks_would_disagree_on_an_overflow(pool2):
    """Why the sharded scaler: torch.amp.GradScaler on fully_shard's plain shards checks only
    this rank's, and at the third step one rank skips while the other steps."""
    policy = {"param_dtype": FP16}
    kind = "ours, torch.amp.GradScaler"
    scales = [
        r["scales"] for r in pool2.run(tasks.train_fp16_scaled, kind, FsdpSpec(), policy, SCALER)
    ]
    assert scales[0] != scales[1]


@pytest.mark.parametrize(
    "child, parent",
    [
        ({"param_dtype": BF16}, {}),
        ({}, {"param_dtype": BF16}),
        ({"param_dtype": FP32}, {"param_dtype": BF16}),
    ],
    ids=["bf16 child in fp32 parent", "fp32 child in bf16 parent", "fp32 child, no output cast"],
)
def test_a_child_computing_in_another_dtype_than_its_parent_is_refused(pool2, child, parent):
    for outcome in pool2.run_expecting_errors(tasks.a_child_in_another_dtype, child, parent):
        assert outcome.type_name == "ValueError", outcome
        assert "its outputs would reach the parent's layers in the wrong dtype" in outcome.message
        assert "fully_shard unit" in outcome.message and "output_dtype=" in outcome.message


def test_a_child_kept_in_fp32_that_casts_its_output_back_is_allowed(pool2):
    """torch's idiom for a layer kept in fp32 inside a bf16 model."""
    child = {"param_dtype": FP32, "output_dtype": BF16}
    assert pool2.run(tasks.a_child_in_another_dtype, child, {"param_dtype": BF16}) == [None] * 2
