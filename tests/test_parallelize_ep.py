"""`parallelize(gpt, mesh)` with an "ep" axis, ("pp", "dp", "ep", "tp"): the GPT's experts split
over ep, composed with every other parallelism, train as one process does.

Every (dp, ep) coordinate is a replica with its own windows; each MoE's experts are cut over
ep, its aux loss is the whole batch's (its statistics summed over every replica), the experts'
gradients are summed over dp and divided by dp x ep, everything else is averaged over dp x ep
(miniddp/parallelize_experts.py). The spec, against one process on the global batch, chapter
12's GPT (tiny, dropout 0) with 4 experts, top-2, in its second block, aux_loss_coef 0.1:
- float64: every step's loss (the replicas' mean), clip_grad_norm_'s norm (each expert counted
  once, on its own axis) and every parameter after 3 AdamW steps, on every rank, within 1e-12
  (the same sums in other orders);
- ep alone, dp x ep (MiniDDP with two train_step calls a step, and fully_shard), ep x tp, pp x
  ep (1F1B: each microbatch's aux loss in the backward through the stages), and a checkpoint
  saved at ep = 2, resumed at ep = 1;
- bf16 on fp32 masters, under MiniDDP and fully_shard: fp32 masters, within bf16's tolerances;
- what it refuses, on every rank.

A planted bug fails these: the experts averaged over dp alone (ep times one process's), or
over dp x ep; the aux loss per rank (its statistics not summed over the replicas); its gradient
not scaled by the replicas.
"""

from __future__ import annotations

import functools

import pytest

from tests import parallelize_ep_tasks as tasks
from tests.harness.measurements import record_max
from tests.parallelize_ep_tasks import Scenario
from tests.parallelize_tasks import pooled_runs

FP64_TOLERANCE = 1e-12
BF16_LOSS, BF16_PARAMETER, BF16_NORM = 5e-3, 2 * tasks.LR * tasks.STEPS, 2e-2
TWO_RANKS = [Scenario((1, 1, 2, 1)), Scenario((1, 1, 2, 1), "fsdp")]
FOUR_RANKS = [  # the first saves a checkpoint at ep = 2 and resumes at (1, 4, 1, 1)
    Scenario((1, 2, 2, 1), accumulate=2),
    Scenario((1, 2, 2, 1), "fsdp"),
    Scenario((1, 1, 2, 2)),
    Scenario((2, 1, 2, 1)),
    Scenario((1, 2, 2, 1), "fsdp", precision="bf16"),
    Scenario((1, 2, 2, 1), precision="bf16"),
]
SCENARIOS = TWO_RANKS + FOUR_RANKS
RESUME_AT = (1, 4, 1, 1)


@pytest.fixture(scope="module")
def runs(rank_pools, tmp_path_factory):
    """`runs(scenario)`: every rank's result; each world size's scenarios in one pool run."""
    path = str(tmp_path_factory.mktemp("ep") / "checkpoint.pt")
    groups = [TWO_RANKS, FOUR_RANKS]
    run = tasks.run_scenarios
    return pooled_runs(rank_pools, groups, run, FOUR_RANKS, path, RESUME_AT, timeout=300)


@functools.cache
def one_process(scenario: Scenario) -> dict:
    return tasks.one_process(scenario, "fp64" if scenario.precision == "fp64" else "fp32")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_an_ep_mesh_trains_as_one_process(runs, scenario):
    results, reference = runs(scenario), one_process(scenario)
    exact = scenario.precision == "fp64"
    loss_tolerance = FP64_TOLERANCE if exact else BF16_LOSS
    last_stage = [r["losses"] for r in results if r["losses"][0] is not None]
    replicas = len(last_stage) // scenario.shape[3]  # tp ranks report the same loss
    for batch, expected in enumerate(reference["losses"]):
        mean = sum(losses[batch] for losses in last_stage) / len(last_stage)
        assert mean == pytest.approx(expected, abs=loss_tolerance, rel=0)
    assert replicas == scenario.replicas
    every_replica = [(index, scenario.replicas) for index in range(scenario.replicas)]
    held = sorted(r["replica"] for r in results[:: scenario.shape[3]])  # tp innermost
    assert held == sorted(every_replica * scenario.shape[0])
    for result in results:
        assert result["dtypes"] == (["torch.float64"] if exact else ["torch.float32"])
        norm_tolerance = FP64_TOLERANCE if exact else BF16_NORM * max(reference["norms"])
        for norm, expected in zip(result["norms"], reference["norms"]):
            assert norm == pytest.approx(expected, abs=norm_tolerance, rel=0)
        for name, value in result["params"].items():
            expected = reference["params"]["token.weight" if name == "head.weight" else name]
            error = (value - expected).abs().max().item()
            record_max(f"ep {scenario.name}", error)
            assert error <= (FP64_TOLERANCE if exact else BF16_PARAMETER), name


def test_a_checkpoint_saved_at_ep_2_resumes_at_ep_1(runs):
    """Saved from (1, 2, 2, 1), loaded into (1, 4, 1, 1): the full experts in the file, cut
    again (here: not at all); the step taken there is the step taken at ep = 2."""
    for result in runs(FOUR_RANKS[0]):
        for name, value in result["resumed"].items():
            assert (value - result["params"][name]).abs().max().item() <= FP64_TOLERANCE, name


@pytest.mark.parametrize(
    "what, expected",
    [
        ("experts", "3 experts cannot be split evenly over ep = 2"),
        ("dense", "has no experts to split"),
    ],
)
def test_what_it_cannot_split_is_refused_on_every_rank(pool2, what, expected):
    for said in pool2.run(tasks.refusal, what, timeout=60):
        assert expected in said


def test_each_ep_rank_holds_its_share_of_the_experts(pool2):
    assert pool2.run(tasks.experts_held, timeout=60) == [[2], [2]]
