"""Pipeline parallelism (miniddp/pipeline/): GPipe and 1F1B against one process and against
torch's own torch.distributed.pipelining, on gloo, at 2 and 4 stages.

The bar is BITWISE, for every stage's gradients after every step, every microbatch's loss and
the parameters after several SGD steps, because the operations are the same ones in the same
order: each stage runs its slice's kernels on the same microbatch; the gradient that crosses a
stage's border is the one autograd computes there in one process; `.grad` accumulates the
microbatches in the order 0 .. m-1 in both schedules; and each microbatch's LOSS is divided by
m, as in the reference below (and in torch's schedules given loss / m and scale_grads=False).
Torch's default, dividing `.grad` by m at the end of the step, differs by rounding when m is
not a power of two (test_dividing_the_sum...), and sums wrongly across steps (test_accumulat...).

Your own schedule goes through the same checks (tutorials/exercises/gpipe.py):

    MINIDDP_PP_SCHEDULE=tutorials/exercises/gpipe.py:ScheduleGPipe \\
        python -m pytest tests/test_pipeline.py -x -q

runs every schedule-agnostic test on your class in place of miniddp's two.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from miniddp.observe.events import Recorder
from miniddp.pipeline import Action, PipelineStage, Schedule1F1B, ScheduleGPipe
from miniddp.pipeline.bubble import (
    blocks_of,
    bubble_formula,
    bubble_fraction,
    peak_held,
    replay,
)
from tests.harness.measurements import record_max
from tests.harness.pool import RankError
from tests.workloads import load_implementation

REPO = Path(__file__).resolve().parents[1]
LEARNERS = os.environ.get("MINIDDP_PP_SCHEDULE")
OURS = {"gpipe": "miniddp.pipeline:ScheduleGPipe", "1f1b": "miniddp.pipeline:Schedule1F1B"}
SCHEDULES = {"yours": LEARNERS} if LEARNERS else OURS
ours_only = pytest.mark.skipif(bool(LEARNERS), reason="checks miniddp's own schedules")
STUB = f"{REPO / 'tutorials' / 'exercises' / 'gpipe.py'}:ScheduleGPipe"


@dataclass(frozen=True)
class PipeSpec:
    """A p-stage MLP, block s = Linear(widths[s], widths[s+1]) + Tanh, trained with SGD."""

    widths: tuple[int, ...] = (6, 5, 3)  # p + 1 widths: every border has its own shape
    n_microbatches: int = 2
    microbatch: int = 2  # samples per microbatch
    steps: int = 3
    seed: int = 0
    lr: float = 0.1

    @property
    def stages(self) -> int:
        return len(self.widths) - 1


def build_model(spec: PipeSpec) -> nn.Sequential:
    torch.manual_seed(spec.seed)
    blocks = [
        nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(spec.widths, spec.widths[1:])
    ]
    return nn.Sequential(*blocks)


def batch(spec: PipeSpec, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * spec.seed + step)
    size = spec.n_microbatches * spec.microbatch
    x = torch.randn(size, spec.widths[0], generator=generator)
    return x, torch.randn(size, spec.widths[-1], generator=generator)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def mean_share(output: torch.Tensor, target: torch.Tensor, m: int) -> torch.Tensor:
    """What torch's schedules are given: each microbatch's share of the mean loss. They then
    report loss / m where ours report the loss (train_stage multiplies theirs back)."""
    return mse(output, target) / m


def one_process(spec: PipeSpec, divide_at_end: bool = False) -> dict:
    """The reference: one process, the whole model, the same microbatches accumulated in order,
    each loss divided by m (or, with `divide_at_end`, `.grad` divided by m after them)."""
    model = build_model(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr)
    m = spec.n_microbatches
    grads, losses = [], []
    for step in range(spec.steps):
        x, y = batch(spec, step)
        step_losses = []
        for xm, ym in zip(x.tensor_split(m), y.tensor_split(m)):
            loss = mse(model(xm), ym)
            (loss if divide_at_end else loss / m).backward()
            step_losses.append(loss.detach())
        if divide_at_end:
            for param in model.parameters():
                param.grad.div_(m)
        grads.append([[p.grad.clone() for p in block.parameters()] for block in model])
        losses.append(step_losses)
        optimizer.step()
        optimizer.zero_grad()
    params = [[p.detach().clone() for p in block.parameters()] for block in model]
    return {"grads": grads, "losses": losses, "params": params}


def make_schedule(kind: str, stage, m: int):
    """ "torch-gpipe" / "torch-1f1b": torch's own; otherwise "module:Class" or "file.py:Class"."""
    if kind.startswith("torch-"):
        from torch.distributed.pipelining import PipelineStage as TorchStage
        from torch.distributed.pipelining import Schedule1F1B as Torch1F1B
        from torch.distributed.pipelining import ScheduleGPipe as TorchGPipe

        torch_stage = TorchStage(stage.submodule, stage.stage_index, stage.num_stages, "cpu")
        cls = TorchGPipe if kind == "torch-gpipe" else Torch1F1B
        return cls(torch_stage, m, loss_fn=partial(mean_share, m=m), scale_grads=False)
    return load_implementation(kind)(stage, m, mse)


def train_stage(spec: PipeSpec, kind: str, with_example: bool = False) -> dict:
    """On every rank of the pool: this rank's stage of `spec`'s model, trained with schedule
    `kind`; its gradients and losses per step, its parameters at the end, and what it held.
    `with_example`: every stage but the first is given an example of its input microbatch."""
    rank = dist.get_rank()
    block = build_model(spec)[rank]
    example = torch.empty(spec.microbatch, spec.widths[rank]) if with_example and rank else None
    stage = PipelineStage(block, rank, spec.stages, "cpu", input_args=example)
    schedule = make_schedule(kind, stage, spec.n_microbatches)
    recording = not kind.startswith("torch-")
    if recording:
        recorder = schedule.observer = Recorder()
    optimizer = torch.optim.SGD(block.parameters(), lr=spec.lr)
    grads, losses, peaks = [], [], []
    for step in range(spec.steps):
        x, y = batch(spec, step)
        step_losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == spec.stages - 1:
            schedule.step(target=y, losses=step_losses)
        else:
            schedule.step()
        grads.append([p.grad.clone() for p in block.parameters()])
        losses.append([loss.detach() for loss in step_losses])
        peaks.append(stage.peak_held if recording else None)
        optimizer.step()
        optimizer.zero_grad()
    result = {"grads": grads, "losses": losses, "peaks": peaks}
    result["params"] = [p.detach().clone() for p in block.parameters()]
    if recording:
        blocks = blocks_of(recorder.events, rank)
        result["order"] = [(b.kind, b.microbatch) for b in sorted(blocks, key=lambda b: b.start)]
        result["event_kinds"] = sorted({event.kind for event in recorder.events})
    return result


def assert_stage_equal(result: dict, reference: dict, stage: int, spec: PipeSpec, what: str):
    """Bitwise: every gradient of every step, the parameters at the end, and (on the last
    stage) every microbatch's loss."""
    for step, (ours, theirs) in enumerate(zip(result["grads"], reference["grads"], strict=True)):
        theirs = theirs[stage] if isinstance(theirs[0], list) else theirs
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert torch.equal(a, b), (
                f"{what}: stage {stage}'s gradient {index} differs at step {step} by "
                f"{(a - b).abs().max().item():.3g}"
            )
    params = reference["params"]
    params = params[stage] if isinstance(params[0], list) else params
    for index, (a, b) in enumerate(zip(result["params"], params, strict=True)):
        assert torch.equal(a, b), f"{what}: stage {stage}'s parameter {index} differs at the end"
    if stage == spec.stages - 1:
        for step, (ours, theirs) in enumerate(zip(result["losses"], reference["losses"])):
            assert len(ours) == spec.n_microbatches, f"{what}: losses not filled at step {step}"
            for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
                assert torch.equal(a, b), f"{what}: microbatch {i}'s loss differs at step {step}"


CASES = [  # (widths: p + 1 of them, n_microbatches)
    ((6, 5, 3), 1),
    ((6, 5, 3), 2),
    ((6, 5, 3), 3),
    ((6, 5, 3), 5),
    ((6, 7, 5, 4, 3), 2),
    ((6, 7, 5, 4, 3), 6),
]


@pytest.mark.parametrize("widths, m", CASES, ids=[f"p{len(w) - 1}-m{m}" for w, m in CASES])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_stage_is_bitwise_one_process_and_torchs_pipelining(rank_pools, name, widths, m):
    spec = PipeSpec(widths=widths, n_microbatches=m)
    pool = rank_pools(spec.stages)
    reference = one_process(spec)
    ours = pool.run(train_stage, spec, SCHEDULES[name])
    for stage, result in enumerate(ours):
        assert_stage_equal(result, reference, stage, spec, f"{name} against one process")
    torch_kind = "torch-1f1b" if name == "1f1b" else "torch-gpipe"
    if torch_kind == "torch-1f1b" and m < spec.stages:
        return  # torch's Schedule1F1B refuses m < p; ours runs it as GPipe (next test)
    theirs = pool.run(train_stage, spec, torch_kind)
    for stage, (result, torch_result) in enumerate(zip(ours, theirs)):
        shares = [[loss / m for loss in step] for step in result["losses"]]  # what torch reports
        result = {**result, "losses": shares}
        assert_stage_equal(result, torch_result, stage, spec, f"{name} against {torch_kind}")


def test_an_example_input_replaces_the_shape_exchange(rank_pools):
    """Given input_args, a stage is sent no shape: the same bits as one process either way."""
    spec = PipeSpec(widths=(6, 7, 5, 4, 3), n_microbatches=2, steps=2)
    reference = one_process(spec)
    for stage, result in enumerate(rank_pools(4).run(train_stage, spec, OURS["1f1b"], True)):
        assert_stage_equal(result, reference, stage, spec, "1F1B given input examples")


def test_dividing_the_sum_by_m_instead_differs_only_by_rounding(pool2):
    """Torch's default reference, `.grad` divided by m after the step: g0/3 + g1/3 + g2/3 and
    (g0 + g1 + g2) / 3 round differently in float32, by a few units in the last place (|g| < 1
    here, so 1e-6 absolute is about 10 ulp; measured: see the run's summary)."""
    spec = PipeSpec(n_microbatches=3)
    reference = one_process(spec, divide_at_end=True)
    for stage, result in enumerate(pool2.run(train_stage, spec, SCHEDULES[next(iter(SCHEDULES))])):
        for ours, theirs in zip(result["grads"], reference["grads"]):
            for a, b in zip(ours, theirs[stage]):
                record_max("pipeline: |grad - grad with .grad / m|", (a - b).abs().max())
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def accumulate_two_steps(spec: PipeSpec, kind: str) -> list[torch.Tensor]:
    """Two schedule steps on two batches, no optimizer step between: this stage's .grad."""
    rank = dist.get_rank()
    block = build_model(spec)[rank]
    schedule = make_schedule(
        kind, PipelineStage(block, rank, spec.stages, "cpu"), spec.n_microbatches
    )
    for step in range(2):
        x, y = batch(spec, step)
        if rank == 0:
            schedule.step(x)
        elif rank == spec.stages - 1:
            schedule.step(target=y)
        else:
            schedule.step()
    return [p.grad.clone() for p in block.parameters()]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_accumulating_over_two_steps_sums_their_gradients_as_one_process_does(pool2, name):
    """G1 + G2: each step scales only its own microbatches. (Torch's default scale_grads=True
    divides all of .grad at each step's end, leaving G1/m + G2.)"""
    spec = PipeSpec(n_microbatches=2)
    model = build_model(spec)
    for step in range(2):  # one process, accumulating two batches of m microbatches each
        x, y = batch(spec, step)
        for xm, ym in zip(x.tensor_split(2), y.tensor_split(2)):
            (mse(model(xm), ym) / 2).backward()
    for stage, grads in enumerate(pool2.run(accumulate_two_steps, spec, SCHEDULES[name])):
        for index, (ours, theirs) in enumerate(zip(grads, model[stage].parameters())):
            assert torch.equal(ours, theirs.grad), f"stage {stage}'s gradient {index}"


@ours_only
@pytest.mark.parametrize("m", [2, 8])
def test_gpipe_holds_m_microbatches_and_1f1b_at_most_p_minus_s(rank_pools, m):
    """Peak activations held per stage, counted (not timed): GPipe keeps every microbatch until
    the backwards start; 1F1B frees each by its backward, so stage s holds min(m, p - s)."""
    spec = PipeSpec(widths=(6, 7, 5, 4, 3), n_microbatches=m, steps=1)
    pool = rank_pools(spec.stages)
    gpipe, one_f_one_b = (pool.run(train_stage, spec, OURS[k]) for k in ("gpipe", "1f1b"))
    assert [r["peaks"][0] for r in gpipe] == [m] * spec.stages
    assert [r["peaks"][0] for r in one_f_one_b] == [min(m, spec.stages - s) for s in range(4)]


@ours_only
@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (4, 2), (4, 4), (4, 8), (3, 5)])
def test_both_orders_have_the_bubble_of_the_formula_on_a_logical_clock(p, m):
    """No timing: each F costs 1 and each B 2 on a logical clock (timeline.replay); both
    schedules' orders then leave exactly (p - 1)/(m + p - 1) of the stage-time idle."""
    for schedule in (ScheduleGPipe, Schedule1F1B):
        orders = [schedule.order(_StageShape(s, p, m)) for s in range(p)]
        assert bubble_fraction(replay(orders)) == pytest.approx(bubble_formula(p, m), abs=1e-12)
        held = [peak_held(order) for order in orders]
        expected = [m] * p if schedule is ScheduleGPipe else [min(m, p - s) for s in range(p)]
        assert held == expected, schedule.__name__


def test_the_recorded_order_is_the_schedules_and_replays_to_the_formula(rank_pools):
    """What each stage actually ran (its recorded forward/backward events), replayed on the
    logical clock, has the formula's bubble: the recording shows the schedule, not a serial
    run. A middle stage records sends, receives and idle waits too."""
    spec = PipeSpec(widths=(6, 7, 5, 4, 3), n_microbatches=4, steps=1)
    for name, kind in SCHEDULES.items():
        results = rank_pools(spec.stages).run(train_stage, spec, kind)
        orders = [result["order"] for result in results]
        assert bubble_fraction(replay(orders)) == pytest.approx(bubble_formula(4, 4)), name
        assert {"forward", "backward", "send", "recv", "idle", "step"} <= set(
            results[1]["event_kinds"]
        )


def collectives_counted_in_a_step() -> int:
    """How many collectives MiniDDP's fault seam counted on this rank during one 1F1B step."""
    from miniddp.job.notes import board_of

    rank, spec = dist.get_rank(), PipeSpec(widths=(6, 7, 5, 4, 3), n_microbatches=4)
    stage = PipelineStage(build_model(spec)[rank], rank, spec.stages, "cpu")
    schedule = Schedule1F1B(stage, spec.n_microbatches, mse)
    x, y = batch(spec, 0)
    before = board_of(None).finished
    schedule.step(x) if rank == 0 else schedule.step(target=y) if rank == 3 else schedule.step()
    return board_of(None).finished - before


def test_transfers_are_not_counted_as_collectives(rank_pools):
    """Ranks compare how many collectives each finished, to tell where the others are (and
    cleanup() to tell that all ran the same steps). A middle stage runs twice the transfers of
    an end stage, so only the step's check counts: the same on every stage."""
    assert rank_pools(4).run(collectives_counted_in_a_step) == [2, 2, 2, 2]  # check, orders


class _StageShape:
    """Just what `order()` reads from a schedule, to list orders without any process group."""

    def __init__(self, stage_index: int, num_stages: int, n_microbatches: int) -> None:
        self.n_microbatches = n_microbatches
        self.stage = type("Stage", (), {"stage_index": stage_index, "num_stages": num_stages})


class ForwardTwice(ScheduleGPipe):
    """A learner's slip: microbatch 0's forward listed twice."""

    def order(self) -> list[Action]:
        return [Action("F", 0), *super().order()]


class WaitForEachOther(ScheduleGPipe):
    """Valid orders alone, a deadlock together: stage 0 wants gradient 0 before it sends
    activation 1; the last stage wants activation 1 before it computes gradient 0."""

    def order(self) -> list[Action]:
        if self.stage.is_last:
            return super().order()  # F0 F1 B0 B1
        return [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]


def bad_step(mistake: str) -> None:
    """Two stages, one mistake; every stage must raise the same clear error."""
    rank = dist.get_rank()
    spec = PipeSpec()
    block = build_model(spec)[rank]
    if mistake == "num_stages":
        PipelineStage(block, rank, 3 if rank == 1 else 2, "cpu")
    if mistake == "stage_index":
        PipelineStage(block, 1 - rank, 2, "cpu")
    stage = PipelineStage(block, rank, 2, "cpu")
    m = 3 if (mistake == "n_microbatches" and rank == 1) else 2
    schedule_class = {"order": ForwardTwice, "deadlock": WaitForEachOther}.get(
        mistake, ScheduleGPipe
    )
    schedule = schedule_class(stage, m, mse)
    x, y = batch(spec, 0)
    if mistake == "batch":
        x, y = x[:3], y[:3]
    if mistake == "batch_changes":  # a first, good step; then a smaller batch
        schedule.step(x) if rank == 0 else schedule.step(target=y)
        x, y = x[:2], y[:2]
    if rank == 0:
        schedule.step(x)
    elif mistake == "target":
        schedule.step()
    else:
        schedule.step(target=y)


MISTAKES = {
    "batch": (
        "stage 0 was given a batch of 3 samples, which n_microbatches=2 does not divide",
        "a multiple of 2",
    ),
    "target": ("stage 1 was given no target", "schedule.step(target=y, losses=losses)"),
    "num_stages": (
        "rank 1 says num_stages=3, but the pipeline's group has 2 ranks",
        "num_stages must be a multiple of 2",
    ),
    "stage_index": ("rank 0 says stage_index=1", "stage_index=dist.get_rank(group)"),
    "n_microbatches": (
        "different n_microbatches (stage 0: 2, stage 1: 3)",
        "the same n_microbatches",
    ),
    "order": ("has a schedule whose order() is not one stage's order", "(here: F0 appears twice)"),
    "deadlock": ("these orders deadlock: stage 0 at B0, stage 1 at F1", "reorder order()"),
    "batch_changes": (
        "microbatches of 1 samples, but the pipeline learnt its activation "
        "shapes from the first training step's 2",
        "keep the batch size fixed",
    ),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_bad_input_is_refused_on_every_stage_with_the_fix(pool2, mistake):
    problem, fix = MISTAKES[mistake]
    outcomes = pool2.run_expecting_errors(bad_step, mistake)
    for rank, outcome in enumerate(outcomes):
        assert outcome is not None and outcome.type_name == "ValueError", (rank, outcome)
        assert problem in outcome.message and fix in outcome.message, outcome.message


def test_1f1b_with_fewer_microbatches_than_stages_is_gpipe_where_the_warmup_covers_m():
    """torch refuses Schedule1F1B with m < p; nothing here needs to. Stage s warms up with
    min(m, p - s) forwards: where that is m, its order is GPipe's; the later stages still
    alternate (the first test checks the gradients at p=4, m=2 against one process)."""
    for p, m in [(2, 1), (4, 2), (4, 3)]:
        for s in range(p):
            shape = _StageShape(s, p, m)
            same = Schedule1F1B.order(shape) == ScheduleGPipe.order(shape)
            assert same == (p - s >= m or m == 1), (p, m, s)


@ours_only
def test_the_exercise_stub_fails_naming_its_todo(pool2):
    with pytest.raises(RankError, match="TODO exercise 11 "):
        pool2.run(train_stage, PipeSpec(steps=1), STUB)


def test_replay_names_a_deadlock():
    """An order that waits for itself: both stages start with a backward."""
    orders = [[Action("B", 0), Action("F", 0)], [Action("B", 0), Action("F", 0)]]
    with pytest.raises(ValueError, match="deadlock: stage 0 at B0, stage 1 at B0"):
        replay(orders)


def test_a_stage_without_a_process_group_says_how_to_launch():
    with pytest.raises(RuntimeError, match="torchrun"):
        PipelineStage(nn.Linear(2, 2), 0, 2, "cpu")
