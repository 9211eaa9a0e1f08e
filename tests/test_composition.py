"""DP x TP x PP on one mesh, each combination against one process over 3 AdamW steps.

Every combination a real loop uses, on one small model in float64 (tests/composition_tasks.py):
DP x TP and FSDP x TP on 4 ranks, TP x PP on 4, DP x PP on 4, and all three on 8, built on
`miniddp.mesh.init_device_mesh` in the order torchtitan applies them (TP, the pipeline split,
then DP or FSDP). Not bitwise: the replicas' means and the microbatches' shares add the same
numbers in another order than one process's mean over the global batch; in float64 that moves
the last bits only, 1e-12 after three AdamW steps.

And the composition that must not run: a data-parallel wrapper over the ranks of one TP group
would average (or overwrite with rank 0's) different shards of one tensor. Torch's DDP refuses
it; so do MiniDDP, fully_shard and ZeroRedundancyOptimizer, on every rank, shards untouched.
"""

from __future__ import annotations

import pytest

from tests import composition_tasks as tasks
from tests.harness.measurements import record_max

COMBINATIONS = {  # name: ((pp, dp, tp), data parallelism)
    "dp x tp": ((1, 2, 2), "ddp"),
    "fsdp x tp": ((1, 2, 2), "fsdp"),
    "tp x pp": ((2, 1, 2), "ddp"),
    "dp x pp": ((2, 2, 1), "ddp"),
    "dp x tp x pp": ((2, 2, 2), "ddp"),
    "fsdp x tp x pp": ((2, 2, 2), "fsdp"),
}
# With `pytest -m slow`: each pair is also inside a triple here, or in test_parallelize.py's GPT.
SLOW = {"tp x pp", "fsdp x tp x pp", "dp x tp x pp"}  # 3-D by default: test_parallelize.py
NAMES = [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in COMBINATIONS]


@pytest.mark.parametrize("name", NAMES)
def test_every_combination_trains_as_one_process(rank_pools, name):
    shape, data_parallel = COMBINATIONS[name]
    world = shape[0] * shape[1] * shape[2]
    results = rank_pools(world).run(tasks.train_composed, shape, data_parallel)
    reference = tasks.one_process(replicas=shape[1])
    seen = set()
    for rank, full in enumerate(results):
        for tensor_name, tensor in full.items():
            difference = (tensor - reference[tensor_name]).abs().max().item()
            record_max(f"{name}: |param - one process's|", difference)
            assert difference < 1e-12, f"rank {rank}'s {tensor_name} is off by {difference:.3g}"
            seen.add(tensor_name)
    assert seen == set(reference), "some rank holds every parameter once"


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp", "zero"])
def test_a_data_parallel_wrapper_over_the_tensor_parallel_group_is_refused(pool2, wrapper):
    for rank, result in enumerate(
        pool2.run(tasks.wrap_tensor_parallel_model_over_its_own_group, wrapper)
    ):
        assert "tensor-parallel shard" in result["message"], f"rank {rank}: {result['message']}"
        assert 'mesh["dp"].get_group()' in result["message"]
        assert result["untouched"], f"rank {rank}'s shards were overwritten"
