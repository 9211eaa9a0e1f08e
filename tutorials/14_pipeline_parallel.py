"""Chapter 14: pipeline parallelism. Cut the model into stages, one per rank, and feed it
microbatches: GPipe, then 1F1B, their bubble measured and their memory counted.

    torchrun --nproc_per_node=4 tutorials/14_pipeline_parallel.py      (2 ranks work too)

Data parallelism copies the whole model to every rank; when the model does not fit, cut it. A
pipeline gives each rank a consecutive slice (a *stage*): stage s receives activations from
stage s-1, and in backward sends gradients back to it. One batch would keep one stage busy at a
time, so the batch is cut into m microbatches that follow each other down the pipe.

    1. split a model into stages      activation shapes found by a first exchange
    2. GPipe                          all forwards, then all backwards; the picture
    3. 1F1B                           the same bubble, a fraction of the memory
    4. the bubble against m           replayed and measured against (p - 1) / (m + p - 1)
    5. the same training              bitwise one process, both schedules
    6. DP x PP                        2 stages x 2 replicas, and the no_sync trap (4 ranks)

Exercise: tutorials/exercises/gpipe.py, your own GPipe order, checked by tests/test_pipeline.py.
The library is miniddp/pipeline/ (its __init__ lists a file per idea); the picture of this
chapter's steps is docs/figures/14_pipeline.png (`python -m miniddp.figures --only 14`), and
`python -m miniddp.bench pp` times a step against torch's own pipelining.
"""

from __future__ import annotations

import math
import statistics
import textwrap

import torch
import torch.distributed as dist
from common import end_chapter, say, say_all_ranks, section
from torch import nn

from miniddp import MiniDDP
from miniddp.job.env import init_distributed
from miniddp.mesh import init_device_mesh
from miniddp.observe.events import Recorder
from miniddp.pipeline import (
    Action,
    FixedCost,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
)
from miniddp.pipeline.bubble import (
    ascii_chart,
    bubble_formula,
    bubble_fraction,
    gather_blocks,
    replay,
)

WIDTH = 16
FORWARD_S, BACKWARD_S = 0.020, 0.040  # every stage's F and B, made exact by FixedCost
CHART_COLUMNS = 88  # "stage 0 |" + the chart + "|" within the 100 characters of a line
STEPS = 3
FIGURE = "docs/figures/14_pipeline.png"


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def build_model(num_stages: int) -> nn.Sequential:
    """num_stages blocks of different widths (so every border has its own shape)."""
    torch.manual_seed(0)
    widths = [WIDTH + 4 * s for s in range(num_stages)] + [4]
    blocks = [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(widths, widths[1:])]
    return nn.Sequential(*blocks)


def batch(m: int, step: int, width_in: int, width_out: int, samples: int = 2):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(m * samples, width_in, generator=generator)
    return x, torch.randn(m * samples, width_out, generator=generator)


def run_step(schedule, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Every stage calls step; only the first passes the batch, only the last the target."""
    stage, losses = schedule.stage, []
    if stage.is_first:
        schedule.step(x)
    elif stage.is_last:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    return losses


def timed_stage(rank: int, p: int) -> PipelineStage:
    """A stage whose forward takes FORWARD_S and backward BACKWARD_S, whatever the machine."""
    # After the Linear: on stage 0 the input needs no gradient, so a FixedCost before it would
    # never be reached by backward.
    block = nn.Sequential(nn.Linear(WIDTH, WIDTH), FixedCost(FORWARD_S, BACKWARD_S))
    return PipelineStage(block, rank, p, "cpu")


def replayed_bubble(blocks: list[list]) -> float:
    """The bubble of the orders the stages ran (read from their blocks), replayed on a logical
    clock where every F takes FORWARD_S and every B BACKWARD_S exactly and a transfer nothing:
    the schedule's own bubble, whatever else this machine was running."""
    orders = [[Action(block.kind, block.microbatch) for block in stage] for stage in blocks]
    return bubble_fraction(replay(orders, FORWARD_S, BACKWARD_S))


def measure(schedule_class, stage: PipelineStage, m: int) -> tuple[float, float, list, int]:
    """Four steps; the median measured bubble of the last three (the first also exchanges
    shapes), the replayed bubble of the last one's orders, its blocks, and the most
    microbatches this stage held."""
    schedule = schedule_class(stage, m, mse)
    recorder = schedule.observer = Recorder()  # notes each block's start and end
    x, y = batch(m, 0, WIDTH, WIDTH)
    fractions = []
    for _ in range(4):
        dist.barrier()
        run_step(schedule, x, y)
        blocks = gather_blocks(schedule, recorder.events)
        fractions.append(bubble_fraction(blocks))
    return statistics.median(fractions[1:]), replayed_bubble(blocks), blocks, stage.peak_held


def on_the_formula(replayed: float, p: int, m: int) -> bool:
    """The replayed bubble is (p - 1) / (m + p - 1), up to the rounding of adding seconds."""
    return math.isclose(replayed, bubble_formula(p, m), abs_tol=1e-9)


def say_peaks(peak: int, m: int, p: int, rank: int) -> None:
    say_all_ranks(f"stage {rank} held at most {peak} microbatches' activations (m = {m}, p = {p})")


def same_as_one_process(schedule_class, p: int, m: int) -> bool:
    """STEPS SGD steps of the real model, pipelined; then one process on the same microbatches,
    each loss divided by m. Are this stage's gradients and parameters the same bits?"""
    rank = dist.get_rank()
    model = build_model(p)
    stage = PipelineStage(model[rank], rank, p, "cpu")
    schedule = schedule_class(stage, m, mse)
    reference = build_model(p)
    optimizers = [torch.optim.SGD(net.parameters(), lr=0.1) for net in (model, reference)]
    widths = (model[0][0].in_features, model[-1][0].out_features)
    same = True
    for step in range(STEPS):
        x, y = batch(m, step, *widths)
        losses = run_step(schedule, x, y)
        for xm, ym, loss in zip(x.tensor_split(m), y.tensor_split(m), losses or [None] * m):
            one = mse(reference(xm), ym)
            (one / m).backward()
            same &= loss is None or torch.equal(loss, one.detach())
        ours, theirs = model[rank].parameters(), reference[rank].parameters()
        same &= all(torch.equal(a.grad, b.grad) for a, b in zip(ours, theirs))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return same and all(
        torch.equal(a, b) for a, b in zip(model[rank].parameters(), reference[rank].parameters())
    )


def eval_as_one_process(p: int, m: int) -> bool:
    """One forward-only step, schedule.eval: are the last stage's outputs and losses one
    process's on the same microbatches, bit for bit, and is no stage left a gradient?"""
    rank = dist.get_rank()
    model, reference = build_model(p), build_model(p)
    stage = PipelineStage(model[rank], rank, p, "cpu")
    schedule = ScheduleGPipe(stage, m, mse)
    x, y = batch(m, 0, model[0][0].in_features, model[-1][0].out_features)
    losses: list[torch.Tensor] = []
    if stage.is_first:
        schedule.eval(x)
    elif stage.is_last:
        output = schedule.eval(target=y, losses=losses)
    else:
        schedule.eval()
    untouched = all(t.grad is None for t in model[rank].parameters())
    if not stage.is_last:
        return untouched
    with torch.no_grad():
        outputs = [reference(xm) for xm in x.tensor_split(m)]
    same = torch.equal(output, torch.cat(outputs)) and len(losses) == m
    same &= all(torch.equal(a, mse(b, ym)) for a, b, ym in zip(losses, outputs, y.tensor_split(m)))
    return same and untouched


def the_no_sync_trap(group: dist.ProcessGroup) -> str:
    """Plain accumulation's habit (chapter 05) in a pipeline's order: F0 inside no_sync, F1
    outside, then B0, B1."""
    model = MiniDDP(nn.Linear(3, 1), process_group=group)
    x = torch.randn(2, 3)
    with model.no_sync():
        first = model(x[:1]).sum()
    last = model(x[1:]).sum()  # arms the all-reduce of the NEXT backward...
    first.backward()  # ... which is microbatch 0's: it reduces one microbatch's gradients
    try:
        last.backward()
    except RuntimeError as error:
        return str(error).split(": backward ran twice")[0]
    return "no error"


def dp_times_pp(schedule_class, mesh, m: int) -> float:
    """2 stages x 2 replicas, MiniDDP on each stage's data-parallel group, STEPS SGD steps;
    the largest difference of this rank's parameters from one process on the global batch."""
    stage_index, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    model = build_model(2).double()
    replicated = MiniDDP(model[stage_index], process_group=mesh["dp"].get_group())
    stage = PipelineStage(replicated, stage_index, 2, "cpu", group=mesh["pp"].get_group())
    schedule = schedule_class(stage, m, mse)
    reference = build_model(2).double()
    optimizers = [torch.optim.SGD(net.parameters(), lr=0.1) for net in (model, reference)]
    widths = (model[0][0].in_features, model[-1][0].out_features)
    for step in range(STEPS):
        x, y = (t.double() for t in batch(2 * m, step, *widths))  # the global batch
        mine = [t.tensor_split(2)[replica] for t in (x, y)]
        run_step(schedule, *mine)
        mse(reference(x), y).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert replicated.all_reduce_count == STEPS * len(replicated.buckets)  # one sync per step
    pairs = zip(model[stage_index].parameters(), reference[stage_index].parameters())
    return max((a - b).abs().max().item() for a, b in pairs)


def main() -> None:
    env = init_distributed()
    p, rank = env.world_size, env.rank
    checks: dict[str, bool] = {}
    say(f"Chapter 14: pipeline parallelism on {p} ranks, p = {p} stages")

    section("1. Split a model into stages")
    say(
        textwrap.dedent("""\
        A model of p blocks; stage s keeps block s (torch.distributed.pipelining's calls):

            stage = PipelineStage(model[rank], stage_index=rank, num_stages=p, device="cpu")
            schedule = ScheduleGPipe(stage, n_microbatches=m, loss_fn=mse)
            schedule.step(x) on stage 0, schedule.step(target=y, losses=losses) on the last,
            schedule.step() in between

        Nobody tells stage s the shape of what it will receive: the first time stage s-1 sends
        an activation, it sends a small header first (dtype and sizes), once.

        As in torch, a stage may return a tuple of tensors, (hidden, mask): the next stage is
        called with both, the first stage is given both as step(x, mask), and only the
        floating-point ones carry a gradient back. Validation runs forward only, with the same
        calls: schedule.eval(...), or step() of a schedule built with loss_fn=None.""")
    )
    model = build_model(p)
    stage = PipelineStage(model[rank], rank, p, "cpu")
    schedule = ScheduleGPipe(stage, 2, mse)
    run_step(schedule, *batch(2, 0, model[0][0].in_features, model[-1][0].out_features))
    learnt = schedule.input_shape or "the batch's own"
    linear = model[rank][0]
    parameters = sum(t.numel() for t in linear.parameters())
    say_all_ranks(
        f"stage {rank}: Linear({linear.in_features}, {linear.out_features}) + Tanh, "
        f"{parameters} parameters; input microbatch shape: {learnt}"
    )

    section("2. GPipe: fill, then drain")
    say(
        textwrap.dedent(f"""\
        All m forwards, then all m backwards (Huang et al., 2019). To see the schedule rather
        than this machine's noise, every stage's forward takes {FORWARD_S * 1e3:g} ms and its
        backward {BACKWARD_S * 1e3:g} ms (FixedCost sleeps; a sleeping rank uses no core).
        Measured, m = 4; stages down, time across, F/B and the microbatch, '.' idle:""")
    )
    m = 4
    gpipe_bubble, replayed, blocks, gpipe_peak = measure(ScheduleGPipe, timed_stage(rank, p), m)
    say(ascii_chart(blocks, CHART_COLUMNS))
    formula = bubble_formula(p, m)
    say(f"bubble: measured {gpipe_bubble:.3f}, formula (p-1)/(m+p-1) = {formula:.3f}")
    say(
        textwrap.dedent("""\
        Each transfer and each wake-up of a process adds a little idle time, more when other
        programs share the cores. The same orders replayed on a logical clock (bubble.replay:
        every F and B takes its time exactly, a transfer none) give the schedule's own bubble,""")
        + f" {replayed:.3f}."
    )
    say_peaks(gpipe_peak, m, p, rank)
    checks["GPipe holds all m microbatches"] = gpipe_peak == m
    checks["GPipe's order has the formula's bubble"] = on_the_formula(replayed, p, m)

    section("3. 1F1B: free each microbatch as early as possible")
    say(
        textwrap.dedent("""\
        Stage s warms up with min(m, p - s) forwards, then runs one backward and one forward in
        turn (PipeDream-Flush, Narayanan et al., 2021). A backward frees its microbatch's
        activations, so stage s never holds more than p - s, however large m grows:""")
    )
    one_bubble, replayed, blocks, one_peak = measure(Schedule1F1B, timed_stage(rank, p), m)
    say(ascii_chart(blocks, CHART_COLUMNS))
    say(
        f"bubble: measured {one_bubble:.3f}, replayed {replayed:.3f}, formula {formula:.3f}: "
        "the same idle time"
    )
    say(f"(both drawn at p = 4, m = 6: {FIGURE}, by python -m miniddp.figures --only 14)")
    say_peaks(one_peak, m, p, rank)
    checks["1F1B holds at most p - s"] = one_peak == min(m, p - rank)
    checks["1F1B's order has the formula's bubble"] = on_the_formula(replayed, p, m)

    section("4. The bubble against m")
    say(
        textwrap.dedent("""\
        The last stage starts after p - 1 forwards, and the first finishes p - 1 backwards after
        the last stage: a step lasts (m + p - 1)(t_f + t_b) while each stage computes for
        m (t_f + t_b). The idle share, (p - 1)/(m + p - 1), shrinks only as m grows; and m can
        grow only if memory allows, which is what 1F1B is for. Each order replayed, and
        measured (the median of 3 steps):""")
    )
    say(f"  {'':>3}  {'':>8}  {'GPipe':^18}  {'1F1B':^18}".rstrip())
    say(f"  {'m':>3}  {'formula':>8}" + f"  {'replayed':>8}  {'measured':>8}" * 2)
    replayed_all = []
    for m in (1, 2, 4, 8):
        runs = [measure(cls, timed_stage(rank, p), m) for cls in (ScheduleGPipe, Schedule1F1B)]
        replayed_all += [on_the_formula(replayed, p, m) for _, replayed, *_ in runs]
        row = "".join(f"  {replayed:>8.3f}  {measured:>8.3f}" for measured, replayed, *_ in runs)
        say(f"  {m:>3}  {bubble_formula(p, m):>8.3f}{row}")
    say("(measured runs a little above: transfers, wake-ups; the checks use the replayed bubble)")
    checks["both orders' bubbles are the formula's, m = 1, 2, 4, 8"] = all(replayed_all)

    section("5. The same training as one process")
    say(
        textwrap.dedent(f"""\
        Pipelining changes where a kernel runs, not what it computes. The gradient arriving
        at a stage's border is the one autograd computes there in one process, .grad adds
        microbatches 0 .. m-1 in that order in both schedules, each microbatch's loss divided
        by m (so a second step before optimizer.step() adds its gradient, as one process
        accumulating does; torch's default, scale_grads=True, divides all of .grad at each
        step's end instead). So after {STEPS} SGD steps, every stage's gradients, losses and
        parameters are one process's, bit for bit:""")
    )
    for cls in (ScheduleGPipe, Schedule1F1B):
        for m in (1, 3):
            same = same_as_one_process(cls, p, m)
            everyone = [None] * p
            dist.all_gather_object(everyone, same)
            say(f"  {cls.__name__:<13} m = {m}: bitwise on stages {everyone}")
            checks[f"{cls.__name__} m={m} bitwise"] = all(everyone)
    say(
        textwrap.dedent("""\
        Forward only, schedule.eval(x) on stage 0, eval(target=y, losses=losses) on the last,
        eval() between: the same forwards in the same order, under torch.no_grad():""")
    )
    everyone = [None] * p
    dist.all_gather_object(everyone, eval_as_one_process(p, m=3))
    say(f"  ScheduleGPipe m = 3, eval: outputs, losses bitwise, no .grad, on stages {everyone}")
    checks["eval bitwise, no .grad"] = all(everyone)

    section("6. DP x PP: pipelines side by side, each stage data-parallel")
    if p != 4:
        say(
            "(this section needs 4 ranks, 2 stages x 2 replicas: "
            "torchrun --nproc_per_node=4 tutorials/14_pipeline_parallel.py)"
        )
    else:
        say(
            textwrap.dedent("""\
            A (pp, dp) = (2, 2) mesh (miniddp.mesh.init_device_mesh, torch's layout): ranks 0, 1
            hold stage 0 and ranks 2, 3 stage 1; ranks 0 and 2 are one pipeline, 1 and 3 the
            other. The stage's copies average its gradients with MiniDDP over the mesh's "dp"
            group, mesh["dp"].get_group(). Accumulation over microbatches should all-reduce
            once, after the last microbatch's backward. Chapter 05's habit, the last forward
            outside no_sync, fails here: MiniDDP decides at FORWARD time, and in a pipeline
            other backwards run between the last forward and its backward:""")
        )
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        message = the_no_sync_trap(mesh["dp"].get_group())
        say(f"  F0 in no_sync, F1 outside, B0, B1 -> RuntimeError: {message}")
        checks["the trap is refused"] = "already synchronized" in message
        say(
            textwrap.dedent("""\
            So the stage runs every forward inside no_sync, and arms MiniDDP by hand right
            before the last microbatch's backward (prepare_for_backward, the name of the call
            torch's pipelining makes on its DDP's reducer; miniddp/pipeline/stage.py): nothing
            runs twice, dropout's masks and BatchNorm's statistics are those of the forward
            that ran, and the one backward that all-reduces carries all m microbatches'
            gradients. Against one process on the global batch (float64):""")
        )
        for cls in (ScheduleGPipe, Schedule1F1B):
            difference = dp_times_pp(cls, mesh, m=3)
            everyone = [None] * p
            dist.all_gather_object(everyone, difference)
            per_rank = ", ".join(f"{d:.1e}" for d in everyone)
            say(f"  {cls.__name__:<13} m = 3: largest difference on ranks 0-3: {per_rank}")
            checks[f"DP x PP {cls.__name__}"] = max(everyone) <= 1e-12

    section("Checks")
    for name, passed in checks.items():
        say(f"  {'ok ' if passed else 'FAILED'} {name}")
    assert all(checks.values()), [name for name, passed in checks.items() if not passed]
    dist.barrier()
    say(
        f"Verified on {p} ranks: both schedules train as one process does, their orders have\n"
        "the formula's bubble; GPipe holds m microbatches, 1F1B at most p - s."
    )
    end_chapter()


if __name__ == "__main__":
    main()
