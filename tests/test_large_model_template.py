"""Chapter 16d's template (torch's init_device_mesh, parallelize_module, fully_shard,
loss_parallel, and its clip_grad_norm_) and `miniddp.parallelize` (MiniDDP's TP, fully_shard and
clip) train chapter 12's GPT on the same (dp, tp) mesh, from the same weights on the same windows,
in float64: the same loss on every rank at every step, and the same parameters after the last.

Bit for bit where the pieces compute the same sums in the same order: FSDP alone, (2, 1), whose
reduce-scatter is torch's (tests/test_sharding_fsdp.py), while clipping is idle. Within rounding
elsewhere, for two reasons, each named here so that it can be checked:
- clipping, when it acts: both find the same global norm but round it otherwise (torch's DTensor
  takes each rank's norm, raises it to the p-th power and sums over the mesh; miniddp.sharding
  sums the p-th powers by category), and the factor max_norm / norm scales every gradient;
- under TP, torch's RowwiseParallel adds the bias inside the partial sums (DTensor turns the
  replicated bias into a Partial one, b / tp on each rank, before the all-reduce: (p0 + b/2) +
  (p1 + b/2)), where Megatron and MiniDDP add it once after: (p0 + p1) + b. The first step's
  gradients, whose biases are still 0, are bitwise (loss_parallel's included,
  tests/test_tensor_parallel.py).
Measured over 4 steps: the parameters at most 2.7e-15 apart (qkv's bias among the largest: the
keys' bias barely moves the softmax, so its gradient and AdamW's v are tiny, and m / sqrt(v)
magnifies the last bits). TOLERANCE is 1e-12, float64's rounding after a few steps,
as tests/test_parallelize.py allows against one process; a wrong plan, order or tie is off by
1e-3 and more at once."""

from __future__ import annotations

import math

import pytest

from tests import large_model_template_tasks as tasks
from tests.harness.measurements import record_max

CLIP = 0.1  # below the tiny GPT's gradient norms on every mesh: clipping acts at every step
CASES = {  # name: ((dp, tp), max_norm)
    "(dp, tp) = (2, 2)": ((2, 2), CLIP),
    "TP alone (1, 2)": ((1, 2), CLIP),
    "FSDP2 alone (2, 1)": ((2, 1), CLIP),
    "FSDP2 alone, clipping idle": ((2, 1), math.inf),
}
BITWISE = {"FSDP2 alone, clipping idle"}
TOLERANCE = 1e-12


@pytest.mark.parametrize("name", CASES)
def test_the_template_trains_as_miniddp_parallelize(rank_pools, name):
    shape, max_norm = CASES[name]
    tolerance = 0.0 if name in BITWISE else TOLERANCE
    results = rank_pools(shape[0] * shape[1]).run(tasks.train_both, shape, max_norm)
    for rank, result in enumerate(results):
        theirs, ours = result["losses"]["torch"], result["losses"]["miniddp"]
        for step, (a, b) in enumerate(zip(theirs, ours, strict=True)):
            assert abs(a - b) <= tolerance, f"rank {rank}, step {step}: torch {a!r}, ours {b!r}"
        params = result["params"]
        assert params["torch"].keys() == params["miniddp"].keys()
        for tensor_name, tensor in params["torch"].items():
            difference = (tensor - params["miniddp"][tensor_name]).abs().max().item()
            record_max(f"16d template {name}: |param - miniddp.parallelize's|", difference)
            assert difference <= tolerance, f"rank {rank}'s {tensor_name}: off by {difference}"
