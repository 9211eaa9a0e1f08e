"""Chapter 14's pictures: GPipe and 1F1B on 4 stages, stages down, time across, measured; and
(14b) the four schedules' orders on the logical clock, lanes of 4 ranks, F, B, I and W apart.

A 4-rank gloo job (spawned, with a deadline) runs both schedules on stages whose every forward
takes FORWARD_S and every backward BACKWARD_S (miniddp.pipeline.FixedCost), records the events
of one step each, and draws them as the textbook does: a block per forward (F) or backward (B),
numbered by microbatch, with the measured bubble against (p - 1)/(m + p - 1).
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from miniddp.instruments.figures.draw import plt, save
from miniddp.instruments.figures.record import spawn_and_collect
from miniddp.observe.events import Recorder
from miniddp.pipeline import FixedCost, PipelineStage, Schedule1F1B, ScheduleGPipe
from miniddp.pipeline.bubble import (
    Block,
    bubble_formula,
    bubble_fraction,
    gather_blocks,
    peak_held,
    replay,
)
from miniddp.pipeline.interleaved import interleaved_order

STAGES, MICROBATCHES = 4, 6
FORWARD_S, BACKWARD_S = 0.020, 0.040
JOB_TIMEOUT_S = 240
SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def record_on_ranks(rank: int, store_path: str, out_path: str) -> None:
    """One stage: a second step of each schedule (the first also exchanges shapes), recorded."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, STAGES)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=STAGES, timeout=timedelta(seconds=60)
    )
    block = nn.Sequential(nn.Linear(8, 8), FixedCost(FORWARD_S, BACKWARD_S))
    stage = PipelineStage(block, rank, STAGES, "cpu")
    x, y = torch.randn(2 * MICROBATCHES, 8), torch.randn(2 * MICROBATCHES, 8)
    drawn = {}
    for name, schedule_class in SCHEDULES.items():
        schedule = schedule_class(stage, MICROBATCHES, mse)
        recorder = schedule.observer = Recorder()
        for _ in range(2):
            dist.barrier()
            if stage.is_first:
                schedule.step(x)
            elif stage.is_last:
                schedule.step(target=y)
            else:
                schedule.step()
        drawn[name] = gather_blocks(schedule, recorder.events)
    if rank == 0:
        Path(out_path).write_bytes(pickle.dumps(drawn))
    dist.destroy_process_group()


def run_pipeline_job(work_dir: Path) -> dict[str, list[list[Block]]]:
    """Spawn the 4 stages, wait (with a deadline), and return each schedule's blocks."""
    return spawn_and_collect(record_on_ranks, STAGES, work_dir, JOB_TIMEOUT_S)


def schedules(drawn: dict[str, list[list[Block]]], path: str | Path) -> Path:
    """One panel per schedule, on a shared time axis: a row per stage, F and B blocks labelled
    with their microbatch, white where the stage is idle."""
    figure, panels = plt.subplots(len(drawn), 1, figsize=(11, 5.5), sharex=True)
    colours = {"F": "#7fb3d5", "B": "#f0b27a"}
    formula = bubble_formula(STAGES, MICROBATCHES)
    for axes, (name, blocks) in zip(panels, drawn.items()):
        origin = min(b.start for stage in blocks for b in stage)
        for stage in blocks:
            for block in stage:
                start, width = (block.start - origin) * 1e3, block.duration * 1e3
                colour = colours[block.kind]
                axes.barh(block.rank, width, left=start, color=colour, edgecolor="black")
                axes.text(start + width / 2, block.rank, block.label, ha="center", va="center")
        axes.set_yticks(range(STAGES))
        axes.set_yticklabels([f"stage {s}" for s in range(STAGES)])
        axes.set_ylim(STAGES - 0.5, -0.5)
        axes.set_title(
            f"{name}: p = {STAGES}, m = {MICROBATCHES}; bubble measured "
            f"{bubble_fraction(blocks):.3f}, (p-1)/(m+p-1) = {formula:.3f}",
            fontsize=10,
            loc="left",
        )
    panels[-1].set_xlabel(
        f"ms since the step's first forward (F = {FORWARD_S * 1e3:g} ms, "
        f"B = {BACKWARD_S * 1e3:g} ms on every stage)"
    )
    return save(figure, path)


LANES, LANE_MICROBATCHES, V = 4, 8, 2
KIND_COLOURS = {"F": "#7fb3d5", "B": "#f0b27a", "I": "#c39bd3", "W": "#82e0aa"}


def schedule_lanes(path: str | Path) -> Path:
    """One panel per schedule on a shared logical clock: a rank's whole forward costs 1 and
    its backward 2, so an interleaved stage (half a rank's layers) costs 1/2 and 1, and a
    zero-bubble I or W 1/2 each. Lanes are ranks; a darker edge marks a rank's second stage."""
    p, m = LANES, LANE_MICROBATCHES
    panels_of = {
        "GPipe": ([ScheduleGPipe.order(_Shape(r, p, m)) for r in range(p)], 1),
        "1F1B": ([Schedule1F1B.order(_Shape(r, p, m)) for r in range(p)], 1),
        f"interleaved 1F1B, v = {V}": ([interleaved_order(r, p, V, m) for r in range(p)], V),
        f"interleaved zero bubble, v = {V}": (
            [interleaved_order(r, p, V, m, zero_bubble=True) for r in range(p)],
            V,
        ),
    }
    figure, panels = plt.subplots(len(panels_of), 1, figsize=(13, 10.5), sharex=True)
    for axes, (name, (orders, v)) in zip(panels, panels_of.items()):
        blocks = replay(orders, forward_cost=1 / v, backward_cost=2 / v)
        for lane in blocks:
            for block in lane:
                second = block.stage >= p
                axes.barh(
                    block.rank,
                    block.duration,
                    left=block.start,
                    color=KIND_COLOURS[block.kind],
                    edgecolor="black",
                    hatch="//" if second else None,
                    linewidth=0.6,
                )
                axes.text(  # the microbatch: the colour says F, B, I or W
                    block.start + block.duration / 2,
                    block.rank,
                    str(block.microbatch),
                    ha="center",
                    va="center",
                    fontsize=10,
                    bbox={"boxstyle": "square,pad=0.05", "fc": "white", "ec": "none", "alpha": 0.6}
                    if second
                    else None,
                )
        if "zero" in name:  # I = W = F: idle (p - 1)(F + I - W) a rank, against 3 v m of work
            formula, written = (p - 1) / (3 * v * m + p - 1), "(p-1)/(3vm+p-1)"
        else:
            formula, written = bubble_formula(p, m, v), "(p-1)/(vm+p-1)"
        held = [peak_held(order) for order in orders]
        axes.set_yticks(range(p))
        axes.set_yticklabels([f"rank {r}" for r in range(p)])
        axes.set_ylim(p - 0.5, -0.5)
        axes.set_title(
            f"{name}: bubble {bubble_fraction(blocks):.3f} ({written} = {formula:.3f}); "
            f"microbatch-stages held per rank {held}",
            fontsize=11,
            loc="left",
        )
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, ec="black") for c in KIND_COLOURS.values()]
    labels = ["F forward", "B whole backward", "I input gradient", "W weight gradient"]
    panels[-1].legend(handles, labels, fontsize=10, loc="center right")  # where nothing is left
    for axes in panels:
        axes.tick_params(labelsize=10)
    panels[-1].set_xlabel(
        f"logical time (p = {p}, m = {m}; a rank's F = 1, B = 2; a box's number is its "
        "microbatch; hatched: the rank's second stage)",
        fontsize=11,
    )
    return save(figure, path)


class _Shape:
    """Just what a one-stage schedule's `order()` reads, to list orders without processes."""

    def __init__(self, stage_index: int, num_stages: int, n_microbatches: int) -> None:
        self.n_microbatches = n_microbatches
        self.stage = type("Stage", (), {"stage_index": stage_index, "num_stages": num_stages})
