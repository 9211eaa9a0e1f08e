"""`miniddp.parallelize.parallelize`: chapter 12's GPT (dropout off, float64) over a (pp, dp, tp)
mesh trains as one process on the global batch: every step's loss, and every parameter after 3
AdamW steps, within rounding, on every rank that holds it. The tied embedding included: one
shard under TP, two copies summed under PP (the last stage's head), and every copy equal."""

from __future__ import annotations

import pytest
import torch

from miniddp import MixedPrecision
from miniddp.parallelize import parallelize
from tests import parallelize_tasks as tasks
from tests.harness.measurements import record_max

MESHES = {  # name: ((pp, dp, tp), data parallelism)
    "dp x tp x pp": ((2, 2, 2), "ddp"),
    "fsdp x tp": ((1, 2, 2), "fsdp"),
    "tp x pp": ((2, 1, 2), "ddp"),
    "dp x pp": ((2, 2, 1), "ddp"),
}
# With `pytest -m slow`: the same pieces compose on a small model in test_composition.py.
IN_THE_DEFAULT_SUITE = {"dp x tp x pp"}
NAMES = [
    n if n in IN_THE_DEFAULT_SUITE else pytest.param(n, marks=pytest.mark.slow) for n in MESHES
]


@pytest.mark.parametrize("name", NAMES)
def test_the_parallel_gpt_trains_as_one_process(rank_pools, name):
    shape, data_parallel = MESHES[name]
    world = shape[0] * shape[1] * shape[2]
    results = rank_pools(world).run(tasks.train_parallel, shape, data_parallel)
    losses, reference = tasks.one_process(replicas=shape[1])
    last_stage = [r["losses"] for r in results if r["losses"][0] is not None]
    assert len(last_stage) == world // shape[0]  # the last stage's ranks report the loss
    for step, expected in enumerate(losses):
        mean = sum(ranks[step] for ranks in last_stage) / len(last_stage)  # over the replicas
        assert mean == pytest.approx(expected, abs=1e-12), f"step {step}"
    for rank, result in enumerate(results):
        for tensor_name, tensor in result["params"].items():
            expected = reference["token.weight" if tensor_name == "head.weight" else tensor_name]
            difference = (tensor - expected).abs().max().item()
            record_max(f"parallelize {name}: |param - one process's|", difference)
            assert difference < 1e-12, f"rank {rank}'s {tensor_name} is off by {difference:.3g}"


@pytest.mark.parametrize(
    "mistake, words",
    [
        ("heads", "ValueError: the GPT's 3 heads do not split over tp = 2"),
        ("window", "ValueError: a window of 9 tokens is longer than the model's context 8"),
    ],
)
def test_a_model_or_window_that_cannot_split_is_refused_on_every_rank(pool2, mistake, words):
    """Heads that tp does not divide were accepted, and the first forward failed in a reshape;
    a window longer than the context failed in the position embedding (IndexError) on the
    first stage, the second waiting for it. Both named at once, on every rank, as one
    process's GPT names the second."""
    for rank, said in enumerate(pool2.run(tasks.what_parallelize_says, mistake)):
        assert said.startswith(words), (rank, said)


def test_float16_is_refused_because_train_step_cannot_scale_its_loss():
    """MixedPrecision takes float16 with a loss scaler the caller drives; train_step runs its
    own backward, so no scaler could scale it (an argument check: no process group needed)."""
    with pytest.raises(ValueError, match="loss scaler") as refused:
        parallelize(tasks.build_gpt(), None, mixed_precision=MixedPrecision(torch.float16))
    assert "MixedPrecision(torch.bfloat16)" in str(refused.value)
