"""A pipeline step as blocks: stages down, time across, one block per forward or backward.

    blocks = gather_blocks(schedule)          # every stage's last recorded step, on every rank
    print(ascii_chart(blocks))                # the classic picture, in text
    bubble_fraction(blocks)                   # the idle share of the step, measured

The *bubble* of a step is the share of stage-time spent idle:

    bubble = 1 - (time all stages spent computing) / (p * makespan)

where the makespan runs from the first forward's start to the last backward's end. With every
F taking t_f and every B t_b, GPipe and 1F1B both give (p - 1) / (m + p - 1) (schedule.py).

`replay(orders)` runs the same orders on a logical clock instead of a real one (each F costs
`forward_cost`, each B `backward_cost`, communication nothing): deterministic, so tests can hold
a schedule to the formula exactly, with no timing at all.

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
from miniddp.pipeline.actions import BACKWARD, FORWARD, Action

KIND_OF_EVENT = {"forward": FORWARD, "backward": BACKWARD}


@dataclass(frozen=True)
class Block:
    """Stage `stage` computing F or B of `microbatch`, from `start` to `end` (seconds)."""

    stage: int
    kind: str  # "F" or "B"
    microbatch: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def label(self) -> str:
        return f"{self.kind}{self.microbatch}"


def blocks_of(events: Sequence[Event], stage: int) -> list[Block]:
    """The F and B blocks of the LAST step in `events` (a schedule's `events`)."""
    starts = [i for i, e in enumerate(events) if (e.kind, e.name) == ("step", "start")]
    if not starts:
        raise ValueError("no step was recorded: call schedule.record_events() before step()")
    opened: dict[tuple[str, int], float] = {}
    blocks = []
    for event in events[starts[-1] :]:
        if event.kind not in KIND_OF_EVENT:
            continue
        edge, microbatch = event.name.split()
        key = (KIND_OF_EVENT[event.kind], int(microbatch))
        if edge == "start":
            opened[key] = event.time
        else:
            blocks.append(Block(stage, *key, opened.pop(key), event.time))
    return blocks


def gather_blocks(schedule) -> list[list[Block]]:
    """Every stage's blocks of its last recorded step, on every stage (one all_gather_object
    over the pipeline's group; every stage must call it)."""
    stage = schedule.stage
    mine = blocks_of(schedule.events or [], stage.stage_index)
    everyone: list = [None] * stage.num_stages
    dist.all_gather_object(everyone, mine, group=stage.group)
    return everyone


def bubble_fraction(blocks: Sequence[Sequence[Block]]) -> float:
    """1 - busy / (p * makespan), over every stage's blocks of one step."""
    every = [block for stage in blocks for block in stage]
    makespan = max(b.end for b in every) - min(b.start for b in every)
    busy = sum(b.duration for b in every)
    return 1 - busy / (len(blocks) * makespan)


def bubble_formula(num_stages: int, n_microbatches: int) -> float:
    """(p - 1) / (m + p - 1): the bubble of GPipe and 1F1B when every F and every B take the
    same time on every stage, and communication none."""
    return (num_stages - 1) / (n_microbatches + num_stages - 1)


def replay(
    orders: Sequence[Sequence[Action]], forward_cost: float = 1.0, backward_cost: float = 2.0
) -> list[list[Block]]:
    """Run each stage's order on a logical clock: an action starts when its stage is free and
    what it needs is done (F i on stage s needs F i on s-1; B i needs B i on s+1, or on the
    last stage its own F i). Raises if the orders deadlock."""
    p = len(orders)
    done: dict[tuple[int, str, int], float] = {}  # (stage, kind, microbatch) -> end time
    free_at = [0.0] * p
    position = [0] * p
    blocks: list[list[Block]] = [[] for _ in range(p)]
    while any(position[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if position[s] == len(orders[s]):
                continue
            kind, i = orders[s][position[s]]
            if kind == FORWARD:
                needs = (s - 1, FORWARD, i) if s > 0 else None
            else:
                needs = (s + 1, BACKWARD, i) if s < p - 1 else (s, FORWARD, i)
            if needs is not None and needs not in done:
                continue
            start = max(free_at[s], done[needs] if needs is not None else 0.0)
            end = start + (forward_cost if kind == FORWARD else backward_cost)
            done[(s, kind, i)] = free_at[s] = end
            blocks[s].append(Block(s, kind, i, start, end))
            position[s] += 1
            progressed = True
        if not progressed:
            stuck = [s for s in range(p) if position[s] < len(orders[s])]
            waiting = [f"stage {s} at {Action(*orders[s][position[s]])}" for s in stuck]
            raise ValueError(f"these orders deadlock: {', '.join(waiting)} wait forever")
    return blocks


def peak_held(order: Sequence[Action]) -> int:
    """How many microbatches' activations a stage running `order` holds at most: each F
    keeps one until its B."""
    held = peak = 0
    for kind, _ in order:
        held += 1 if kind == FORWARD else -1
        peak = max(peak, held)
    return peak


def ascii_chart(blocks: Sequence[Sequence[Block]], columns: int = 96) -> str:
    """The classic picture: one row per stage, `columns` characters across the step. A block
    is its label (F3, B3) padded with '-' ('=' for B) to its length; '.' is idle."""
    every = [block for stage in blocks for block in stage]
    origin = min(b.start for b in every)
    scale = columns / (max(b.end for b in every) - origin)
    rows = []
    for stage, stage_blocks in enumerate(blocks):
        row = ["."] * columns
        for block in stage_blocks:
            first = round((block.start - origin) * scale)
            last = max(first + 1, round((block.end - origin) * scale))
            fill = "-" if block.kind == FORWARD else "="
            text = (block.label + fill * columns)[: last - first]
            row[first:last] = text
        rows.append(f"stage {stage} |{''.join(row[:columns])}|")
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
