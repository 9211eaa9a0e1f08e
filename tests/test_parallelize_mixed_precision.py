"""`parallelize(gpt, mesh, mixed_precision=MixedPrecision(torch.bfloat16))`: bf16 compute on fp32
masters, composed with TP and PP, under MiniDDP, fully_shard, or no data parallelism (dp = 1).

The spec, on 4 ranks (8 under -m slow):
- fp32 masters outside forward and backward, bf16 inside, bf16 activations across the stages,
  the loss in fp32; every gradient the optimizer, clip_grad_norm_ and a checkpoint see is fp32.
- Without TP, a stage computes exactly what one process computes with the same mixed precision
  (tests/parallelize_mixed_precision_tasks.py writes it out), so DP x PP trains bit for bit as
  it does, under MiniDDP and fully_shard alike: the losses and the parameters after 3 AdamW
  steps (the norm, clip_grad_norm_'s, to 1e-6: the stages add their squares apart).
- With TP a rank computes a slice, and the partial products are summed in bf16 (the all-reduce
  of Megatron's g, parallelize.py's docstring): within the tolerances below of one process. But
  MiniDDP and fully_shard over the same TP slices compute the same bits: their sums over 2
  replicas have two terms, which gloo adds in either order alike.
- bf16 trains as fp32 does, within BF16_LOSS_TOLERANCE a step.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests import parallelize_mixed_precision_tasks as tasks
from tests.harness.measurements import record_max
from tests.parallelize_mixed_precision_tasks import Scenario

# Tolerances against one process with the same mixed precision, {bitwise: ...}: without TP
# every bit (the loss, the parameters), but clip_grad_norm_'s norm, whose squares each stage
# sums apart before the stages' sums are added (one fp32 rounding of the order, 2^-24 each).
# With TP, each partial product is rounded to bf16 before the sum (2^-9 relative, on every
# one of Megatron's g), and the gradients differ by about that: NORM_TOLERANCE. AdamW's first
# steps then move each parameter by about lr, by the sign of its gradient, so a gradient near
# zero that rounds to the other sign moves its parameter 2 lr the other way, each step: the
# parameters are only held to 2 lr a step (their updates' scale), the loss to its measure.
NORM_TOLERANCE = {True: 1e-6, False: 1e-2}
LOSS_TOLERANCE = {True: 0.0, False: 2e-3}
PARAMETER_TOLERANCE = {True: 0.0, False: 2 * tasks.LR * tasks.STEPS}
# What bf16 changes in the loss against fp32, per step: its logits round to 8 bits (2^-9
# relative), at most about 5e-3 at a loss near 2.77; measured 7e-4.
BF16_LOSS_TOLERANCE = 5e-3
FOUR_RANKS = [  # the first saves and loads a checkpoint
    Scenario((2, 1, 2)),  # TP x PP, no data parallelism: ComputeInCopies casts
    Scenario((2, 2, 1)),
    Scenario((2, 2, 1), "fsdp"),
    Scenario((1, 2, 2)),
    Scenario((1, 2, 2), "fsdp"),
]
EIGHT_RANKS = [Scenario((2, 2, 2)), Scenario((2, 2, 2), "fsdp")]  # under -m slow
BITWISE = {s for s in FOUR_RANKS + EIGHT_RANKS if s.shape[2] == 1}  # no TP: one process's bits
SCENARIOS = FOUR_RANKS + [pytest.param(s, marks=pytest.mark.slow) for s in EIGHT_RANKS]
SAME_BITS = [  # pairs that compute the same bits: DP's wrapper aside, the same slices and sums
    (Scenario((2, 2, 1)), Scenario((2, 2, 1), "fsdp")),
    (Scenario((1, 2, 2)), Scenario((1, 2, 2), "fsdp")),
    pytest.param((Scenario((2, 2, 2)), Scenario((2, 2, 2), "fsdp")), marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def four_ranks(rank_pools, tmp_path_factory) -> dict[Scenario, dict]:
    """Every 4-rank scenario in one pool run: {scenario: every rank's result}."""
    path = str(tmp_path_factory.mktemp("mp") / "checkpoint.pt")
    per_rank = rank_pools(4).run(tasks.run_scenarios, FOUR_RANKS, path)
    return {s: [rank[i] for rank in per_rank] for i, s in enumerate(FOUR_RANKS)}


@pytest.fixture(scope="module")
def eight_ranks(rank_pools) -> dict[Scenario, dict]:
    per_rank = rank_pools(8).run(tasks.run_scenarios, EIGHT_RANKS, timeout=240)
    return {s: [rank[i] for rank in per_rank] for i, s in enumerate(EIGHT_RANKS)}


def results_of(request: pytest.FixtureRequest, scenario: Scenario) -> list[dict]:
    """Every rank's result for `scenario`, from the pool run of its size (8: only under -m slow)."""
    pools = "eight_ranks" if scenario in EIGHT_RANKS else "four_ranks"
    return request.getfixturevalue(pools)[scenario]


@functools.cache
def one_process(shape: tuple[int, int, int], precision: str) -> dict:
    """One process, for a mesh of this shape, in bf16 or fp32 (computed once)."""
    return tasks.one_process(shape, precision)


def check_dtypes(results: list[dict], scenario: Scenario) -> None:
    pp = scenario.shape[0]
    for rank, result in enumerate(results):
        dtypes = result["dtypes"]
        where = f"{scenario.name}, rank {rank}"
        assert dtypes["outside"] == ["grad torch.float32", "norm torch.float32", "torch.float32"], (
            f"{where}: outside forward and backward {dtypes['outside']}, not fp32 masters"
        )
        assert dtypes["inside"] == ["torch.bfloat16"], f"{where}: inside {dtypes['inside']}"
        assert dtypes["crossing"] == (["torch.bfloat16"] if pp > 1 else []), (
            f"{where}: the activations between stages are {dtypes['crossing']}, not bf16"
        )
        last = pp == 1 or rank >= len(results) // pp * (pp - 1)
        assert dtypes["loss"] == (["torch.float32"] if last else []), f"{where}: the loss"
        assert all(t.dtype == torch.float32 for t in result["params"].values()), where


def last_stage(results: list[dict]) -> list[dict]:
    """The ranks that report a loss: the last stage's, one a replica and TP shard."""
    return [r for r in results if r["losses"][0] is not None]


def largest_gap(result: dict, reference: dict) -> float:
    gaps = [
        (tensor - reference["params"]["token.weight" if name == "head.weight" else name])
        .abs()
        .max()
        .item()
        for name, tensor in result["params"].items()
    ]
    return max(gaps)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_fp32_masters_outside_bf16_inside_and_between_stages(request, scenario):
    check_dtypes(results_of(request, scenario), scenario)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_training_in_bf16_is_one_process_s_with_the_same_mixed_precision(request, scenario):
    results = results_of(request, scenario)
    reference, fp32 = (one_process(scenario.shape, p) for p in ("bf16", "fp32"))
    dp, tp = scenario.shape[1], scenario.shape[2]
    bitwise = scenario in BITWISE
    assert len(last_stage(results)) == dp * tp
    for rank, result in enumerate(results):
        for step, (loss, norm) in enumerate(zip(result["losses"], result["norms"])):
            expected = reference["norms"][step]
            record_max(
                f"parallelize {scenario.name}: norm / one bf16 process's - 1",
                abs(norm / expected - 1),
            )
            assert norm == pytest.approx(expected, rel=NORM_TOLERANCE[bitwise]), f"step {step}"
            if loss is None:
                continue
            expected = reference["losses"][step][rank // tp % dp]
            in_fp32 = fp32["losses"][step][rank // tp % dp]
            record_max(
                f"parallelize {scenario.name}: |loss - one bf16 process's|", abs(loss - expected)
            )
            record_max(
                f"parallelize {scenario.name}: |loss - one fp32 process's|", abs(loss - in_fp32)
            )
            assert loss == pytest.approx(expected, abs=LOSS_TOLERANCE[bitwise]), f"step {step}"
            assert loss == pytest.approx(in_fp32, abs=BF16_LOSS_TOLERANCE), f"step {step}"
        gap = largest_gap(result, reference)
        record_max(f"parallelize {scenario.name}: |param - one bf16 process's|", gap)
        assert gap <= PARAMETER_TOLERANCE[bitwise], f"rank {rank}'s parameters: {gap:.3g} away"


@pytest.mark.parametrize("pair", SAME_BITS, ids=lambda pair: f"{pair[0].shape}")
def test_minddp_and_fully_shard_compute_the_same_bits(request, pair):
    ddp, fsdp = (results_of(request, s) for s in pair)
    for rank, (a, b) in enumerate(zip(ddp, fsdp, strict=True)):
        assert a["losses"] == b["losses"], f"rank {rank}'s losses"
        # clip_grad_norm_ adds fully_shard's flat pieces in another order than whole tensors
        assert a["norms"] == pytest.approx(b["norms"], rel=1e-6), f"rank {rank}'s norms"
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), f"rank {rank}'s {name}"


def test_a_checkpoint_holds_the_fp32_masters(four_ranks):
    for rank, result in enumerate(four_ranks[FOUR_RANKS[0]]):
        loaded = result["loaded"]
        assert loaded["file"] == ["torch.float32"], f"rank {rank}: the file holds {loaded}"
        assert loaded["same"] and loaded["same_moments"], f"rank {rank}: loaded {loaded}"
