"""Bad input to a pipeline step is refused on EVERY stage, before any activation moves.

Each stage sees only its part of a step: the first the batch, the last the target, a middle one
nothing. A mistake seen by one stage alone would leave the others waiting for messages that
never come, until the process group's timeout. So at the start of each step every stage states
what it found, as seven numbers, in one small all-reduce over the pipeline's group; then every
stage raises the same error, naming the stage, the problem and the fix:

    code, a, b            a problem and its two numbers (0 = none)
    n_microbatches        the schedules must agree on m ...
    schedule              ... and on the schedule, or their orders of sends would not match ...
    backward              ... and on whether the step trains (step() with a loss_fn) or runs
                          forward only (eval(), or no loss_fn): else one waits for gradients
    grad off              a training step under torch.no_grad() would fail in autograd, on
                          one stage, with the others left waiting: refused on all, saying
                          to call eval() (torch's advice too)

The price is one tiny collective per step (tens of microseconds on gloo). In the first step,
one more gathers every stage's order and replays them on a logical clock (bubble.replay), so
orders that would wait for each other forever are refused too, instead of hanging.
"""

from __future__ import annotations

import zlib
from enum import IntEnum
from typing import NamedTuple

import torch
import torch.distributed as dist

from miniddp.job.agree import gather_rows
from miniddp.pipeline.actions import decode
from miniddp.pipeline.bubble import replay


class Problem(IntEnum):
    NONE = 0
    NO_INPUT = 1
    INPUT_NOT_DIVISIBLE = 2
    INPUT_SHAPE_CHANGED = 3
    NO_TARGET = 4
    TARGET_NOT_DIVISIBLE = 5
    INPUT_NOT_ON_FIRST = 6
    BAD_ORDER = 7
    BAD_STAGES = 8
    INPUT_NOT_TENSORS = 9
    TARGET_WITHOUT_LOSS_FN = 10
    NO_LOSSES_TO_FILL = 11


def describe(problem: Problem, a: int, b: int) -> str:
    """The problem a stage found, and its fix."""
    return {
        Problem.NO_INPUT: "was given no input: call schedule.step(x) on the first stage",
        Problem.INPUT_NOT_TENSORS: (
            "was given an input that is not a tensor of at least one dimension: step(*args) "
            "takes the batch's tensors, each split into microbatches along dim 0"
        ),
        Problem.TARGET_WITHOUT_LOSS_FN: (
            "was given a target, but its schedule has no loss_fn (it runs forward only): build "
            "it with loss_fn=... to compute losses, or leave target out"
        ),
        Problem.NO_LOSSES_TO_FILL: (
            "was given a losses list but no target, so no loss is computed: pass "
            "target=y too (with a schedule that has a loss_fn), or leave losses out"
        ),
        Problem.INPUT_NOT_DIVISIBLE: (
            f"was given a batch of {a} samples, which n_microbatches={b} does not divide into "
            f"equal microbatches: give a batch whose size is a multiple of {b}, or an "
            f"n_microbatches that divides {a}"
        ),
        Problem.INPUT_SHAPE_CHANGED: (
            f"was given microbatches of {a} samples, but the pipeline learnt its activation "
            f"shapes from the first training step's {b}: keep the batch size fixed "
            "(drop_last=True in the DataLoader), or build a new stage and schedule for the new "
            "size (eval() takes any size)"
        ),
        Problem.NO_TARGET: (
            "was given no target: call schedule.step(target=y, losses=losses) on the last "
            "stage, which computes the loss"
        ),
        Problem.TARGET_NOT_DIVISIBLE: (
            f"was given a target of {a} samples, which n_microbatches={b} does not divide: "
            f"give a target (and a batch) whose size is a multiple of {b}"
        ),
        Problem.BAD_ORDER: (
            "has a schedule whose order() is not one stage's order of a step: it must list "
            "Action('F', i) and Action('B', i) once each for i in 0 .. m-1, F i before B i "
            "(or I i then W i in place of B i; at each of the rank's stages)"
        ),
        Problem.BAD_STAGES: (
            "cannot run its schedule's stages: give the schedule this rank's stages, "
            "stage_index = rank + i * W for i = 0 .. v-1, in that order (a V schedule: "
            "rank and 2W - 1 - rank)"
        ),
        Problem.INPUT_NOT_ON_FIRST: (
            "was given an input, but only the first stage takes one (the others receive their "
            "activations): call schedule.step() on a middle stage, "
            "schedule.step(target=y, losses=losses) on the last"
        ),
    }[problem]


Found = tuple[Problem, int, int] | tuple[Problem, int, int, str]  # and why, for this rank


def schedule_id(schedule_name: str) -> int:
    """A number for the schedule's class name, the same on every rank."""
    return zlib.crc32(schedule_name.encode()) & 0x7FFFFFFF


class CheckRow(NamedTuple):
    """What each stage adds to the check before a step: one all-reduce of these int64s."""

    problem: int  # a Problem's code (NONE: nothing wrong here)
    a: int  # its two numbers
    b: int
    n_microbatches: int
    schedule: int  # schedule_id of its class
    trains: int  # step() (1) or eval() (0)
    without_grad: int  # step() called under torch.no_grad()
    relearn: int  # the first stage's microbatches changed shape since the borders learnt them


def check_on_every_stage(
    found: Found,
    n_microbatches: int,
    schedule_name: str,
    group: dist.ProcessGroup | None,
    device: torch.device,
    who: str = "stage",
    backward: bool = True,
    relearn: bool = False,
) -> bool:
    """Gather every rank's findings; raise the same error on all of them if any is wrong.
    `who`: how a rank is named, "stage" (one stage a rank) or "rank" (several); `backward`:
    this rank's step trains (else it runs forward only); `relearn`: this rank's first stage
    was given microbatches of other shapes than the borders learnt. Returns whether any rank
    said so: then every border learns its shapes again, on every rank alike."""
    problem, a, b, *detail = found
    grad_off = backward and not torch.is_grad_enabled()
    mine = CheckRow(
        int(problem), a, b, n_microbatches, schedule_id(schedule_name), backward, grad_off, relearn
    )
    rows = [
        CheckRow(*row)
        for row in gather_rows(list(mine), "the pipeline step's check of its inputs", group, device)
    ]
    here = dist.get_rank(group)
    without_grad = [str(rank) for rank, row in enumerate(rows) if row.without_grad]
    if without_grad:
        raise RuntimeError(
            f"schedule.step() was called under torch.no_grad() (on {who} "
            f"{', '.join(without_grad)}): step() trains, and its backward needs autograd; "
            "call schedule.eval(...) instead for a forward-only run"
        )
    lines = [
        f"{who} {rank} {describe(Problem(code), a, b)}"
        + (f" (here: {detail[0]})" if rank == here and detail else "")
        for rank, (code, a, b, *_) in enumerate(rows)
        if code != Problem.NONE
    ]
    counts = sorted({row.n_microbatches for row in rows})
    if len(counts) > 1:
        per_stage = ", ".join(
            f"stage {stage}: {row.n_microbatches}" for stage, row in enumerate(rows)
        )
        lines.append(
            f"the stages' schedules have different n_microbatches ({per_stage}): "
            "build every stage's schedule with the same n_microbatches"
        )
    if len({row.trains for row in rows}) > 1:
        trains = [str(rank) for rank, row in enumerate(rows) if row.trains]
        forward = [str(rank) for rank, row in enumerate(rows) if not row.trains]
        lines.append(
            f"{who} {', '.join(trains)} called step() to train, {who} {', '.join(forward)} "
            "runs forward only (eval(), or a schedule with loss_fn=None): call step() on "
            "every stage, each schedule built with a loss_fn, or eval() on every stage"
        )
    if len({row.schedule for row in rows}) > 1:
        lines.append(
            "the stages run different schedule classes (e.g. GPipe on one, 1F1B on another): "
            "their sends would not match; use one schedule class everywhere"
        )
    if lines:
        raise ValueError(
            f"This pipeline step cannot run (seen on stage {here}):\n  " + "\n  ".join(lines)
        )
    return any(row.relearn for row in rows)


def check_orders_together(
    my_order: list[int], group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """Each rank's order may be valid alone and the orders still wait for each other forever
    (stage 0 waiting for gradient 0 before sending activation 1, which stage 1 needs first).
    Gather every rank's order (encoded, miniddp/pipeline/actions.py, zero-padded to one
    length) and replay them on a logical clock: a deadlock is refused on every rank, before
    anything is sent."""
    rows = gather_rows(my_order, "the pipeline's check of its schedule's orders", group, device)
    try:
        replay([decode(row) for row in rows])
    except ValueError as deadlock:
        raise ValueError(
            f"This pipeline's schedule cannot run: {deadlock}. Stage s can run F i only after "
            "stage s-1 did, and B i (or I i) only after stage s+1 did: reorder order() so that "
            "every rank's next action is always possible (compare ScheduleGPipe, Schedule1F1B, "
            "ScheduleInterleaved1F1B)."
        ) from None
