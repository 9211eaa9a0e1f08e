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


@pytest.mark.parametrize("policy", [None, BF16], ids=["fp32", "bf16"])
def test_hsdp_at_2x2_is_torchs_bits_over_adamw_steps(rank_pools, policy):
    """Prefetch on (the default), one step of two micro-steps without gradient sync between:
    the parameters after every step are torch's, on every rank; and each rank sends, per step,
    two gathers and a reduce-scatter inside its shard pair, 3(S-1)/S of the padded model,
    then the all-reduce of its 1/S shard over its replica pair, 2(R-1)/R of that."""
    spec = FsdpSpec(steps=3)
    kinds = ("ours", "torch") if policy else ("ours", "torch", "ddp")
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
            assert result["sent"] == [(3 * SHARD + SHARD) * 4 + labels] * spec.steps
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
