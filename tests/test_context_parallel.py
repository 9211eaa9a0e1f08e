"""Context parallelism (miniddp/context_parallel/) against one process's attention on the whole
sequence, and against torch's private ring, _templated_ring_attention, on the same parts.

What equality to expect: within rounding (float64: measured under 2e-15), not bitwise. One
process's softmax normalises each query's row over all S keys at once; the ring normalises
each block over its own keys and rescales by log-sum-exp as the blocks arrive: the same sum,
in another order. Torch's ring merges the same way (told to merge in float64, as ours does:
its default is float32), so the two rings agree to the same rounding.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from miniddp.context_parallel import chunks_of, ring_bytes, stats_for, step_blocks
from miniddp.context_parallel.kernels import kernel_for
from tests import context_parallel_tasks as tasks
from tests.context_parallel_tasks import AttentionSpec
from tests.harness.measurements import record_max

FLOAT64_TOLERANCE = 1e-12
LAYOUTS = list(itertools.product((False, True), (False, True)))  # (is_causal, load_balance)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("is_causal, load_balance", LAYOUTS)
def test_ring_attention_is_one_process_sdpa_and_torchs_ring(
    rank_pools, world_size, is_causal, load_balance
):
    """Output, dq, dk and dv: each rank's part equals the slice of one process's SDPA and its
    gradients, and torch's ring's."""
    spec = AttentionSpec(is_causal=is_causal, load_balance=load_balance, length=8 * world_size)
    for rank, result in enumerate(rank_pools(world_size).run(tasks.differences, spec, True)):
        for kind, largest in result.items():
            for what, difference in largest.items():
                record_max(f"ring attention float64, {kind} ({what})", difference)
                assert difference <= FLOAT64_TOLERANCE, (rank, kind, what, difference)


def test_a_scale_and_float32_are_one_process_sdpa(pool2):
    spec = AttentionSpec(is_causal=True, load_balance=True, dtype=tasks.torch.float32, scale=0.3)
    for result in pool2.run(tasks.differences, spec):
        assert max(result["ours"].values()) <= 1e-5, result


@pytest.mark.parametrize("load_balance", [False, True])
def test_a_wrong_causal_offset_is_caught(pool2, load_balance):
    """The check itself: a mask built from local positions (the source rank's offset
    forgotten) leaves every rank but none far from one process."""
    spec = AttentionSpec(is_causal=True, load_balance=load_balance)
    worst = max(max(r["ours"].values()) for r in pool2.run(tasks.with_a_wrong_causal_offset, spec))
    assert worst > 1e-2


@pytest.mark.parametrize("shape, dim", [((2, 3, 16, 4), 2), ((3, 8, 5), 1), ((8,), 0)])
@pytest.mark.parametrize("load_balance", [False, True])
def test_shard_then_unshard_is_the_whole_tensor(pool2, shape, dim, load_balance):
    for result in pool2.run(tasks.round_trip, shape, dim, load_balance):
        assert result == {"sharded": True, "unsharded": True, "gradient": True}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("is_causal, load_balance", LAYOUTS)
def test_the_plan_computes_every_needed_block_once(world_size, is_causal, load_balance):
    """Over all ranks and steps, every chunk pair (a, b) with b <= a (every pair unmasked) is
    computed exactly once, on the diagonal causally, and nothing else."""
    computed = []
    for rank, step in itertools.product(range(world_size), range(world_size)):
        queries = chunks_of(rank, world_size, load_balance)
        keys = chunks_of((rank - step) % world_size, world_size, load_balance)
        for block in step_blocks(rank, world_size, step, is_causal, load_balance):
            a = queries[block.q]
            for b in keys[block.k_start : block.k_stop]:
                computed.append((a, b, block.causal))
    chunks = (2 if load_balance else 1) * world_size
    needed = [(a, b, is_causal and a == b) for a in range(chunks) for b in range(chunks)]
    needed = [(a, b, c) for a, b, c in needed if not is_causal or b <= a]
    assert sorted(computed) == sorted(needed)


@pytest.mark.parametrize("load_balance", [False, True])
def test_blocks_counted_and_bytes_sent(rank_pools, load_balance):
    """Plain, causal rank r computes r + 1 of its W chunk pairs; balanced, every rank the same
    2W + 1 (two diagonal), and the same scores. Forward sends (W-1)·2·S/W·H·D·itemsize bytes
    (times B) and the settings, one number a hop; backward twice K and V's."""
    world_size, spec = 4, AttentionSpec(is_causal=True, load_balance=load_balance, length=32)
    results = rank_pools(world_size).run(tasks.blocks_and_bytes, spec)
    per_rank_bytes = (world_size - 1) * 2 * spec.length // world_size * spec.heads
    per_rank_bytes *= spec.head_dim * 8 * spec.batch
    settings = (world_size - 1) * 8  # one number a hop: is_causal and load_balance
    expected = (per_rank_bytes + settings, 2 * per_rank_bytes)
    assert ring_bytes(spec.length, spec.heads, spec.head_dim, world_size, 8, spec.batch) == expected
    for rank, result in enumerate(results):
        (stats,) = result["stats"]
        chunk = spec.length // (2 if load_balance else 1) // world_size
        assert stats == stats_for(rank, world_size, True, load_balance, chunk, 6)
        assert stats.blocks == (2 * world_size + 1 if load_balance else rank + 1)
        assert (result["forward"], result["backward"]) == expected
    scores = {result["stats"][0].scores for result in results}
    assert len(scores) == (1 if load_balance else world_size)


def test_bad_input_is_refused_on_every_rank_with_the_fix(pool2):
    for rank, found in enumerate(pool2.run(tasks.refusals)):
        expected = {
            "S not divisible by W": "multiple of W",
            "S not divisible by 2W": "multiple of 2W = 4",
            "odd local length": "multiple of 2W",
            "different lengths": "6, 4 and 6 positions",
            "causal and a mask": "give one or the other",
        }
        if rank:  # rank 0 is the one member of that group
            expected["a group without this rank"] = "is not in this context-parallel group"
        for case, words in expected.items():
            assert words in found[case], (rank, case, found[case])


def test_ranks_holding_different_lengths_all_refuse_before_any_kv_moves(pool2):
    """Each rank's part looks fine alone; together they cannot be one sequence cut evenly, and
    the ring's messages would not match (gloo aborts one rank, the other returns nonsense)."""
    for rank, found in enumerate(pool2.run(tasks.lengths_differ_across_ranks)):
        assert "rank 0 holds 6 positions and rank 1 holds 4" in found["said"], (rank, found)
        assert "multiple of W" in found["said"]
        assert found["bytes"] == 0, f"rank {rank} sent K/V before refusing"


@pytest.mark.parametrize(
    "mesh_shape, load_balance",
    [((1, 2), True), ((1, 2), False), ((2, 2), True)],
    ids=["cp2-balanced", "cp2-plain", "dp2xcp2"],
)
def test_the_gpt_on_a_dp_by_cp_mesh_trains_as_one_process(rank_pools, mesh_shape, load_balance):
    """Chapter 12's model, its attention on the ring (sdpa_on_the_ring), each rank a part of
    each window with its global positions, MiniDDP averaging over DP x CP: the loss of every
    step and the parameters after three AdamW steps are one process's on the global batch."""
    run = tasks.GPTRun(mesh_shape=mesh_shape, load_balance=load_balance)
    world_size = mesh_shape[0] * mesh_shape[1]
    for rank, result in enumerate(rank_pools(world_size).run(tasks.dp_times_cp_gpt, run)):
        record_max("GPT on DP x CP float64, loss per step", result["loss"])
        assert result["loss"] <= FLOAT64_TOLERANCE and result["params"] <= FLOAT64_TOLERANCE, (
            rank,
            result,
        )


def test_averaging_over_dp_alone_is_caught(rank_pools):
    """The check itself, on the classic trap: each CP rank's gradient is only its part of the
    sequence's, so DDP over the DP group alone trains another model."""
    run = tasks.GPTRun(mesh_shape=(2, 2), averaged_over="dp")
    for result in rank_pools(4).run(tasks.dp_times_cp_gpt, run):
        assert result["params"] > 1e-4, result


@pytest.mark.parametrize(
    "device, dtype, kernel",
    [
        ("cpu", torch.float32, "cpu flash"),
        ("cpu", torch.bfloat16, "cpu flash"),
        ("cuda", torch.bfloat16, "cuda flash"),
        ("cuda", torch.float16, "cuda flash"),
        ("cuda", torch.float32, "cuda efficient"),
        ("cuda", torch.float64, "math"),
    ],
)
def test_the_block_kernel_is_the_devices(device, dtype, kernel):
    """ring_attention calls the kernel of its tensors' device (kernels.py): the CPU-only flash
    kernel would fail on a GPU. The CUDA kernels themselves run in tests/test_cuda.py."""
    assert kernel_for(device, dtype).name == kernel


def test_a_device_without_a_kernel_is_named():
    with pytest.raises(NotImplementedError, match="no block kernel for meta tensors"):
        kernel_for("meta", torch.float32)


def test_the_cpu_kernel_returns_sdpas_output_and_the_log_sum_exp():
    """The merge needs lse = log Z: out and lse against F.scaled_dot_product_attention and the
    scores' logsumexp, written out."""
    q, k, v = torch.randn(3, 1, 2, 6, 8, dtype=torch.float64)
    out, lse = kernel_for("cpu", q.dtype).forward(q, k, v, False, None)
    scores = q @ k.transpose(-1, -2) / 8**0.5
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    torch.testing.assert_close(lse, scores.logsumexp(-1))


@pytest.mark.parametrize("causal", [False, True])
def test_the_written_out_kernel_is_the_cpu_kernel(causal):
    """CUDA's float64 blocks run the attention written out (kernels.py, MATH): forward (out,
    lse) and backward (given the merged out and lse, as the ring calls it) against the CPU
    flash kernel, in float64."""
    generator = torch.Generator().manual_seed(3)
    q, k, v, grad_out = torch.randn(4, 2, 3, 6, 8, dtype=torch.float64, generator=generator)
    cpu, math = kernel_for("cpu", q.dtype), kernel_for("cuda", q.dtype)
    out, lse = cpu.forward(q, k, v, causal, 0.3)
    for mine, theirs in zip(math.forward(q, k, v, causal, 0.3), (out, lse), strict=True):
        torch.testing.assert_close(mine, theirs)
    mine = math.backward(grad_out, q, k, v, out, lse, causal, 0.3)
    theirs = cpu.backward(grad_out, q, k, v, out, lse, causal, 0.3)
    for a, b in zip(mine, theirs[:3], strict=True):
        torch.testing.assert_close(a, b)
