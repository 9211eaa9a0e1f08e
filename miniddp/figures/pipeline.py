"""Chapter 14's picture: GPipe and 1F1B on 4 stages, stages down, time across, measured.

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

from miniddp.figures.draw import plt, save
from miniddp.figures.record import spawn_and_collect
from miniddp.pipeline import FixedCost, PipelineStage, Schedule1F1B, ScheduleGPipe
from miniddp.pipeline.timeline import Block, bubble_formula, bubble_fraction, gather_blocks

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
        schedule.record_events()
        for _ in range(2):
            dist.barrier()
            if stage.is_first:
                schedule.step(x)
            elif stage.is_last:
                schedule.step(target=y)
            else:
                schedule.step()
        drawn[name] = gather_blocks(schedule)
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
