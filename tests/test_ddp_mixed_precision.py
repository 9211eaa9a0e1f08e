"""MiniDDP(module, mixed_precision=MixedPrecision(torch.bfloat16, reduce_dtype)) (miniddp/
data_parallel/compute_copies.py): fp32 masters, a bf16 copy for forward and backward, buckets in
reduce_dtype, averages in the masters' fp32 .grad.

Bitwise against two references at W = 2, over several AdamW steps: a hand-written one (a bf16
copy computes, each rank's bf16 gradients are summed in fp32 across no_sync's microbatches,
cast to reduce_dtype, averaged over the ranks), and torch's fully_shard with the same
MixedPrecisionPolicy (torch's DDP mixed precision does not run on CPU: "cpu backend doesn't
support events"). At W = 2 every sum has two terms, so the order of gloo's sum does not matter.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from miniddp import MiniDDP, MixedPrecision
from miniddp.data_parallel.layout import BucketLayout
from miniddp.sharding import Formula, MixedPrecisionPolicy
from tests import ddp_mixed_precision_tasks as tasks
from tests.ddp_mixed_precision_tasks import MpSpec

BF16 = torch.bfloat16


def assert_bitwise(ours: list, reference: list, what: str) -> None:
    for step, (mine, theirs) in enumerate(zip(ours, reference, strict=True)):
        if isinstance(mine, torch.Tensor):
            mine, theirs = [mine], [theirs]
        for index, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert a.dtype == b.dtype, f"{what}: {index} is {a.dtype}, not {b.dtype}, at {step}"
            assert torch.equal(a, b), f"{what}: tensor {index} differs at step {step}"


@pytest.mark.parametrize(
    "reduce_dtype, accumulation, fused",
    [(torch.float32, 1, False), (BF16, 1, False), (torch.float32, 3, False), (BF16, 3, False)]
    + [(torch.float32, 1, True)],  # a fused step moves the masters unseen by autograd
    ids=["fp32-synced", "bf16-synced", "fp32-no_sync", "bf16-no_sync", "fused-adamw"],
)
def test_bitwise_the_hand_written_reference(pool2, reduce_dtype, accumulation, fused):
    spec = MpSpec(accumulation=accumulation, reduce_dtype=reduce_dtype, fused=fused)
    for rank, result in enumerate(pool2.run(tasks.against_the_hand_written_reference, spec)):
        ours, reference = result["ours"], result["reference"]
        assert_bitwise(ours["outputs"], reference["outputs"], f"rank {rank} outputs (bf16)")
        assert_bitwise(ours["grads"], reference["grads"], f"rank {rank} grads (fp32)")
        assert_bitwise(ours["params"], reference["params"], f"rank {rank} masters (fp32)")


@pytest.mark.parametrize(
    "reduce_dtype, accumulation", [(torch.float32, 2), (BF16, 1)], ids=["fp32-no_sync", "bf16"]
)
def test_bitwise_torchs_fully_shard_with_the_same_policy(pool2, reduce_dtype, accumulation):
    """(With a bf16 reduction and no_sync they part: fully_shard accumulates in reduce_dtype,
    bf16, and MiniDDP in fp32; mixed_precision.py says why.)"""
    spec = MpSpec(steps=4, accumulation=accumulation, reduce_dtype=reduce_dtype)
    for rank, result in enumerate(pool2.run(tasks.against_torch_fully_shard, spec)):
        ours, theirs = result["ours"], result["torch"]
        assert_bitwise(ours["outputs"], theirs["outputs"], f"rank {rank} outputs")
        assert_bitwise(ours["grads"], theirs["grads"], f"rank {rank} grads")
        assert_bitwise(ours["params"], theirs["params"], f"rank {rank} parameters")


def test_at_w3_the_sum_is_divided_after_as_torchs_mixed_precision_does(rank_pools):
    """torch's DDP mixed precision and fully_shard divide gloo's sum by W; MiniDDP without
    mixed precision multiplies each gradient by fl(1/W) first, as torch's DDP does. At W = 3
    the two differ in the last bit, and mixed precision is the first."""
    results = rank_pools(3).run(tasks.average_at_w3, MpSpec())
    for rank, result in enumerate(results):
        assert_bitwise([result["ours"]], [result["divided"]], f"rank {rank}")
    differ = [not torch.equal(a, b) for r in results for a, b in zip(r["ours"], r["scaled"])]
    assert any(differ), "this model cannot tell divide-after from scale-before"


def test_the_module_holds_bf16_copies_inside_forward_and_backward_masters_outside(pool2):
    for result in pool2.run(tasks.dtypes_inside_and_outside):
        # linear's weight and bias, the frozen layer's (cast too: they compute), then the input
        assert result["seen"]["forward"] == [BF16] * 5
        assert result["seen"]["backward"] == [BF16] * 5
        assert result["masters_before"] and result["masters_after"]
        assert result["masters_after_no_grad"]  # no backward to wait for: back at once
        f32 = torch.float32
        assert result["after"] == [(f32, f32), (f32, f32), (f32, None), (f32, None)]
        assert result["copies_grads"] == [None] * 4  # each bf16 gradient moved into its master
        assert result["buffers"] == [torch.float64, torch.int64]  # floating ones cast


def test_buckets_count_their_bytes_in_reduce_dtype():
    """Eight gradients of 1000 elements, 8000-byte buckets: fp32 fits two a bucket, bf16 four,
    so reducing in bf16 halves the number of buckets; reducing in fp32 keeps fp32 DDP's."""
    params = [torch.zeros(1000, requires_grad=True) for _ in range(8)]
    cap_mb = 8000 / 2**20

    def layout(reduce_dtype):  # find_unused_parameters: torch's caps from the start
        return BucketLayout(params, cap_mb, True, False, reduce_dtype).describe(list("abcdefgh"))

    plain, fp32, bf16 = layout(None), layout(torch.float32), layout(BF16)
    assert [b.param_names for b in fp32] == [b.param_names for b in plain]
    assert (len(plain), len(bf16)) == (4, 2)
    assert {b.dtype for b in bf16} == {BF16} and {b.nbytes for b in bf16} == {8000}


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_zero_under_mixed_precision_is_bitwise_miniddp_with_adamw(pool2, stage):
    spec = MpSpec(steps=3, accumulation=2)
    for rank, result in enumerate(pool2.run(tasks.zero_against_plain, spec)):
        plain, sharded = result["plain"], result[stage]
        assert_bitwise(sharded["params"], plain["params"], f"rank {rank} {stage} masters")
        for step, (mine, theirs) in enumerate(zip(sharded["grads"], plain["grads"])):
            for index, (a, b) in enumerate(zip(mine, theirs)):
                owned = stage == "zero1" or sharded["owned"]["mask"][index]
                assert (a is not None) == owned, f"rank {rank}: gradient {index}, step {step}"
                assert a is None or torch.equal(a, b), f"rank {rank}: gradient {index}"


@pytest.mark.parametrize("reduce_dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_memory_per_rank_is_the_formula_to_the_byte(pool2, reduce_dtype):
    """fp32 masters 4Ψ, bf16 copies 2Ψ, fp32 gradients 4Ψ, buckets in reduce_dtype, Adam 8Ψ
    (miniddp/sharding/memory.py): ZeRO-1 shards the states, ZeRO-2 the gradients too."""
    spec = MpSpec(steps=2, reduce_dtype=reduce_dtype)
    model = tasks.build_model(spec)
    psi, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    mp = {"param_dtype": BF16, "reduce_dtype": reduce_dtype}
    results = pool2.run(tasks.memory_under_mixed_precision, spec)
    for result in results:
        ddp = Formula("ddp", psi, tensors, 2, **mp).expected()
        assert result["plain"]["memory"] == ddp
        assert ddp.compute_copies == 2 * psi and ddp.gradients == 4 * psi
        assert ddp.buckets == reduce_dtype.itemsize * psi
        for stage in ("zero1", "zero2"):
            run = result[stage]
            expected = Formula(stage, psi, run["tensors"], 2, **mp).expected(run["elements"])
            assert run["memory"] == expected, stage
    assert sum(r["zero1"]["elements"] for r in results) == psi


def test_memory_with_gradients_as_bucket_views(pool2):
    spec = MpSpec(steps=2)
    params = list(tasks.build_model(spec).parameters())
    psi, tensors = sum(p.numel() for p in params), len(params)
    for result in pool2.run(tasks.memory_under_mixed_precision, spec, bucket_view=True):
        expected = Formula("ddp", psi, tensors, 2, bucket_view=True, param_dtype=BF16).expected()
        assert result["ddp"] == expected
        # 4Ψ + 2Ψ + 4Ψ + 8Ψ (and Adam's steps): ZeRO's 16Ψ, plus the 2Ψ of the fp32 .grad
        assert expected.total == 18 * psi + 4 * tensors


@pytest.mark.parametrize(
    "options, error, words",
    [
        ({"param_dtype": torch.int8}, ValueError, "floating-point dtype"),
        ({"param_dtype": BF16, "reduce_dtype": torch.int32}, ValueError, "floating-point"),
        ({"param_dtype": "bf16"}, TypeError, "torch.dtype"),
    ],
)
def test_a_bad_policy_is_refused_with_the_fix(options, error, words):
    with pytest.raises(error, match=words):
        MixedPrecision(**options)


def test_float16_with_torchs_loss_scaler_is_torchs_fully_shard_bits(pool2):
    """MixedPrecision(torch.float16) with torch.amp.GradScaler, against torch's fully_shard
    with the same fp16 policy and scaler: a first scale of 2^16 that grows every step
    overflows at the third step, which both skip. The scale, the masters' gradients and the
    parameters, bit for bit (every rank holds the same averaged gradients, so torch's scaler
    finds the same inf on each)."""
    for rank, result in enumerate(pool2.run(tasks.float16_with_a_loss_scaler, MpSpec(steps=4))):
        ours, theirs = result["ours"], result["torch"]
        assert ours["scales"] == theirs["scales"], rank
        assert min(ours["scales"][1:]) < max(ours["scales"]), "no step overflowed"
        for what in ("grads", "params"):
            for mine, reference in zip(ours[what], theirs[what], strict=True):
                for a, b in zip(mine, reference, strict=True):
                    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_a_bucket_view_needs_the_bucket_in_the_masters_dtype(pool2):
    for outcome in pool2.run_expecting_errors(tasks.bucket_view_with_a_bf16_bucket):
        assert outcome.type_name == "ValueError"
        assert "gradient_as_bucket_view=False" in outcome.message


def test_ranks_with_different_policies_all_refuse(pool2):
    for outcome in pool2.run_expecting_errors(tasks.policies_differ_across_ranks):
        assert outcome.type_name == "ValueError"
        assert "mixed_precision is" in outcome.message


def test_the_policy_is_frozen():
    policy = MixedPrecision(BF16)
    with pytest.raises(AttributeError):
        policy.param_dtype = torch.float32  # type: ignore[misc]
    assert replace(policy, reduce_dtype=BF16).reduce_dtype is BF16


@pytest.mark.parametrize("static_graph", [False, True], ids=["find_unused", "static_graph"])
def test_an_unused_branch_is_found_in_the_copies_graph(pool2, static_graph):
    for rank, result in enumerate(pool2.run(tasks.with_an_unused_branch, static_graph)):
        assert_bitwise([result["ours"]], [result["expected"]], f"rank {rank} used branch")
        assert result["unused"] == [None, None]


def test_join_shadows_the_buckets_in_reduce_dtype(pool2):
    result = pool2.run(tasks.joined_early)[0]
    assert_bitwise([result["ours"]], [result["expected"]], "rank 0, alone in step 2")


@pytest.mark.parametrize(
    "given",
    [BF16, "MixedPrecisionPolicy"],
    ids=["a-dtype", "fully_shards-policy"],
)
def test_a_dtype_or_fully_shards_policy_is_refused_naming_mixed_precision(given):
    """The reverse of fully_shard's refusal of a MixedPrecision: a TypeError naming the type,
    before any process group is needed (it is the caller's argument, the same on every rank)."""
    if given == "MixedPrecisionPolicy":
        given = MixedPrecisionPolicy(param_dtype=BF16)
    with pytest.raises(TypeError, match=r"miniddp\.MixedPrecision\b") as refused:
        MiniDDP(torch.nn.Linear(2, 2), mixed_precision=given)
    assert "MixedPrecision(torch.bfloat16)" in str(refused.value)
