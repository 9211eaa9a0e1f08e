"""Interleaved pipelines (miniddp/pipeline/interleaved.py): v = 2 stages a rank, stage s on rank
s % W, ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble, against one process and
against torch's own schedules of the same names, on gloo, at W = 2 and 4.

The bar is bitwise, as in tests/test_pipeline.py, and for the same reasons: each stage adds its
microbatches' gradients into .grad in the order 0 .. m-1 in every schedule (the zero-bubble
split included: its W i run in that order at each stage), each microbatch's loss divided by m.
So zero bubble is bitwise interleaved 1F1B, and both are bitwise one process.

The orders themselves are held to their formulas on the logical clock (timeline.replay): the
bubble of interleaved 1F1B is exactly (p - 1)/(v m + p - 1), zero bubble's is below it, and the
activations each rank holds are the formulas interleaved.py derives.

Your own interleaved order (tutorials/exercises/gpipe.py, step 2) goes through the same bar:

    MINIDDP_PP_INTERLEAVED=tutorials/exercises/gpipe.py:interleaved_order \\
        python -m pytest tests/test_pipeline_interleaved.py -x -q -k yours
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from miniddp.pipeline import Action, PipelineStage, Schedule1F1B
from miniddp.pipeline.actions import order_problem
from miniddp.pipeline.bubble import bubble_formula, bubble_fraction, peak_held, replay
from miniddp.pipeline.interleaved import (
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    interleaved_order,
)
from miniddp.sharding.clipping import clip_grad_norm_
from tests.test_pipeline import PipeSpec, assert_stage_equal, batch, build_model, mean_share, mse
from tests.test_pipeline import one_process as one_process_per_stage
from tests.workloads import load_implementation

V = 2
OURS = {"interleaved": ScheduleInterleaved1F1B, "zero-bubble": ScheduleInterleavedZeroBubble}
REPO = Path(__file__).resolve().parents[1]
# A learner's order, or by default the library's own through the same path: on a fresh clone
# the test runs (a check that skips there never runs), and it checks the harness itself.
LEARNERS = os.environ.get(
    "MINIDDP_PP_INTERLEAVED", "miniddp.pipeline.interleaved:interleaved_order"
)
EXERCISE = f"{REPO / 'tutorials' / 'exercises' / 'gpipe.py'}:interleaved_order"


def spec_for(ranks: int, m: int, steps: int = 3) -> PipeSpec:
    """v W stages, every border its own width."""
    return PipeSpec(widths=tuple(range(3 + V * ranks, 2, -1)), n_microbatches=m, steps=steps)


def my_stages(spec: PipeSpec, model, stage_class=PipelineStage) -> list:
    """This rank's stages, rank + i W for i = 0 .. v-1, built in that order."""
    rank, ranks = dist.get_rank(), dist.get_world_size()
    indices = [rank + i * ranks for i in range(spec.stages // ranks)]
    return [stage_class(model[s], s, spec.stages, "cpu") for s in indices]


def make(kind: str, spec: PipeSpec, model):
    m = spec.n_microbatches
    if kind.startswith("torch-"):
        from torch.distributed.pipelining import PipelineStage as TorchStage
        from torch.distributed.pipelining import ScheduleInterleaved1F1B as TorchInterleaved
        from torch.distributed.pipelining import ScheduleInterleavedZeroBubble as TorchZB

        cls = TorchInterleaved if kind == "torch-interleaved" else TorchZB
        stages = my_stages(spec, model, TorchStage)
        return cls(stages, m, loss_fn=partial(mean_share, m=m), scale_grads=False), stages
    stages = my_stages(spec, model)
    if kind == "yours":
        return YoursInterleaved(stages, m, mse), stages
    return OURS[kind](stages, m, mse), stages


class YoursInterleaved(ScheduleInterleaved1F1B):
    """ScheduleInterleaved1F1B running the order of MINIDDP_PP_INTERLEAVED's function."""

    def order(self) -> list[Action]:
        make_order = load_implementation(LEARNERS)
        stage = self.stage
        return make_order(stage.rank, stage.group_size, len(self.stages), self.n_microbatches)


def run_step(schedule, spec: PipeSpec, step: int, losses: list) -> None:
    rank, ranks = dist.get_rank(), dist.get_world_size()
    x, y = batch(spec, step)
    if rank == 0:
        schedule.step(x)
    elif rank == ranks - 1:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()


def train(spec: PipeSpec, kind: str) -> dict:
    """This rank's stages of `spec`'s model trained with `kind`: per stage, its gradients per
    step and its parameters at the end; the losses; and the gradients' norm over every rank."""
    model = build_model(spec)
    schedule, stages = make(kind, spec, model)
    blocks = [model[stage.stage_index] for stage in stages]
    params = [p for block in blocks for p in block.parameters()]
    optimizer = torch.optim.SGD(params, lr=spec.lr)
    grads, losses, norms, peaks = [], [], [], []
    for step in range(spec.steps):
        step_losses: list[torch.Tensor] = []
        run_step(schedule, spec, step, step_losses)
        grads.append([[p.grad.clone() for p in block.parameters()] for block in blocks])
        losses.append([loss.detach() for loss in step_losses])
        if not kind.startswith("torch-"):
            norms.append(clip_grad_norm_(params, max_norm=math.inf).item())
            peaks.append(schedule.peak_held)
        optimizer.step()
        optimizer.zero_grad()
    return {
        "indices": [s.stage_index for s in stages],
        "grads": grads,
        "losses": losses,
        "norms": norms,
        "peaks": peaks,
        "params": [[p.detach().clone() for p in block.parameters()] for block in blocks],
    }


def per_stage(results: list[dict], spec: PipeSpec) -> dict[int, dict]:
    """The ranks' results re-cut by stage, in test_pipeline's shape."""
    last = spec.stages - 1
    out = {}
    for result in results:
        for k, s in enumerate(result["indices"]):
            losses = result["losses"] if s == last else []
            out[s] = {
                "grads": [step[k] for step in result["grads"]],
                "params": result["params"][k],
                "losses": losses,
            }
    return out


def reference_norms(spec: PipeSpec) -> list[float]:
    """One process's gradient 2-norm after each step (max_norm = inf: nothing is clipped)."""
    model = build_model(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr)
    norms = []
    for step in range(spec.steps):
        x, y = batch(spec, step)
        for xm, ym in zip(x.tensor_split(spec.n_microbatches), y.tensor_split(spec.n_microbatches)):
            (mse(model(xm), ym) / spec.n_microbatches).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf).item())
        optimizer.step()
        optimizer.zero_grad()
    return norms


SLOW = pytest.mark.slow  # 30-45 s a case (four pipelines of 3 steps): the default suite keeps one
CASES = [(2, 4), pytest.param(2, 8, marks=SLOW), pytest.param(4, 4, marks=SLOW)]
CASES += [pytest.param(4, 8, marks=SLOW)]


@pytest.mark.parametrize("ranks, m", CASES, ids=lambda value: str(value))
def test_interleaved_and_zero_bubble_are_bitwise_one_process_and_torchs(rank_pools, ranks, m):
    """v = 2, 3 SGD steps: every stage's gradients each step, the parameters at the end and
    every loss, bitwise one process's and torch's own schedules'; zero bubble bitwise
    interleaved 1F1B; the gradients' 2-norm over the ranks one process's, up to rounding (each
    stage counted once, on rank s % W: on no rank or on two, its part would be 0 or doubled)."""
    spec = spec_for(ranks, m)
    pool = rank_pools(ranks)
    reference = one_process_per_stage(spec)
    for name in OURS:
        ours = per_stage(pool.run(train, spec, name), spec)
        theirs = per_stage(pool.run(train, spec, f"torch-{name}"), spec)
        for s in range(spec.stages):
            assert_stage_equal(ours[s], reference, s, spec, f"{name} against one process")
            shares = [[loss / m for loss in step] for step in ours[s]["losses"]]  # torch's
            assert_stage_equal({**ours[s], "losses": shares}, theirs[s], s, spec, f"{name}/torch")
        if name == "interleaved":
            first = ours
        else:
            for s in range(spec.stages):
                assert_stage_equal(ours[s], first[s], s, spec, "zero bubble against interleaved")
    results = pool.run(train, spec, "zero-bubble")
    norms = reference_norms(spec)  # the same squares, summed in another order
    assert all(r["norms"] == pytest.approx(norms, rel=1e-6) for r in results)


def accumulate_two_steps(spec: PipeSpec, name: str) -> dict[int, list[torch.Tensor]]:
    """Two steps on two batches, no optimizer step between: each stage's .grad."""
    model = build_model(spec)
    schedule, stages = make(name, spec, model)
    for step in range(2):
        run_step(schedule, spec, step, [])
    return {s.stage_index: [p.grad.clone() for p in s.submodule.parameters()] for s in stages}


@pytest.mark.parametrize("name", list(OURS))
def test_accumulating_over_two_steps_sums_their_gradients(pool2, name):
    """G1 + G2, as one process accumulating two batches: each step scales its own losses."""
    spec = spec_for(2, 4)
    model = build_model(spec)
    for step in range(2):
        x, y = batch(spec, step)
        for xm, ym in zip(x.tensor_split(4), y.tensor_split(4)):
            (mse(model(xm), ym) / 4).backward()
    for result in pool2.run(accumulate_two_steps, spec, name):
        for s, grads in result.items():
            for index, (ours, param) in enumerate(zip(grads, model[s].parameters())):
                assert torch.equal(ours, param.grad), f"{name}: stage {s}'s gradient {index}"


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("m", [2, 4, 8, 12])
def test_the_orders_have_the_formulas_bubble_and_memory_on_a_logical_clock(ranks, m):
    """Each F costs 1, each B 2 (I and W 1 each). Interleaved 1F1B idles exactly (p - 1) /
    (v m + p - 1) when W divides m; rank r holds min(v m, (v - 1) R + 2 (W - 1 - r) + 1)
    microbatch-stages (R = m / max(1, m // W)). Zero bubble idles less, and every rank holds
    min(v m, (v - 1) R + W)."""
    per_round = m // max(1, m // ranks)
    one_f_one_b = [interleaved_order(r, ranks, V, m) for r in range(ranks)]
    zero_bubble = [interleaved_order(r, ranks, V, m, zero_bubble=True) for r in range(ranks)]
    interleaved_bubble = bubble_fraction(replay(one_f_one_b))
    if m % ranks == 0:
        assert interleaved_bubble == pytest.approx(bubble_formula(ranks, m, V), abs=1e-12)
    assert bubble_fraction(replay(zero_bubble)) < interleaved_bubble
    warmup = [(V - 1) * per_round + 2 * (ranks - 1 - r) for r in range(ranks)]
    assert [peak_held(o) for o in one_f_one_b] == [min(V * m, w + 1) for w in warmup]
    assert [peak_held(o) for o in zero_bubble] == [min(V * m, (V - 1) * per_round + ranks)] * ranks


def bad_layout(mistake: str) -> None:
    """Two ranks, four stages, one mistake; every rank must raise the same clear error."""
    rank = dist.get_rank()
    spec = spec_for(2, 4)
    model = build_model(spec)
    if mistake == "stage_index":  # rank 1 builds stage 3 first, rank 0 stage 0
        PipelineStage(model[0], 3 * rank, 4, "cpu")
    if mistake == "num_stages":
        PipelineStage(model[rank], rank, 3, "cpu")
    if mistake == "checkpoint":
        from miniddp.checkpoint.full_tensors import spread_of

        spread_of(model[rank])  # unmarked: fine
        stage = PipelineStage(model[rank], rank, 4, "cpu")
        spread_of(stage.submodule)
    stages = my_stages(spec, model)
    if mistake == "one_stage_given":
        ScheduleInterleaved1F1B(stages[:1] if rank == 1 else stages, 4, mse).step(
            *([batch(spec, 0)[0]] if rank == 0 else []), target=None
        )
    if mistake == "1f1b_for_interleaved":
        Schedule1F1B(stages[0], 4, mse).step(*([batch(spec, 0)[0]] if rank == 0 else []))
    if mistake == "microbatches":
        ScheduleInterleaved1F1B(stages, 5, mse).step()


LAYOUTS = {
    "stage_index": ("rank 1 says stage_index=3", "stage_index=dist.get_rank(group) + i * 2"),
    "num_stages": ("rank 0 says num_stages=3", "must be a multiple of 2"),
    "checkpoint": ("a pipeline of 4 stages on 2 ranks", "Save each stage's submodule"),
    "one_stage_given": ("it was given stages [1] (v = 1)", "rank 1 holds stages [1, 3]"),
    "1f1b_for_interleaved": ("Schedule1F1B runs one stage a rank", "ScheduleInterleaved1F1B"),
    "microbatches": ("n_microbatches=5 is not a multiple", "use a multiple of W = 2"),
}


@pytest.mark.parametrize("mistake", list(LAYOUTS))
def test_bad_layouts_are_refused_on_every_rank_with_the_fix(pool2, mistake):
    problem, fix = LAYOUTS[mistake]
    outcomes = pool2.run_expecting_errors(bad_layout, mistake)
    for rank, outcome in enumerate(outcomes):
        assert outcome is not None and outcome.type_name in ("ValueError", "CheckpointError"), (
            rank,
            outcome,
        )
        if mistake != "one_stage_given" or rank == 1:  # the detail is the rank's own
            assert problem in outcome.message and fix in outcome.message, outcome.message


def verdict(make_order, ranks: int, m: int) -> str | None:
    """Why `make_order`'s orders are not a good interleaved 1F1B (None: they are): each rank's
    order valid alone, the orders deadlock-free together (the logical clock), no rank holding
    more than interleaved 1F1B's min(v m, warm-up + 1) microbatch-stages, the bubble no more
    than (p - 1)/(v m + p - 1)."""
    orders = [make_order(r, ranks, V, m) for r in range(ranks)]
    for r, order in enumerate(orders):
        problem = order_problem(order, m, [r + i * ranks for i in range(V)])
        if problem:
            return f"rank {r}'s order: {problem}"
    try:
        blocks = replay(orders)
    except ValueError as deadlock:
        return str(deadlock)
    per_round = m // max(1, m // ranks)
    for r, order in enumerate(orders):
        most = min(V * m, (V - 1) * per_round + 2 * (ranks - 1 - r) + 1)
        if peak_held(order) > most:
            return (
                f"rank {r} holds {peak_held(order)} microbatch-stages' activations at once, "
                f"more than interleaved 1F1B's {most}"
            )
    bubble, formula = bubble_fraction(blocks), bubble_formula(ranks, m, V)
    if bubble > formula + 1e-9:
        return f"the bubble is {bubble:.3f}, more than (p - 1)/(v m + p - 1) = {formula:.3f}"
    return None


def deadlocks(rank: int, ranks: int, v: int, m: int) -> list[Action]:
    """Every rank starts with its last stage's forward: it waits for what nobody sent."""
    order = interleaved_order(rank, ranks, v, m)
    return sorted(order, key=lambda a: (a.kind != "F", -a.stage))


def holds_everything(rank: int, ranks: int, v: int, m: int) -> list[Action]:
    """GPipe, interleaved: every forward at every stage, then every backward."""
    order = interleaved_order(rank, ranks, v, m)
    return [a for a in order if a.kind == "F"] + [a for a in order if a.kind == "B"]


def test_the_order_check_fails_a_deadlock_and_an_order_holding_too_much():
    assert verdict(interleaved_order, 4, 8) is None
    assert "deadlock" in verdict(deadlocks, 4, 8)
    assert "rank 0 holds 16 microbatch-stages' activations" in verdict(holds_everything, 4, 8)


def test_the_exercise_stub_fails_naming_its_todo():
    with pytest.raises(NotImplementedError, match="TODO exercise 11, step 2 "):
        load_implementation(EXERCISE)(0, 2, V, 4)


@pytest.mark.parametrize("ranks, m", [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_yours_is_a_good_interleaved_order_and_trains_as_one_process(rank_pools, ranks, m):
    assert verdict(load_implementation(LEARNERS), ranks, m) is None
    spec = spec_for(ranks, m)
    reference = one_process_per_stage(spec)
    ours = per_stage(rank_pools(ranks).run(train, spec, "yours"), spec)
    for s in range(spec.stages):
        assert_stage_equal(ours[s], reference, s, spec, "your order against one process")


def train_validate_train(spec: PipeSpec, kind: str) -> dict:
    """A training step, eval() on a validation batch half the size (microbatches of 1, not
    2), another training step: the validation losses and outputs on the last stage, and each
    stage's gradients of the second training step."""
    model = build_model(spec)
    schedule, stages = make(kind, spec, model)
    blocks = {stage.stage_index: model[stage.stage_index] for stage in stages}
    params = [p for block in blocks.values() for p in block.parameters()]
    optimizer = torch.optim.SGD(params, lr=spec.lr)
    run_step(schedule, spec, 0, [])
    optimizer.step()
    optimizer.zero_grad()
    x, y = batch(replace(spec, microbatch=1), 7)
    rank, losses = dist.get_rank(), []
    if rank == 0:
        output = schedule.eval(x)
    elif rank == dist.get_world_size() - 1:
        output = schedule.eval(target=y, losses=losses)
    else:
        output = schedule.eval()
    run_step(schedule, spec, 1, [])
    return {
        "output": output,
        "losses": [loss.detach() for loss in losses],
        "grads": {s: [p.grad.clone() for p in block.parameters()] for s, block in blocks.items()},
    }


def validated_one_process(spec: PipeSpec) -> dict:
    model = build_model(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr)
    m = spec.n_microbatches
    for step in range(2):
        x, y = batch(spec, step)
        for xm, ym in zip(x.tensor_split(m), y.tensor_split(m)):
            (mse(model(xm), ym) / m).backward()
        if step == 0:
            optimizer.step()
            optimizer.zero_grad()
            x, y = batch(replace(spec, microbatch=1), 7)
            with torch.no_grad():
                outputs = [model(xm) for xm in x.tensor_split(m)]
            losses = [mse(out, ym) for out, ym in zip(outputs, y.tensor_split(m))]
    grads = [[p.grad.clone() for p in block.parameters()] for block in model]
    return {"output": torch.cat(outputs), "losses": losses, "grads": grads}


@pytest.mark.parametrize("name", list(OURS))
def test_eval_on_a_smaller_validation_batch_is_one_process_and_torchs(pool2, name):
    """The stages learnt their borders' shapes from the training batch; a validation batch of
    half the size is learnt again (torch re-infers its shapes when eval follows training), and
    the next training step learns the training shapes back. Bitwise one process, and torch's
    interleaved 1F1B's eval (its losses are each microbatch's share, loss / m)."""
    spec = spec_for(2, 4)
    reference = validated_one_process(spec)
    ours = pool2.run(train_validate_train, spec, name)
    last = ours[(spec.stages - 1) % 2]
    assert torch.equal(last["output"], reference["output"])
    assert len(last["losses"]) == len(reference["losses"])
    assert all(torch.equal(a, b) for a, b in zip(last["losses"], reference["losses"]))
    for result in ours:
        for s, grads in result["grads"].items():
            assert all(torch.equal(a, b) for a, b in zip(grads, reference["grads"][s])), s
    if name != "interleaved":  # torch's eval runs the forwards alone, the same in both
        return
    theirs = pool2.run(train_validate_train, spec, "torch-interleaved")[(spec.stages - 1) % 2]
    m = spec.n_microbatches
    assert all(torch.equal(a / m, b) for a, b in zip(last["losses"], theirs["losses"]))
    assert torch.equal(last["output"], theirs["output"])
