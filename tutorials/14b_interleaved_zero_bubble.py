"""Chapter 14b: past 1F1B. v stages a rank (interleaved 1F1B), then the backward split in two
(zero bubble): the bubble measured against (p - 1)/(v m + p - 1), the memory and the bytes
each costs, and the same bits as one process.

    torchrun --nproc_per_node=4 tutorials/14b_interleaved_zero_bubble.py   (2 ranks work too)

Chapter 14 left the bubble at (p - 1)/(m + p - 1): only more microbatches shrink it. Cut the
model into v p stages instead, and a microbatch crosses the ranks v times, each visit 1/v of the
work: the pipe fills and drains in stage-times, v times shorter. Then split each backward into
the input's gradient (the one the rank upstream waits for) and the weights' (which nobody waits
for), and run the second in the idle slots.

    1. v stages a rank              stage s on rank s % p, the order as data
    2. interleaved 1F1B             measured against (p - 1)/(v m + p - 1)
    3. what it costs                activations held, bytes sent
    4. zero bubble                  the split, and its bubble on the logical clock
    5. the same training            bitwise one process, both schedules; accumulating steps

Exercise: tutorials/exercises/gpipe.py, step 2: turn 1F1B's order into interleaved 1F1B's. The
library is miniddp/pipeline/interleaved.py; the four schedules side by side are
docs/figures/14b_schedules.png (`python -m miniddp.figures --only 14b`).
"""

from __future__ import annotations

import statistics
import textwrap

import torch
import torch.distributed as dist
from common import end_chapter, say, say_all_ranks, say_prose, section
from torch import nn

from miniddp.job.env import init_distributed
from miniddp.observe.events import Recorder
from miniddp.pipeline import (
    FixedCost,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from miniddp.pipeline.bubble import (
    ascii_chart,
    bubble_formula,
    bubble_fraction,
    gather_blocks,
    peak_held,
    replay,
)
from miniddp.pipeline.interleaved import interleaved_order

V = 2  # stages a rank
WIDTH = 16
FORWARD_S, BACKWARD_S = 0.040, 0.080  # a RANK's forward and backward; a stage's are 1/v of it
STEPS = 3
FIGURE = "docs/figures/14b_schedules.png"


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def build_model(num_stages: int) -> nn.Sequential:
    """num_stages blocks of different widths (so every border has its own shape)."""
    torch.manual_seed(0)
    widths = [WIDTH + 2 * s for s in range(num_stages)] + [4]
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(widths, widths[1:])]
    )


def batch(m: int, step: int, width_in: int, width_out: int, samples: int = 2):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(m * samples, width_in, generator=generator)
    return x, torch.randn(m * samples, width_out, generator=generator)


def run_step(schedule, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The rank of stage 0 passes the batch, the rank of the last stage the target."""
    losses: list[torch.Tensor] = []
    if schedule.has_first_stage:
        schedule.step(x)
    elif schedule.has_last_stage:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    return losses


def timed_stages(p: int, v: int) -> list[PipelineStage]:
    """This rank's v stages, each 1/v of a rank's fixed cost (FixedCost sleeps: no core)."""
    rank = dist.get_rank()
    return [
        PipelineStage(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), FixedCost(FORWARD_S / v, BACKWARD_S / v)),
            rank + i * p,
            v * p,
            "cpu",
        )
        for i in range(v)
    ]


def measure(schedule_class, p: int, v: int, m: int) -> tuple[float, list, int, int]:
    """Four steps; the median bubble of the last three, the last step's blocks, the most
    microbatch-stages this rank held, and the bytes it sent in one step."""
    stages = timed_stages(p, v)
    schedule = schedule_class(stages if v > 1 else stages[0], m, mse)
    recorder = schedule.observer = Recorder()  # notes each block's start and end
    x, y = batch(m, 0, WIDTH, WIDTH)
    fractions, sent = [], 0
    for _ in range(4):
        dist.barrier()
        before = schedule.mailbox.bytes_sent
        run_step(schedule, x, y)
        sent = schedule.mailbox.bytes_sent - before
        blocks = gather_blocks(schedule, recorder.events)
        fractions.append(bubble_fraction(blocks))
    return statistics.median(fractions[1:]), blocks, schedule.peak_held, sent


def same_as_one_process(schedule_class, p: int, m: int) -> bool:
    """STEPS SGD steps of the real model on v p stages; then one process on the same
    microbatches, each loss divided by m. The same bits, on this rank's stages?"""
    rank = dist.get_rank()
    model, reference = build_model(V * p), build_model(V * p)
    indices = [rank + i * p for i in range(V)]
    stages = [PipelineStage(model[s], s, V * p, "cpu") for s in indices]
    schedule = schedule_class(stages, m, mse)
    mine = [param for s in indices for param in model[s].parameters()]
    theirs = [param for s in indices for param in reference[s].parameters()]
    optimizers = [torch.optim.SGD(mine, lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)]
    widths = (model[0][0].in_features, model[-1][0].out_features)
    same = True
    for step in range(STEPS):
        x, y = batch(m, step, *widths)
        losses = run_step(schedule, x, y)
        for xm, ym, loss in zip(x.tensor_split(m), y.tensor_split(m), losses or [None] * m):
            one = mse(reference(xm), ym)
            (one / m).backward()
            same &= loss is None or torch.equal(loss, one.detach())
        same &= all(torch.equal(a.grad, b.grad) for a, b in zip(mine, theirs))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return same and all(torch.equal(a, b) for a, b in zip(mine, theirs))


def two_steps_sum(schedule_class, p: int, m: int) -> bool:
    """Two steps, no optimizer step between: .grad is G1 + G2, one process accumulating."""
    rank = dist.get_rank()
    model, reference = build_model(V * p), build_model(V * p)
    indices = [rank + i * p for i in range(V)]
    schedule = schedule_class([PipelineStage(model[s], s, V * p, "cpu") for s in indices], m, mse)
    widths = (model[0][0].in_features, model[-1][0].out_features)
    for step in range(2):
        x, y = batch(m, step, *widths)
        run_step(schedule, x, y)
        for xm, ym in zip(x.tensor_split(m), y.tensor_split(m)):
            (mse(reference(xm), ym) / m).backward()
    pairs = [
        (a, b) for s in indices for a, b in zip(model[s].parameters(), reference[s].parameters())
    ]
    return all(torch.equal(a.grad, b.grad) for a, b in pairs)


def on_all(value) -> list:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def main() -> None:
    env = init_distributed()
    p, rank = env.world_size, env.rank
    checks: dict[str, bool] = {}
    say(f"Chapter 14b: interleaved and zero-bubble pipelines on p = {p} ranks, v = {V}")

    section("1. v stages a rank")
    say(
        textwrap.dedent(f"""\
        The model is cut into v p = {V * p} stages, and rank r builds stages r, r + p, ..,
        in that order (torch's layout: stage s on rank s % p); the schedule takes them all:

            stages = [PipelineStage(model[r + i * p], r + i * p, v * p, "cpu") for i in range(v)]
            schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=mse)

        A microbatch goes 0 -> 1 -> .. -> p-1 -> back to rank 0 for stage p -> .. A rank's
        order is data: each action names its kind, microbatch and stage (F3@2: the forward of
        microbatch 3 at stage 2). Rank {p - 1}'s, m = 4 (interleaved.py derives it):""")
    )
    say_all_ranks(f"rank {rank} holds stages {[rank + i * p for i in range(V)]}")
    say("  " + " ".join(map(str, interleaved_order(p - 1, p, V, 4))))

    section("2. Interleaved 1F1B: the bubble over v")
    say(
        textwrap.dedent(f"""\
        A rank's forward takes {FORWARD_S * 1e3:g} ms and its backward {BACKWARD_S * 1e3:g} ms
        (FixedCost), so each of its v stages takes half. Measured, m = 4, '.' idle,
        F3@2 the forward of microbatch 3 at stage 2:""")
    )
    bubble, blocks, _, _ = measure(ScheduleInterleaved1F1B, p, V, 4)
    say(ascii_chart(blocks))
    say(f"bubble {bubble:.3f}, (p-1)/(vm+p-1) = {bubble_formula(p, 4, V):.3f}")
    say(f"\n  {'m':>3}  {'schedule':<18} {'measured':>9} {'formula':>8} {'clock':>7}")
    table = {}
    for m in (4, 8):
        for name, cls, v in [
            ("GPipe", ScheduleGPipe, 1),
            ("1F1B", Schedule1F1B, 1),
            ("interleaved 1F1B", ScheduleInterleaved1F1B, V),
        ]:
            measured, _, peak, sent = measure(cls, p, v, m)
            if v == 1:
                orders = [cls.order(_Shape(r, p, m)) for r in range(p)]
            else:
                orders = [interleaved_order(r, p, V, m) for r in range(p)]
            clock = bubble_fraction(replay(orders))
            formula = bubble_formula(p, m, v)
            table[(name, m)] = (peak, sent)
            checks[f"{name} m={m}: the clock's bubble is the formula's"] = (
                abs(clock - formula) < 1e-12
            )
            say(f"  {m:>3}  {name:<18} {measured:>9.3f} {formula:>8.3f} {clock:>7.3f}")
    say(
        "(clock: the same orders on a logical clock, F = 1, B = 2 a rank, exact, which the "
        "checks use; measured: each transfer and wake-up adds a little, more on a busy machine)"
    )

    section("3. What interleaving costs: activations and bytes")
    m = 8
    per_round = m // max(1, m // p)
    formula = min(V * m, (V - 1) * per_round + 2 * (p - 1 - rank) + 1)
    peak, sent = table[("interleaved 1F1B", m)]
    one_peak, one_sent = table[("1F1B", m)]
    say(
        textwrap.dedent(f"""\
        Rank r warms up with (v - 1) R + 2 (p - 1 - r) forwards (R = {per_round} microbatches
        a round), so it holds up to that + 1 microbatch-stages, each half a rank's layers.
        1F1B holds p - r whole ones. And each microbatch crosses v p - 1 borders instead of
        p - 1, each way. At m = {m}:""")
    )
    say_all_ranks(
        f"rank {rank}: interleaved held {peak} microbatch-stages (formula {formula}, = "
        f"{peak / V:g} rank-microbatches; 1F1B {one_peak}); sent {sent} bytes (1F1B {one_sent})"
    )
    checks["interleaved holds its formula's activations"] = all(on_all(peak == formula))
    middle = rank not in (0, p - 1)  # rank 0 and p-1 of 1F1B send one way only
    ratio = sent / one_sent if one_sent else float("nan")
    say_all_ranks(
        f"rank {rank}: interleaving sends {ratio:.2f}x 1F1B's bytes "
        f"(a middle rank: {V}x, every stage's two borders)"
    )
    checks["a middle rank sends v times the bytes"] = all(
        on_all(not middle or abs(ratio - V) < 1e-9)
    )

    section("4. Zero bubble: the weights' gradient can wait")
    say(
        textwrap.dedent("""\
        A backward computes dL/dx = g W (stage s-1 waits for it) and dL/dW = g^T x (nobody
        does before the optimizer step). So B i splits into I i, run first and sent upstream at
        once, and W i, deferred (miniddp/pipeline/interleaved.py):

            I i:  torch.autograd.grad(output, [input], g, retain_graph=True)   no .grad touched
            W i:  torch.autograd.backward(output, g, inputs=parameters)        .grad, later

        The gradient goes upstream after I, not I + W, so every hop of the drain is shorter,
        and the W's fill the slots a rank would idle in. On the logical clock (F = I = W = 1 a
        stage), against the zero-bubble paper's (p - 1)(F + I - W) idle per rank over 3 v m of
        work, (p - 1)/(3 v m + p - 1):""")
    )
    say(f"  {'m':>3}  {'interleaved':>11} {'zero bubble':>11} {'paper':>7}  held: interleaved, ZB")
    held = {}
    for m in (4, 8):
        one = [interleaved_order(r, p, V, m) for r in range(p)]
        zb = [interleaved_order(r, p, V, m, zero_bubble=True) for r in range(p)]
        one_bubble, zb_bubble = (bubble_fraction(replay(o)) for o in (one, zb))
        paper = (p - 1) / (3 * V * m + p - 1)
        held[m] = [[peak_held(order) for order in orders] for orders in (one, zb)]
        say(f"  {m:>3}  {one_bubble:>11.3f} {zb_bubble:>11.3f} {paper:>7.3f}  {held[m]}")
        checks[f"zero bubble m={m}: the paper's bubble"] = abs(zb_bubble - paper) < 1e-12
    one_held, zb_held = held[4]
    say_prose(
        f"""\
        The price is memory: a microbatch-stage's activations stay until its W, so the last
        rank, which interleaved 1F1B let hold {one_held[-1]} microbatch-stages at m = 4, holds
        {zb_held[-1]}: every rank now holds as many as the first ({zb_held[0]}). On a real
        clock there is a second price: W walks the graph from the output again, as far as the
        weights (torch keeps the gradients between instead), so a sleeping layer would sleep
        in I and again in W; the clock, not a sleep, measures the order here, and the bits are
        checked below."""
    )
    checks["zero bubble holds more on the last rank"] = zb_held[-1] > one_held[-1]
    say(f"(all four schedules at p = 4, m = 8: {FIGURE})")

    section("5. The same training as one process")
    say(
        textwrap.dedent(f"""\
        Each stage still adds its microbatches' gradients in the order 0 .. m-1, whichever
        schedule, and W i is the same kernels on the same values as B's weight half. So after
        {STEPS} SGD steps, every stage's gradients, losses and parameters are one process's:""")
    )
    for cls in (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble):
        for m in (4, 8):
            everyone = on_all(same_as_one_process(cls, p, m))
            say(f"  {cls.__name__:<30} m = {m}: bitwise on ranks {everyone}")
            checks[f"{cls.__name__} m={m} bitwise"] = all(everyone)
    say(
        textwrap.dedent("""\
        Accumulating over steps (a batch too big for one): each step divides its own losses
        by m and adds to .grad, so two steps before optimizer.step() leave G1 + G2, as one
        process accumulating does; for their mean, divide in the loss: loss_fn = lambda out,
        y: mse(out, y) / steps. (torch's default, scale_grads=True, divides all of .grad at
        each step's end: G1/m + G2.)""")
    )
    for cls in (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble):
        everyone = on_all(two_steps_sum(cls, p, 4))
        say(f"  {cls.__name__:<30} two steps sum: {everyone}")
        checks[f"{cls.__name__}: two steps sum"] = all(everyone)

    section("Checks")
    failed = [name for name, passed in checks.items() if not passed]
    say(f"  {len(checks) - len(failed)} of {len(checks)} claims hold")
    assert not failed, f"failed: {failed}"
    dist.barrier()
    say(
        f"Verified on {p} ranks: interleaving v = {V} divides the bubble as (p-1)/(vm+p-1) "
        "says, for its activations and bytes; zero bubble leaves the paper's; both train as "
        "one process does, bit for bit."
    )
    end_chapter()


class _Shape:
    """Just what a one-stage schedule's `order()` reads, to list orders without processes."""

    def __init__(self, stage_index: int, num_stages: int, n_microbatches: int) -> None:
        self.n_microbatches = n_microbatches
        self.stage = type("Stage", (), {"stage_index": stage_index, "num_stages": num_stages})


if __name__ == "__main__":
    main()
