"""A pipeline step as blocks: ranks down, time across, one block per forward or backward.

    recorder = schedule.observer = Recorder() # before step() (miniddp/observe/events.py)
    blocks = gather_blocks(schedule, recorder.events)  # every stage's last step, on every rank
    print(ascii_chart(blocks))                # the classic picture, in text
    bubble_fraction(blocks)                   # the idle share of the step, measured

The *bubble* of a step is the share of stage-time spent idle:

    bubble = 1 - (time all stages spent computing) / (p * makespan)

where the makespan runs from the first forward's start to the last backward's end, and p is the
number of ranks (lanes). With every F taking t_f and every B t_b, GPipe and 1F1B both give
(p - 1) / (m + p - 1) (schedule.py); interleaving v stages a rank, (p - 1) / (v m + p - 1)
(interleaved.py).

`replay(orders)` runs every rank's order on a logical clock instead of a real one (each F costs
`forward_cost`, each B `backward_cost`, an I or a W half a B, communication nothing):
deterministic, so tests can hold a schedule to the formula exactly, with no timing at all.

A layer that takes a fixed time: compute made deterministic, to measure a schedule.

On a shared laptop, how long a forward takes varies from one microbatch to the next, and the
stages' processes steal each other's cores. The bubble formula assumes every F takes t_f and
every B takes t_b. `FixedCost(t_f, t_b)` makes that true: it passes its input through unchanged
and sleeps t_f in forward and t_b in backward. A sleeping process uses no core, so four stages
on two cores still run side by side.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from miniddp.observe.events import Event
from miniddp.pipeline.actions import (
    BACKWARD,
    FORWARD,
    FREES,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
)

KIND_OF_EVENT = {"forward": FORWARD, "backward": BACKWARD, "input": INPUT_GRAD}
KIND_OF_EVENT["weight"] = WEIGHT_GRAD


@dataclass(frozen=True)
class Block:
    """Rank `rank` computing F, B, I or W of `microbatch` at `stage`, from `start` to `end`
    (seconds, or logical time units)."""

    rank: int
    kind: str  # "F", "B", "I" or "W"
    microbatch: int
    start: float
    end: float
    stage: int

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def label(self) -> str:
        return f"{self.kind}{self.microbatch}"


def blocks_of(events: Sequence[Event], rank: int) -> list[Block]:
    """The blocks of the LAST step in `events` (a schedule's `events`)."""
    starts = [i for i, e in enumerate(events) if (e.kind, e.name) == ("step", "start")]
    if not starts:
        raise ValueError(
            "no step was recorded: attach a Recorder before step(), "
            "schedule.observer = Recorder() (miniddp/observe/events.py)"
        )
    opened: dict[tuple[str, int, int], float] = {}
    blocks = []
    for event in events[starts[-1] :]:
        if event.kind not in KIND_OF_EVENT:
            continue
        edge, microbatch, stage = event.name.split()
        key = (KIND_OF_EVENT[event.kind], int(microbatch), int(stage))
        if edge == "start":
            opened[key] = event.time
        else:
            kind, i, stage = key
            blocks.append(Block(rank, kind, i, opened.pop(key), event.time, stage))
    return blocks


def gather_blocks(schedule, events: Sequence[Event]) -> list[list[Block]]:
    """Every rank's blocks of the last step in `events` (what its `schedule` noted), on every
    rank (one all_gather_object over the pipeline's group; every rank must call it)."""
    stage = schedule.stage
    mine = blocks_of(events, stage.rank)
    everyone: list = [None] * stage.group_size
    dist.all_gather_object(everyone, mine, group=stage.group)
    return everyone


def bubble_fraction(blocks: Sequence[Sequence[Block]]) -> float:
    """1 - busy / (p * makespan), over every rank's blocks of one step."""
    every = [block for stage in blocks for block in stage]
    makespan = max(b.end for b in every) - min(b.start for b in every)
    busy = sum(b.duration for b in every)
    return 1 - busy / (len(blocks) * makespan)


def bubble_formula(ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """(p - 1) / (v m + p - 1), p ranks of v stages each: the bubble of GPipe and 1F1B (v = 1)
    and of interleaved 1F1B, when every F and every B take the same time on every stage (a
    stage's share, 1/v, of its rank's layers), and communication none."""
    return (ranks - 1) / (stages_per_rank * n_microbatches + ranks - 1)


def replay(
    orders: Sequence[Sequence[Action]], forward_cost: float = 1.0, backward_cost: float = 2.0
) -> list[list[Block]]:
    """Run each rank's order on a logical clock: an action starts when its rank is free and
    what it needs is done. F i at stage s needs F i at s-1; B i or I i at s needs the input
    gradient of s+1 (its B i or I i), or at the last stage its own F i; W i follows its I i.
    An action naming no stage is rank r's stage r. Raises if the orders deadlock."""
    p = len(orders)
    orders = [[Action(*a).at(r) for a in order] for r, order in enumerate(orders)]
    last = max(a.stage for order in orders for a in order)
    cost = {FORWARD: forward_cost, BACKWARD: backward_cost}
    cost[INPUT_GRAD] = cost[WEIGHT_GRAD] = backward_cost / 2
    done: dict[tuple[str, int, int], float] = {}  # (F or "grad", stage, microbatch) -> end
    free_at = [0.0] * p
    position = [0] * p
    blocks: list[list[Block]] = [[] for _ in range(p)]
    while any(position[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if position[r] == len(orders[r]):
                continue
            kind, i, s = orders[r][position[r]]
            if kind == FORWARD:
                needs = (FORWARD, s - 1, i) if s > 0 else None
            elif kind == WEIGHT_GRAD:
                needs = ("grad", s, i)  # its own I i, earlier in this rank's order
            else:
                needs = ("grad", s + 1, i) if s < last else (FORWARD, s, i)
            if needs is not None and needs not in done:
                continue
            start = max(free_at[r], done[needs] if needs is not None else 0.0)
            end = free_at[r] = start + cost[kind]
            if kind != WEIGHT_GRAD:
                done[(FORWARD if kind == FORWARD else "grad", s, i)] = end
            blocks[r].append(Block(r, kind, i, start, end, s))
            position[r] += 1
            progressed = True
        if not progressed:
            stuck = [r for r in range(p) if position[r] < len(orders[r])]
            one_each = all(a.stage == r for r, order in enumerate(orders) for a in order)
            waiting = [
                f"stage {r} at {orders[r][position[r]]._replace(stage=None)}"
                if one_each
                else f"rank {r} at {orders[r][position[r]]}"
                for r in stuck
            ]
            raise ValueError(f"these orders deadlock: {', '.join(waiting)} wait forever")
    return blocks


def peak_held(order: Sequence[Action]) -> int:
    """How many microbatch-stages' activations a rank running `order` holds at most: each F
    keeps one until its B (or, split, its W: the weights' gradient needs the layers' inputs)."""
    held = peak = 0
    for kind, *_ in order:
        held += 1 if kind == FORWARD else -1 if kind in FREES else 0
        peak = max(peak, held)
    return peak


def held_formula(ranks: int, n_microbatches: int, stages_per_rank: int = 1, rank: int = 0) -> int:
    """What `peak_held` finds in `rank`'s order, as a formula: 1F1B's min(m, p - r)
    (schedule.py), or interleaved 1F1B's warm-up + 1, min((v - 1) R + 2 (p - 1 - r) + 1, v m)
    microbatch-stages with R = m // max(1, m // p) (interleaved.py). A planner multiplies it by
    a microbatch-stage's activations, without building the order."""
    p, m, v = ranks, n_microbatches, stages_per_rank
    if v == 1:
        return min(m, p - rank)
    per_round = m // max(1, m // p)
    return min((v - 1) * per_round + 2 * (p - 1 - rank) + 1, v * m)


def ascii_chart(blocks: Sequence[Sequence[Block]], columns: int = 96) -> str:
    """The classic picture: one row per rank, `columns` characters across the step. A block is
    its label (F3, B3, I3, W3; F3@2 at stage 2 where ranks hold several, as Action writes it)
    padded with '-' ('=' for B and I, '~' for W) to its length; '.' is idle."""
    every = [block for stage in blocks for block in stage]
    origin = min(b.start for b in every)
    scale = columns / (max(b.end for b in every) - origin)
    one_each = all(b.stage == b.rank for b in every)
    rows = []
    for rank, rank_blocks in enumerate(blocks):
        row = ["."] * columns
        for block in rank_blocks:
            first = round((block.start - origin) * scale)
            last = max(first + 1, round((block.end - origin) * scale))
            fill = {FORWARD: "-", WEIGHT_GRAD: "~"}.get(block.kind, "=")
            label = block.label if one_each else f"{block.label}@{block.stage}"
            text = (label + fill * columns)[: last - first]
            row[first:last] = text
        rows.append(f"{'stage' if one_each else 'rank'} {rank} |{''.join(row[:columns])}|")
    return "\n".join(rows)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.backward_s)
        return grad, None, None


class FixedCost(nn.Module):
    """Identity in values; `forward_s` seconds in forward, `backward_s` in backward."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.forward_s, self.backward_s)

    def extra_repr(self) -> str:
        return f"forward={self.forward_s * 1e3:g} ms, backward={self.backward_s * 1e3:g} ms"
