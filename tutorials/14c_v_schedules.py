"""Chapter 14c: the V. Two stages a rank, the first and its mirror (ZB-V, DualPipeV): their
orders beside interleaved 1F1B's, the bubble on the logical clock against the papers' formulas,
the activations each rank holds, what DualPipe's overlap would add, and the same bits as one
process and as torch's schedules.

    torchrun --nproc_per_node=4 tutorials/14c_v_schedules.py   (2 ranks work too)

Chapter 14b cut the model into 2p stages and looped them over the ranks, stage s on rank s % p.
The V places the same 2p stages down and back up: stage s on rank s below p, on rank 2p - 1 - s
from p on. The batch goes in and the loss comes out on rank 0; the turn, stages p - 1 and p, is
on one rank, so no message crosses it; and every rank's two stages are as far from the turn.

    1. the V                       rank r holds r and 2p - 1 - r
    2. the orders                  interleaved 1F1B, ZB-V and DualPipeV on the logical clock
    3. the bubble                  against Megatron's, the zero-bubble paper's and DeepSeek's
    4. the activations             held per rank: even in the V
    5. DualPipe's overlap          what the order buys here, and what only a GPU's streams would
    6. the same training           bitwise one process and torch's schedules of the same names

The library is miniddp/pipeline/v_schedules.py: two orders and a placement; the executor, the
checks and the split backward are chapter 14b's.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.distributed as dist
from common import end_chapter, say, say_all_ranks, say_prose, section
from torch import nn

from miniddp.job.env import init_distributed
from miniddp.pipeline import PipelineStage, ScheduleDualPipeV, ScheduleZBVZeroBubble
from miniddp.pipeline.bubble import peak_held, replay
from miniddp.pipeline.interleaved import interleaved_order
from miniddp.pipeline.v_schedules import dualpipev_order, v_placement, v_stages, zbv_order

F, B, W = 1, 2, 1  # the logical clock's costs of a stage's forward, backward, weight half
STEPS = 2


def orders(name: str, p: int, m: int) -> list:
    """Every rank's order of one of the three schedules (the library's own functions)."""
    make = {
        "interleaved 1F1B": lambda r: interleaved_order(r, p, 2, m),
        "ZB1P": lambda r: interleaved_order(r, p, 2, m, zero_bubble=True),
        "ZB-V": lambda r: zbv_order(r, p, m),
        "DualPipeV": lambda r: dualpipev_order(r, p, m),
    }[name]
    return [make(r) for r in range(p)]


def idle(blocks) -> tuple[list[float], list[float]]:
    """Each rank's idle time over the whole step, and inside its own span (first to last)."""
    end = max(b.end for row in blocks for b in row)
    busy = [sum(b.duration for b in row) for row in blocks]
    spans = [max(b.end for b in row) - min(b.start for b in row) for row in blocks]
    return [end - t for t in busy], [s - t for s, t in zip(spans, busy)]


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def build_model(p: int) -> nn.Sequential:
    torch.manual_seed(0)
    widths = [12 + s for s in range(2 * p)] + [4]  # every border its own shape
    return nn.Sequential(*[nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in pairwise(widths)])


def batch(model: nn.Sequential, m: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(2 * m, model[0][0].in_features, generator=generator)
    return x, torch.randn(2 * m, model[-1][0].out_features, generator=generator)


def train(schedule_class, p: int, m: int, torchs: bool = False) -> tuple[list, int]:
    """STEPS SGD steps on this rank's two stages of the V; its parameters after, and the most
    microbatch-stages it held (ours). torch's schedule is given each loss / m and told not to
    scale, the same arithmetic as ours."""
    rank, model = dist.get_rank(), build_model(p)
    indices = v_stages(rank, p)
    if torchs:
        from torch.distributed.pipelining import PipelineStage as TorchStage
        from torch.distributed.pipelining import schedules

        stages = [TorchStage(model[s], s, 2 * p, "cpu") for s in indices]
        cls = getattr(schedules, schedule_class.__name__)
        schedule = cls(stages, m, loss_fn=lambda out, y: mse(out, y) / m, scale_grads=False)
    else:
        stages = [PipelineStage(model[s], s, 2 * p, "cpu") for s in indices]
        schedule = schedule_class(stages, m, mse)
    params = [param for s in indices for param in model[s].parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    for step in range(STEPS):
        x, y = batch(model, m, step)
        schedule.step(x, target=y) if rank == 0 else schedule.step()
        optimizer.step()
        optimizer.zero_grad()
    return [param.detach().clone() for param in params], getattr(schedule, "peak_held", 0)


def one_process(p: int, m: int) -> list[torch.Tensor]:
    """The same steps in one process, each microbatch's loss / m: this rank's stages' params."""
    model = build_model(p)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch(model, m, step)
        for xm, ym in zip(x.tensor_split(m), y.tensor_split(m)):
            (mse(model(xm), ym) / m).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [param.detach() for s in v_stages(dist.get_rank(), p) for param in model[s].parameters()]


def on_all(value) -> list:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def main() -> None:
    env = init_distributed()
    p, rank = env.world_size, env.rank
    m = 2 * p  # DualPipeV's fewest: a microbatch a stage
    checks: dict[str, bool] = {}
    say(f"Chapter 14c: the V-shaped pipelines on p = {p} ranks, 2p = {2 * p} stages")

    section("1. The V")
    loop = [s % p for s in range(2 * p)]
    say_prose(
        f"""\
        The rank of each stage 0 .. {2 * p - 1}, looped (chapter 14b) and in the V:

            loop  {loop}
            V     {v_placement(p)}

        Rank r builds its first stage, then its mirror, and gives the schedule both:

            stages = [PipelineStage(model[s], s, 2 * p, "cpu") for s in (r, 2 * p - 1 - r)]
            schedule = ScheduleZBVZeroBubble(stages, n_microbatches=m, loss_fn=mse)
            schedule.step(x, target=y) if r == 0 else schedule.step()"""
    )
    say_all_ranks(f"rank {rank} holds stages {list(v_stages(rank, p))}")

    section("2. The orders")
    say_prose(
        f"""\
        Each schedule is an order per rank (F3@7: microbatch 3's forward at stage 7; I and W
        the backward's halves, chapter 14b). Rank 0's, m = {m}, where interleaved 1F1B holds
        stages 0 and {p} and the V 0 and {2 * p - 1}, the first and the last:"""
    )
    for name in ("interleaved 1F1B", "ZB-V", "DualPipeV"):
        say(f"  {name + ':':<17} " + " ".join(map(str, orders(name, p, m)[0])))
    say_prose(
        """\
        ZB-V (Qi et al., 2024, section 6) warms up down the V, then runs F, I, W on one stage
        and F, I, W on the other. DualPipeV (DeepSeek-V3's DualPipe, in its V) runs pairs, a
        forward at one stage and a whole backward at the other (F4@7 B0@0), splitting only its
        tail. The loop's rank 0 waits for its gradients to come back from rank p - 1; the V's
        last stage is its own."""
    )

    section("3. The bubble, against the papers")
    say_prose(
        f"""\
        Idle time per rank, in units of a stage's forward, m = {m} and {4 * p}. The formulas,
        per stage as in DeepSeek-V3's table: interleaved 1F1B (p - 1)(F + B); ZB1P (p - 1)(F
        + B - 2W); ZB-V none inside a rank's own span when F = I = W (the zero-bubble paper),
        only the start-up, each rank beginning or ending p - 1 forwards apart; DualPipeV at
        most (p - 1)(F&B + B - 3W), with F&B = F + B here (no overlap: section 5)."""
    )
    formulas = {
        "interleaved 1F1B": (p - 1) * (F + B),
        "ZB1P": (p - 1) * (F + B - 2 * W),
        "ZB-V": p - 1,
        "DualPipeV": (p - 1) * ((F + B) + B - 3 * W),
    }
    say(f"  {'schedule':<17} {'m':>3} {'formula':>8}   idle per rank: in the step, in its own span")
    for count in (m, 2 * m):
        for name, formula in formulas.items():
            whole, own = idle(replay(orders(name, p, count), F, B))
            rows = f"{[round(t) for t in whole]}, {[round(t) for t in own]}"
            say(f"  {name:<17} {count:>3} {formula:>8}   {rows}")
            if name == "DualPipeV":
                checks[f"DualPipeV m={count}: under DeepSeek's bound"] = max(whole) <= formula
            else:
                checks[f"{name} m={count}: the formula's idle"] = whole == [formula] * p
            if name == "ZB-V":
                checks[f"ZB-V m={count}: no idle slot inside a rank's span"] = own == [0] * p
    say_prose(
        """\
        The split backward is what removes the bubble: ZB1P (chapter 14b's loop), ZB-V and
        DualPipeV all idle a third of interleaved 1F1B's on this clock, the same steps. What
        ZB-V changes is where: no rank idles inside its own span, only at its two ends (the
        ramp every pipeline has), where ZB1P's and DualPipeV's rank 0 waits inside. And in
        both V's the turn sends nothing: one border of 2p - 1 fewer on the wire each way."""
    )

    section("4. The activations each rank holds")
    held = {name: [peak_held(o) for o in orders(name, p, m)] for name in formulas}
    say_prose(
        f"""\
        Most microbatch-stages held at once (each half a rank's layers), m = {m}: interleaved
        1F1B holds most on rank 0 and least on the last, whose stages are nearest the loss;
        the split schedules hold as much on every rank, 2p = {2 * p} for ZB1P and ZB-V (p
        rank-microbatches, 1F1B's rank 0) and 2p + 1 = {2 * p + 1} for DualPipeV (DeepSeek's
        PP + 1): a stage holds a microbatch until its W, and the W's keep pace."""
    )
    for name, peaks in held.items():
        say(f"  {name:<17} {peaks}")
    checks["ZB-V holds 2p on every rank"] = held["ZB-V"] == [2 * p] * p
    checks["DualPipeV holds 2p + 1 on every rank"] = held["DualPipeV"] == [2 * p + 1] * p

    section("5. DualPipe's overlap: a GPU's trick")
    say_prose(
        """\
        DualPipe pairs the forward of one microbatch with the backward of another and runs the
        two at once, on two CUDA streams: while one computes, the other's communication moves
        (in DeepSeek-V3, the experts' all-to-all dispatch and combine, about as long as the
        compute, 1:1 in their report). Here the pair runs one action after the other, the
        forward first, as torch's schedule runs it unless given an overlapped function. What
        the ORDER alone buys, measured
        above: a third of interleaved 1F1B's bubble, as ZB-V; 2p + 1 microbatch-stages held
        on every rank; and a step of pairs, each a forward and a backward of different
        microbatches, which is what makes the overlap possible at all. What only the OVERLAP
        would buy: F&B shorter than F + B, by up to the communication one hides behind the
        other's compute; every pair of the steady state gains that, and the bubble's F&B term
        with it. A CPU has no second stream to hide it in, and this
        pipeline's own sends already never block (chapter 14), so nothing here shows it."""
    )

    section("6. The same training as one process and torch")
    reference = one_process(p, m)
    for cls in (ScheduleZBVZeroBubble, ScheduleDualPipeV):
        ours, peak = train(cls, p, m)
        theirs, _ = train(cls, p, m, torchs=True)
        same = all(torch.equal(a, b) for a, b in zip(ours, reference))
        same_torch = all(torch.equal(a, b) for a, b in zip(ours, theirs))
        expected = held["ZB-V" if cls is ScheduleZBVZeroBubble else "DualPipeV"][rank]
        everyone = on_all((same, same_torch, peak == expected))
        every = [all(row[k] for row in everyone) for k in range(3)]
        say(
            f"  {cls.__name__:<22} bitwise one process {every[0]}, torch's {every[1]}; "
            f"holds as its order says {every[2]}"
        )
        checks[f"{cls.__name__}: bitwise one process and torch's"] = all(
            a and b for a, b, _ in everyone
        )
        checks[f"{cls.__name__}: holds what its order says"] = all(c for *_, c in everyone)

    section("Checks")
    for name, passed in checks.items():
        say(f"  {'ok ' if passed else 'FAILED'} {name}")
    assert all(checks.values()), [name for name, passed in checks.items() if not passed]
    dist.barrier()
    say(
        f"Verified on {p} ranks: the V idles as the papers say, holds evenly, and trains "
        "bit for bit."
    )
    end_chapter()


if __name__ == "__main__":
    main()
