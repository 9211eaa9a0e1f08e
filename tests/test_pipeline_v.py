"""The V schedules (miniddp/pipeline/v_schedules.py): two stages a rank, r and 2W - 1 - r,
ScheduleZBVZeroBubble and ScheduleDualPipeV, against one process and against torch's own
schedules of the same names, on gloo, at W = 2 and 4.

The bar is bitwise, as in tests/test_pipeline_interleaved.py and for the same reasons: every
stage adds its microbatches' weight gradients into .grad in the order 0 .. m-1 (a W i or a
whole B i, each the same kernels on the same values), each microbatch's loss divided by m.

The V itself is checked where a mistake would hide: the orders are torch's, action for action;
the placement is torch's (rank r holds r and 2W - 1 - r: a second stage on the wrong rank sends
to the wrong peer); the gradients' norm counts each stage once (on the rank that runs it); a
rank given other stages than the V's is refused on every rank, before any send.
"""

from __future__ import annotations

import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from miniddp import MiniDDP
from miniddp.pipeline import PipelineStage, ScheduleDualPipeV, ScheduleZBVZeroBubble
from miniddp.pipeline.actions import order_problem
from miniddp.pipeline.bubble import peak_held, replay
from miniddp.pipeline.interleaved import interleaved_order
from miniddp.pipeline.v_schedules import dualpipev_order, v_placement, v_stages, zbv_order
from miniddp.sharding.clipping import clip_grad_norm_
from tests.mesh_tasks import mesh_once
from tests.test_pipeline import assert_stage_equal, batch, build_model, mean_share, mse
from tests.test_pipeline import one_process as one_process_per_stage
from tests.test_pipeline_interleaved import per_stage, reference_norms, spec_for

OURS = {"zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
TORCH_NAMES = {"zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


def torch_orders(name: str, ranks: int, m: int) -> list[list[tuple[str, int, int]]]:
    """torch's own order for each rank, its overlapped pairs written as their two actions (torch
    runs the forward first). Read from the schedule's order-making method, without a pipeline."""
    from torch.distributed.pipelining import schedules

    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    kinds["FULL_BACKWARD"] = "B"
    cls = getattr(schedules, TORCH_NAMES[name])
    this = SimpleNamespace(pp_group_size=ranks, _n_microbatches=m, num_stages=2 * ranks)
    orders = []
    for rank in range(ranks):
        flat = []
        for action in filter(None, cls._calculate_single_rank_operations(this, rank)):
            for each in action.sub_actions or [action]:
                kind = kinds[each.computation_type.name]
                flat.append((kind, each.microbatch_index, each.stage_index))
        orders.append(flat)
    return orders


OURS_ORDER = {"zbv": zbv_order, "dualpipev": dualpipev_order}


@pytest.mark.parametrize("name", list(OURS))
def test_the_orders_and_the_placement_are_torchs(name):
    """Action for action, W = 1 .. 5 and every m up to 20 that torch accepts (DualPipeV: m >=
    2W); and the V's placement is torch's `generate_stage_to_rank_mapping(style="v")`."""
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    for ranks in range(1, 6):
        torch_v = generate_stage_to_rank_mapping(ranks, 2 * ranks, style="v")
        assert v_placement(ranks) == [torch_v[s] for s in range(2 * ranks)]
        for m in range(2 * ranks if name == "dualpipev" else 1, 21):
            ours = [OURS_ORDER[name](r, ranks, m) for r in range(ranks)]
            assert [[tuple(a) for a in o] for o in ours] == torch_orders(name, ranks, m), (ranks, m)
            for rank, order in enumerate(ours):
                assert order_problem(order, m, list(v_stages(rank, ranks))) is None


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_on_a_logical_clock_the_v_idles_as_the_papers_say_and_holds_evenly(ranks):
    """Each F costs 1, each I and W 1 (B 2). Interleaved 1F1B idles (W - 1)(F + B) a rank,
    ZB1P (W - 1)(F + B - 2W) (DeepSeek-V3's table, per stage). ZB-V with t_F = t_I = t_W has
    no idle slot inside any rank's span (Qi et al.): each rank idles only its start-up, W - 1.
    DualPipeV stays under its table's bound, (W - 1)(F&B + B - 3W) with F&B = F + B here.
    Memory: ZB-V holds 2W microbatch-stages on every rank, DualPipeV 2W + 1 (the table's
    PP + 1), evenly; interleaved 1F1B's rank 0 holds at least as much, its last rank less."""
    m = 4 * ranks
    f, b, w = 1, 2, 1

    def idle(orders):
        blocks = replay(orders)
        end = max(x.end for row in blocks for x in row)
        own = [max(x.end for x in row) - min(x.start for x in row) for row in blocks]
        busy = [sum(x.duration for x in row) for row in blocks]
        return [end - t for t in busy], [span - t for span, t in zip(own, busy)]

    loop = idle([interleaved_order(r, ranks, 2, m) for r in range(ranks)])[0]
    zb1p = idle([interleaved_order(r, ranks, 2, m, zero_bubble=True) for r in range(ranks)])[0]
    zbv = [zbv_order(r, ranks, m) for r in range(ranks)]
    dualpipev = [dualpipev_order(r, ranks, m) for r in range(ranks)]
    assert loop == [(ranks - 1) * (f + b)] * ranks
    assert zb1p == [(ranks - 1) * (f + b - 2 * w)] * ranks
    assert idle(zbv) == ([ranks - 1] * ranks, [0] * ranks)
    assert all(t <= (ranks - 1) * ((f + b) + b - 3 * w) for t in idle(dualpipev)[0])
    assert [peak_held(o) for o in zbv] == [2 * ranks] * ranks
    assert [peak_held(o) for o in dualpipev] == [2 * ranks + 1] * ranks
    loop_peaks = [peak_held(interleaved_order(r, ranks, 2, m)) for r in range(ranks)]
    assert loop_peaks[0] >= 2 * ranks + 1 > 2 * ranks > loop_peaks[-1]  # uneven: rank 0 most


def my_v_stages(spec, model, stage_class=PipelineStage) -> list:
    """This rank's stages in the V, r then 2W - 1 - r, built in that order."""
    indices = v_stages(dist.get_rank(), dist.get_world_size())
    return [stage_class(model[s], s, spec.stages, "cpu") for s in indices]


def make(kind: str, spec, model):
    m = spec.n_microbatches
    if kind.startswith("torch-"):
        from torch.distributed.pipelining import PipelineStage as TorchStage
        from torch.distributed.pipelining import schedules

        cls = getattr(schedules, TORCH_NAMES[kind.removeprefix("torch-")])
        stages = my_v_stages(spec, model, TorchStage)
        return cls(stages, m, loss_fn=partial(mean_share, m=m), scale_grads=False), stages
    stages = my_v_stages(spec, model)
    return OURS[kind](stages, m, mse), stages


def train(spec, kind: str) -> dict:
    """This rank's two stages trained with `kind`: per stage its gradients each step and its
    parameters at the end; the losses (rank 0 holds the last stage); the gradients' norm."""
    model = build_model(spec)
    schedule, stages = make(kind, spec, model)
    blocks = [model[stage.stage_index] for stage in stages]
    params = [p for block in blocks for p in block.parameters()]
    optimizer = torch.optim.SGD(params, lr=spec.lr)
    grads, losses, norms = [], [], []
    for step in range(spec.steps):
        step_losses: list[torch.Tensor] = []
        x, y = batch(spec, step)
        if dist.get_rank() == 0:  # the first stage and the last: the batch in, the loss out
            schedule.step(x, target=y, losses=step_losses)
        else:
            schedule.step()
        grads.append([[p.grad.clone() for p in block.parameters()] for block in blocks])
        losses.append([loss.detach() for loss in step_losses])
        if not kind.startswith("torch-"):
            norms.append(clip_grad_norm_(params, max_norm=math.inf).item())
        optimizer.step()
        optimizer.zero_grad()
    return {
        "indices": [s.stage_index for s in stages],
        "grads": grads,
        "losses": losses,
        "norms": norms,
        "params": [[p.detach().clone() for p in block.parameters()] for block in blocks],
    }


SLOW = pytest.mark.slow  # a second m at 2 ranks, or another at 4: 4 ranks share 2 cores
CASES = [("zbv", 2, 2, 3), ("zbv", 2, 4, 3), ("dualpipev", 2, 4, 3)]
CASES += [("zbv", 4, 8, 2), ("dualpipev", 4, 8, 2)]  # m >= 2W for DualPipeV; 2 steps
CASES += [pytest.param(name, 2, 6, 3, marks=SLOW) for name in OURS]
CASES += [pytest.param("zbv", 4, 3, 2, marks=SLOW), pytest.param("dualpipev", 4, 12, 2, marks=SLOW)]


@pytest.mark.parametrize("name, ranks, m, steps", CASES, ids=lambda value: str(value))
def test_each_v_schedule_is_bitwise_one_process_and_torchs(rank_pools, name, ranks, m, steps):
    """Every stage's gradients each step, its parameters at the end and every loss, bitwise one
    process's and torch's schedule of the same name (m < 2W - 1 too: ZB-V's order is built for
    2W - 1 microbatches and cut); the gradients' 2-norm over the ranks one process's, up to
    rounding (each stage counted once, on the rank that runs it: rank 2W - 1 - s for s >= W)."""
    spec = spec_for(ranks, m, steps)
    pool = rank_pools(ranks)
    reference = one_process_per_stage(spec)
    results = pool.run(train, spec, name)
    ours = per_stage(results, spec)
    theirs = per_stage(pool.run(train, spec, f"torch-{name}"), spec)
    for s in range(spec.stages):
        assert_stage_equal(ours[s], reference, s, spec, f"{name} against one process")
        shares = [[loss / m for loss in step] for step in ours[s]["losses"]]  # torch's
        assert_stage_equal({**ours[s], "losses": shares}, theirs[s], s, spec, f"{name}/torch")
    norms = reference_norms(spec)  # the same squares, summed in another order
    assert all(r["norms"] == pytest.approx(norms, rel=1e-6) for r in results)


DP_WIDTHS, DP_STEPS, DP_LR = (6, 5, 4, 4, 3), 3, 0.1  # four stages: a V on pp = 2


def dp_model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(DP_WIDTHS, DP_WIDTHS[1:])]
    return nn.Sequential(*blocks).double()


def dp_batch(m: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: 2 replicas x m microbatches x 2 samples."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(4 * m, DP_WIDTHS[0], generator=generator, dtype=torch.float64)
    return x, torch.randn(4 * m, DP_WIDTHS[-1], generator=generator, dtype=torch.float64)


def train_dp_v(name: str, m: int) -> dict:
    """A (pp, dp) = (2, 2) mesh: each pp rank holds its two stages of the V, each stage wrapped
    in its own MiniDDP over "dp", trained on its replica's half of each global batch."""
    mesh = mesh_once((2, 2), ("pp", "dp"))
    pp_rank, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    model, indices = dp_model(), v_stages(pp_rank, 2)
    wrapped = [MiniDDP(model[s], process_group=mesh["dp"].get_group()) for s in indices]
    pp_group = mesh["pp"].get_group()
    stages = [PipelineStage(w, s, 4, "cpu", group=pp_group) for w, s in zip(wrapped, indices)]
    schedule = OURS[name](stages, m, mse)
    params = [p for s in indices for p in model[s].parameters()]
    optimizer = torch.optim.SGD(params, lr=DP_LR)
    for step in range(DP_STEPS):
        x, y = (t.tensor_split(2)[replica] for t in dp_batch(m, step))
        schedule.step(x, target=y) if pp_rank == 0 else schedule.step()
        optimizer.step()
        optimizer.zero_grad()
    return {
        "params": {s: [p.detach().clone() for p in model[s].parameters()] for s in indices},
        "reduced_once_a_step": [w.all_reduce_count == DP_STEPS * len(w.buckets) for w in wrapped],
    }


@pytest.mark.parametrize("name", list(OURS))
def test_with_miniddp_over_dp_each_v_is_one_process_on_the_global_batch(rank_pools, name):
    """pp = 2 x dp = 2, MiniDDP inside each stage: one all-reduce a stage a step, at its last
    backward (a whole B, or the last W of a split one); within 1e-12 of one process on the
    global batch (the same numbers, averaged in another order); both replicas bitwise alike."""
    m = 4
    results = rank_pools(4).run(train_dp_v, name, m)
    model = dp_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=DP_LR)
    for step in range(DP_STEPS):
        x, y = dp_batch(m, step)
        mse(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    for rank, result in enumerate(results):  # the mesh: rank = 2 * pp + dp
        assert all(result["reduced_once_a_step"]), f"rank {rank}"
        for s, params in result["params"].items():
            for index, (ours, reference) in enumerate(zip(params, model[s].parameters())):
                difference = (ours - reference.detach()).abs().max().item()
                assert difference <= 1e-12, f"rank {rank}, stage {s}, parameter {index}"
        replica = results[rank ^ 1]["params"]
        assert all(
            torch.equal(a, b)
            for s in result["params"]
            for a, b in zip(result["params"][s], replica[s])
        ), f"rank {rank}"


def bad_v(mistake: str) -> None:
    """Two ranks, four stages, one mistake; every rank must raise the same clear error."""
    rank, spec = dist.get_rank(), spec_for(2, 4)
    model = build_model(spec)
    x, y = batch(spec, 0)
    if mistake == "mirrored_on_one_rank":  # rank 0 builds the V's 3, rank 1 the loop's 3
        PipelineStage(model[rank], rank, 4, "cpu")
        PipelineStage(model[3], 3, 4, "cpu")
    if mistake == "second_stage_of_the_loop":  # r and r + W: the V's second stage elsewhere
        stages = [PipelineStage(model[s], s, 4, "cpu") for s in (rank, rank + 2)]
    else:
        stages = my_v_stages(spec, model)
    schedule_class, m = ScheduleZBVZeroBubble, 4
    if mistake == "one_stage_given" and rank == 1:
        stages = stages[:1]
    if mistake == "too_few_microbatches":
        schedule_class, m = ScheduleDualPipeV, 2
    schedule = schedule_class(stages, m, mse)
    schedule.step(x, target=y) if rank == 0 else schedule.step()


V_MISTAKES = {
    "mirrored_on_one_rank": ("rank 1 says stage_index=3", "second stage 3 - r on every rank"),
    "second_stage_of_the_loop": ("was given stages [", "on rank 2W - 1 - s from W on"),
    "one_stage_given": ("rank 1 was given stages [1] of 4", "give it stages [1, 2]"),
    "too_few_microbatches": ("n_microbatches=2", "at least as many microbatches as stages, 4"),
}


@pytest.mark.parametrize("mistake", list(V_MISTAKES))
def test_a_v_given_other_stages_is_refused_on_every_rank_before_any_send(pool2, mistake):
    """Two stages a rank, r and 2W - 1 - r, else every rank raises the same ValueError at the
    step's first check (an all-reduce, before any activation moves), the rank at fault saying
    what it was given and what to give; a round built half mirrored, when the stages are built."""
    problem, fix = V_MISTAKES[mistake]
    outcomes = pool2.run_expecting_errors(bad_v, mistake)
    for rank, outcome in enumerate(outcomes):
        assert outcome is not None and outcome.type_name == "ValueError", (rank, outcome)
        if mistake != "one_stage_given" or rank == 1:  # the detail is the rank's own
            assert problem in outcome.message and fix in outcome.message, outcome.message
        if mistake == "second_stage_of_the_loop":
            assert f"give it stages {list(v_stages(rank, 2))}" in outcome.message


def accumulate_then_eval(spec, name: str, scale_grads: bool) -> dict:
    """Two steps before any optimizer step, then eval() on a third batch: each stage's .grad,
    and rank 0's eval losses and whether eval touched .grad. Without scale_grads the loss_fn
    divides by m itself (torch's own way to say it)."""
    model, m = build_model(spec), spec.n_microbatches
    stages = my_v_stages(spec, model)
    loss_fn = mse if scale_grads else partial(mean_share, m=m)
    schedule = OURS[name](stages, m, loss_fn, scale_grads=scale_grads)
    for step in range(3):
        x, y = batch(spec, step)
        if step == 2:
            grads = [[p.grad.clone() for p in s.submodule.parameters()] for s in stages]
        losses: list[torch.Tensor] = []
        run = schedule.step if step < 2 else schedule.eval
        run(x, target=y, losses=losses) if dist.get_rank() == 0 else run()
    untouched = all(
        torch.equal(p.grad, g)
        for s, gs in zip(stages, grads)
        for p, g in zip(s.submodule.parameters(), gs)
    )
    return {s.stage_index: g for s, g in zip(stages, grads)} | {"eval": (losses, untouched)}


@pytest.mark.parametrize("name", list(OURS))
def test_two_steps_sum_their_gradients_and_eval_is_forward_only(pool2, name):
    """G1 + G2, as one process accumulating two batches, with torch's scale_grads=False too
    (the loss_fn dividing by m); then eval() returns one process's losses (as loss_fn returns
    them) and leaves .grad."""
    spec = spec_for(2, 4)
    model = build_model(spec)
    for step in range(2):
        x, y = batch(spec, step)
        for xm, ym in zip(x.tensor_split(4), y.tensor_split(4)):
            (mse(model(xm), ym) / 4).backward()
    x, y = batch(spec, 2)
    with torch.no_grad():
        expected = [mse(model(xm), ym) for xm, ym in zip(x.tensor_split(4), y.tensor_split(4))]
    for scale_grads in (True, False):
        results = pool2.run(accumulate_then_eval, spec, name, scale_grads)
        losses, untouched = results[0]["eval"]
        assert untouched, "eval changed .grad"
        reported = expected if scale_grads else [loss / 4 for loss in expected]  # loss_fn's
        assert all(torch.equal(a, b) for a, b in zip(losses, reported, strict=True))
        for result in results:
            result.pop("eval")
            for s, grads in result.items():
                for index, (ours, param) in enumerate(zip(grads, model[s].parameters())):
                    assert torch.equal(ours, param.grad), f"{name}: stage {s}'s gradient {index}"
