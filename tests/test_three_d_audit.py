"""Chapter 16's audit, byte by byte: on every rank of every way to cut chapter 12's GPT over 4
ranks (six) and over 8 (eight, under -m slow), what `parallelize` holds and sends is what
miniddp/parallelize_formulas.py says.

    held    the parameter elements of the rank's stage and TP shard; its bytes of weights,
            gradients, MiniDDP's bucket, Adam's moments and step counts, from the storages
            (sharding.measure_memory), in fp32 and in bf16 on fp32 masters
    saved   the activations autograd holds at 1F1B's peak, per microbatch times the
            microbatches in flight, min(m, p - s) (every layout with TP)
    sent    every all-reduce and every send, by axis, count, size and dtype

Chapter 16 checks its (2, 2, 2) and DP alone, chapter 16b prices all eight layouts of 8 ranks
with the same traffic_formula; this test checks the formulas on every layout, so that each price
rests on counted messages. The 4-rank layouts exercise every term (each axis alone and two at
once, a pipeline of 4 whose tie is a pair of its ranks) in a few seconds, on the 4-rank pool the
default suite already runs; 8 ranks take about 20 s more (their first AdamW step imports
torch._dynamo in 8 processes). The second step is measured: the first also sends shapes and
orders.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from miniddp import MixedPrecision
from miniddp.instruments.figures.three_d import CONFIG
from miniddp.models.gpt_activations import block_bytes
from miniddp.parallelize_formulas import (
    MeshLayout,
    activation_formula,
    every_layout,
    memory_formula,
    messages,
    stage_elements,
    traffic_formula,
)
from tests import three_d_audit_tasks as tasks

FOUR = {layout.shape: layout for layout in every_layout(4, CONFIG, tasks.WINDOWS)}
EIGHT = {layout.shape: layout for layout in every_layout(8, CONFIG, tasks.WINDOWS)}
LAYOUTS = [
    *(pytest.param(4, shape, id=f"4 ranks {shape}") for shape in FOUR),
    *(pytest.param(8, shape, id=f"8 ranks {shape}", marks=pytest.mark.slow) for shape in EIGHT),
]
THREE_D, DP_ONLY = (2, 2, 2), (1, 8, 1)


def run_layouts(rank_pools, world: int, shapes: list[tuple]) -> dict[tuple, list[dict]]:
    per_rank = rank_pools(world).run(tasks.audit, shapes, timeout=240)
    return {shape: [rank[shape] for rank in per_rank] for shape in shapes}


@pytest.fixture(scope="module")
def four_ranks(rank_pools) -> dict[tuple, list[dict]]:
    """{(pp, dp, tp): every rank's measurements}, all six layouts of 4 ranks in one pool run."""
    return run_layouts(rank_pools, 4, list(FOUR))


@pytest.fixture(scope="module")
def eight_ranks(rank_pools) -> dict[tuple, list[dict]]:
    return run_layouts(rank_pools, 8, list(EIGHT))


def measured(request: pytest.FixtureRequest, world: int, shape: tuple) -> list[dict]:
    """Every rank's measurements of `shape`, from the pool run of its world size."""
    return request.getfixturevalue("four_ranks" if world == 4 else "eight_ranks")[shape]


def test_the_eight_layouts_of_eight_ranks():
    """tp divides the 4 heads, pp the 4 blocks: 8 = pp·dp·tp eight ways."""
    expected = {(p, 8 // (p * t), t) for p in (1, 2, 4) for t in (1, 2, 4) if p * t <= 8}
    assert set(EIGHT) == expected and len(EIGHT) == 8


@pytest.mark.parametrize("world, shape", LAYOUTS)
def test_every_rank_holds_what_the_formulas_say(request, world, shape):
    layout = (FOUR if world == 4 else EIGHT)[shape]
    for rank, got in enumerate(measured(request, world, shape)):
        stage, where = got["stage"], f"{shape}, rank {rank}, stage {got['stage']}"
        assert got["elements"] == stage_elements(CONFIG, layout, stage), where
        assert got["memory"] == memory_formula(CONFIG, layout, stage), where
        if layout.tp > 1:
            per_microbatch, held = activation_formula(CONFIG, layout, stage)
            assert (got["activations"], got["held"]) == (per_microbatch * held, held), where


@pytest.mark.parametrize("world, shape", LAYOUTS)
def test_every_rank_sends_what_the_formulas_say(request, world, shape):
    layout = (FOUR if world == 4 else EIGHT)[shape]
    for rank, got in enumerate(measured(request, world, shape)):
        where = f"{shape}, rank {rank}, stage {got['stage']}"
        assert got["sent"] == messages(traffic_formula(CONFIG, layout, got["stage"])), where


@pytest.mark.parametrize(
    "world, shape",
    [(4, (1, 2, 2)), pytest.param(8, THREE_D, marks=pytest.mark.slow)],
    ids=["4 ranks (1, 2, 2)", "8 ranks (2, 2, 2)"],
)
def test_bf16_holds_fp32_s_bytes_and_a_bf16_copy(rank_pools, world, shape):
    """bf16 on fp32 masters: the fp32 formula plus 2 bytes of copy an element; outside forward
    the parameters are their fp32 masters."""
    layout = (FOUR if world == 4 else EIGHT)[shape]
    policy = MixedPrecision(param_dtype=torch.bfloat16)
    for rank, result in enumerate(rank_pools(world).run(tasks.audit, [shape], "bf16")):
        got = result[shape]
        assert got["memory"] == memory_formula(CONFIG, layout, got["stage"], policy), rank
        assert got["masters"] == {torch.float32} and got["copies"] == {torch.bfloat16}, rank


def test_the_formulas_refuse_what_they_do_not_count():
    """Each says what it was checked for, at once: no silent wrong number outside it."""
    with pytest.raises(ValueError, match="tp > 1"):
        activation_formula(CONFIG, EIGHT[DP_ONLY], 0)
    with pytest.raises(ValueError, match="dropout 0 without checkpointing"):
        block_bytes(replace(CONFIG, dropout=0.1), 2, tp=2)
    with pytest.raises(ValueError, match="do not split over dp=3"):
        MeshLayout.of(1, 3, 1, windows=8, context=16)


def test_one_tp_rank_s_block_is_the_whole_block_at_t_1():
    """block_bytes on one of t ranks: 4N(4H + 4) kept whole, 4N(12H + a)/t split; at t = 1 the
    two parts add to the whole block's 16e·sbh + 4·abs + 4e·sb."""
    n, h, a = 2 * CONFIG.context, CONFIG.width, CONFIG.heads
    whole, split = 4 * n * (4 * h + 4), 4 * n * (12 * h + a)
    assert block_bytes(CONFIG, 2, tp=2) == whole + split // 2
    assert whole + split == block_bytes(CONFIG, 2)
