"""Chapter 16b's picture: the (pp, dp, tp) mesh of 8 ranks, and one training step on it.

Left, the grid as `miniddp.mesh.init_device_mesh` lays it out, `torch.arange(8).view(2, 2, 2)`:
two pages (pp), each a 2 x 2 square of replicas (dp, down) and shards (tp, across), every rank
joined to its TP partner, its DP partner and its PP partner. Right, one 1F1B step of chapter 16's
GPT through `miniddp.parallelize`, measured: a row per rank, its forwards and backwards, and
under them what it sent on each axis, when: TP's all-reduces inside every F and B, PP's sends
between the stages, DP's one all-reduce and the tied embedding's at the end.

The data: an 8-rank gloo job (spawned, with a deadline) trains the GPT two steps and records
the second (`record_step`); chapter 16b records its own step the same way and draws it with
--plot. `recording_the_wire` is also how chapter 16b counts what each axis sends, and
`measure_step` how chapter 16 and tests/test_three_d_audit.py measure what each rank holds.
"""

from __future__ import annotations

import os
import pickle
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from miniddp.instruments.activation_memory import PeakSavedActivations
from miniddp.instruments.figures.record import spawn_and_collect
from miniddp.instruments.link_group import Crossing, active_wire, link_groups
from miniddp.mesh import DeviceMesh, init_device_mesh
from miniddp.models.gpt import GPT, GPTConfig
from miniddp.observe.events import NO_OBSERVER, Recorder
from miniddp.parallelize import ParallelGPT, parallelize
from miniddp.pipeline.bubble import Block, blocks_of
from miniddp.sharding import MemoryPerRank, ddp_buckets, ddp_compute_copies, measure_memory

AXES = ("pp", "dp", "tp")
SHAPE = (2, 2, 2)
COLOURS = {"tp": "crimson", "pp": "royalblue", "dp": "seagreen", "F": "#aed6f1", "B": "#f5cba7"}
# The job's model: chapters 16 and 16b's shape, on random tokens (the chapter trains on real text).
CONFIG = GPTConfig(vocab_size=64, context=16, width=32, layers=4, heads=4, dropout=0.0)
WINDOWS, MICROBATCHES = 8, 4  # a step's windows (all replicas), and microbatches per replica
JOB_TIMEOUT_S = 600  # 8 ranks importing torch on 2 busy cores took 150 s once


def groups_of(shape: tuple[int, ...], names: tuple[str, ...] = AXES) -> dict[str, list[list[int]]]:
    """Every group along every axis, as init_device_mesh builds them: the lines of the grid
    `torch.arange(W).view(shape)` along that axis (no process group needed)."""
    grid = torch.arange(torch.Size(shape).numel()).view(shape)
    return {
        name: grid.movedim(axis, -1).reshape(-1, size).tolist()
        for axis, (name, size) in enumerate(zip(names, shape))
    }


@dataclass
class WireEvent:
    """One thing a rank put on the wire: an all-reduce (`end`: when it completed) or a send of a
    pipeline's (`end`: None, only its issue is seen). Times on time.perf_counter, the clock of
    the link's groups and of the schedule's events."""

    axis: str  # the mesh axis whose group carried it: "tp", "dp" or "pp" ("other" if none)
    kind: str  # "all_reduce" or "send"
    elements: int
    nbytes: int
    start: float
    end: float | None = None


@contextmanager
def recording_the_wire(
    mesh: DeviceMesh, tie: dist.ProcessGroup | None = None
) -> Iterator[list[WireEvent]]:
    """Inside the block, every all-reduce and send this rank puts on the mesh's groups is
    logged with the axis of its group: MiniDDP's, tensor parallelism's, the pipeline's and the
    tied embedding's alike. The groups must be LinkGroups (the mesh made inside
    `link_groups()`), which log what crosses them; nothing else changes. `tie`: the group of a
    pipeline's first and last stage, the pipeline's own with two stages, a pair of its ranks
    with more: logged as "pp" too."""
    wire = active_wire()
    if wire is None:
        raise RuntimeError(
            "recording_the_wire sees what crosses LinkGroups: make the mesh inside "
            "miniddp.instruments.link_group.link_groups() (on the bare machine unless a "
            "simulated_link block says otherwise)"
        )
    axis_of = {mesh[name].get_group().group_name: name for name in mesh.mesh_dim_names}
    if tie is not None:
        axis_of[tie.group_name] = "pp"
    log: list[WireEvent] = []
    crossings: list[Crossing] = []
    wire.recording = crossings
    try:
        yield log
    finally:
        wire.recording = None
        log += [
            WireEvent(axis_of.get(c.group, "other"), c.kind, c.elements, c.nbytes, c.start, c.end)
            for c in crossings
        ]


@dataclass
class RankStep:
    """What one rank did in one recorded step: its F and B blocks, its waits for a neighbour,
    and what it sent."""

    rank: int
    coordinate: list[int]  # (pp, dp, tp)
    blocks: list[Block] = field(default_factory=list)
    waits: list[tuple[float, float]] = field(default_factory=list)
    wire: list[WireEvent] = field(default_factory=list)


def record_step(parts: ParallelGPT, windows: torch.Tensor) -> tuple[torch.Tensor | None, RankStep]:
    """`parts.train_step(windows)`, recorded: returns its loss and this rank's RankStep.
    Every rank must call it (with a pipeline: `parts.schedule` records its events)."""
    mesh, schedule = parts.mesh, parts.schedule
    step = RankStep(dist.get_rank(), mesh.get_coordinate())
    if schedule is not None:
        recorder = schedule.observer = Recorder()
    with recording_the_wire(mesh, None if parts.tied is None else parts.tied.group) as wire:
        loss = parts.train_step(windows)
    step.wire = wire
    if schedule is not None:
        events = recorder.events
        step.blocks = blocks_of(events, schedule.stage.stage_index)
        idle = [e.time for e in events if e.kind == "idle"]
        step.waits = list(zip(idle[::2], idle[1::2]))  # start, end, start, end...
        schedule.observer = NO_OBSERVER
    return loss, step


def messages_sent(step: RankStep) -> Counter:
    """(axis, kind, elements, bytes an element) -> how many, of what the rank put on the wire:
    its all-reduces and sends (a receive is its neighbour's send, so none is logged)."""
    return Counter(
        (event.axis, event.kind, event.elements, event.nbytes // event.elements)
        for event in step.wire
    )


@dataclass
class StepMeasured:
    """One rank's recorded step (`step`), its loss, and what the rank held in it: `memory` from
    the storages after backward, the `activations` saved for backward at their peak, and the
    microbatches its pipeline stage `held` at once."""

    loss: torch.Tensor | None
    step: RankStep
    memory: MemoryPerRank
    activations: int
    held: int


def measure_step(
    parts: ParallelGPT, optimizer: torch.optim.Optimizer, windows: torch.Tensor
) -> StepMeasured:
    """`record_step`, and what this rank holds in it, before `optimizer` steps (so after a
    first step, Adam's state is there to count). Every rank must call it."""
    copies = ddp_compute_copies(parts.module)  # under mixed precision: what forward computes with
    with PeakSavedActivations([*parts.parameters(), *copies]) as saved:
        loss, step = record_step(parts, windows)
    memory = measure_memory(parts.parameters(), optimizer, ddp_buckets(parts.module), copies)
    held = parts.schedule.stage.peak_held if parts.schedule else 1
    return StepMeasured(loss, step, memory, saved.peak, held)


def gather_steps(step: RankStep) -> list[RankStep]:
    """Every rank's RankStep, in rank order, on every rank (a collective)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, step)
    return everyone


def windows_of(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    return torch.randint(CONFIG.vocab_size, (WINDOWS, CONFIG.context + 1), generator=generator)


def record_on_ranks(rank: int, store_path: str, out_path: str) -> None:
    """One rank of the job: the GPT on the (2, 2, 2) mesh, two AdamW steps, the second
    recorded (the first also exchanges shapes and checks the orders)."""
    torch.set_num_threads(1)
    world = torch.Size(SHAPE).numel()
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    with link_groups():  # the bare machine, through groups that log what crosses them
        mesh = init_device_mesh("cpu", SHAPE, mesh_dim_names=AXES)
        torch.manual_seed(0)
        parts = parallelize(GPT(CONFIG), mesh, n_microbatches=MICROBATCHES)
        optimizer = torch.optim.AdamW(parts.parameters(), lr=1e-2)
        replicas, replica = mesh["dp"].size(), mesh["dp"].get_local_rank()
        for number in range(2):
            dist.barrier()
            _, step = record_step(parts, windows_of(number).tensor_split(replicas)[replica])
            optimizer.step()
            optimizer.zero_grad()
        steps = gather_steps(step)
    if rank == 0:
        Path(out_path).write_bytes(pickle.dumps(steps))
    dist.destroy_process_group()


def run_job(work_dir: Path) -> list[RankStep]:
    """Spawn the 8 ranks, wait (with a deadline), and return every rank's recorded step."""
    return spawn_and_collect(record_on_ranks, torch.Size(SHAPE).numel(), work_dir, JOB_TIMEOUT_S)


def _draw_mesh(axes, shape: tuple[int, int, int]) -> None:
    """Each pp page a dp x tp square of cells, the later page behind, up and to the right; a
    line from every rank to its partner on each axis, in that axis's colour."""
    from matplotlib.patches import Rectangle

    pp, dp, tp = shape
    spacing, depth = 1.6, (2.6, 1.0)  # between cells; how far a page sits behind the one before

    def centre(p: int, d: int, t: int) -> tuple[float, float]:
        return spacing * t + depth[0] * p, -spacing * d + depth[1] * p

    grid = torch.arange(pp * dp * tp).view(shape)
    for p in reversed(range(pp)):  # the back page first, so the front one covers it
        for d in range(dp):
            for t in range(tp):
                x, y = centre(p, d, t)
                if t + 1 < tp:  # a TP row
                    axes.plot([x, centre(p, d, t + 1)[0]], [y, y], color=COLOURS["tp"], lw=3)
                if d + 1 < dp:  # a DP column
                    axes.plot([x, x], [y, centre(p, d + 1, t)[1]], color=COLOURS["dp"], lw=3)
                if p + 1 < pp:  # PP, to the next page
                    behind = centre(p + 1, d, t)
                    axes.plot([x, behind[0]], [y, behind[1]], color=COLOURS["pp"], lw=2, ls="--")
        for d in range(dp):
            for t in range(tp):
                x, y = centre(p, d, t)
                colour = "#fdebd0" if p else "#e8f6f3"
                cell = Rectangle((x - 0.42, y - 0.42), 0.84, 0.84, fc=colour, ec="black", zorder=3)
                axes.add_patch(cell)
                rank = f"{grid[p, d, t]}"
                axes.text(x, y + 0.08, rank, ha="center", va="center", fontsize=17, zorder=4)
                where = f"({p},{d},{t})"
                axes.text(x, y - 0.26, where, ha="center", va="center", fontsize=10, zorder=4)
    ends = {0: "embeds", pp - 1: "norm, head, loss"}
    for p in range(pp):
        x, y = centre(p, 0, tp - 1) if p else centre(p, dp - 1, 0)
        label = f"pp = {p}: stage {p} ({ends.get(p, 'blocks')})"
        if p:  # above the back page, at its right
            axes.text(x + 0.42, y + 0.6, label, fontsize=10, ha="right")
        else:  # below the front page
            axes.text(x - 0.42, y - 0.75, label, fontsize=10, ha="left")
    x0, y0 = centre(0, dp - 1, 0)
    groups = groups_of(shape)
    lines = [
        ("tp", "TP, a row (tp across):", groups["tp"]),
        ("dp", "DP, a column (dp down):", groups["dp"]),
        ("pp", "PP, through the pages:", groups["pp"]),
    ]
    for row, (name, label, members) in enumerate(lines):
        listed = " ".join("{" + ",".join(map(str, g)) + "}" for g in members)
        axes.text(
            x0 - 0.42,
            y0 - 1.35 - 0.45 * row,
            f"{label:<24}{listed}",
            fontsize=10,
            color=COLOURS[name],
            family="monospace",
        )
    axes.text(x0 - 0.42, y0 - 2.8, "in a cell: the rank, (pp, dp, tp)", fontsize=10, color="0.3")
    axes.set_xlim(-0.7, spacing * (tp - 1) + depth[0] * (pp - 1) + 0.7)
    axes.set_ylim(y0 - 3.0, depth[1] * (pp - 1) + 1.0)
    axes.set_aspect("equal")
    axes.axis("off")
    axes.set_title(f"the mesh (pp, dp, tp) = {shape}\nrank = 4 pp + 2 dp + tp", fontsize=12)


def _draw_step(axes, steps: list[RankStep]) -> None:
    """A row per rank: F and B blocks on top; under them one thin lane per axis, a bar for each
    all-reduce from its issue to its completion and a tick for each pipeline send."""
    from matplotlib.patches import Rectangle

    origin = min(b.start for s in steps for b in s.blocks)
    ms = lambda t: (t - origin) * 1e3  # noqa: E731
    lanes = {"tp": 0.16, "pp": 0.29, "dp": 0.42}  # below the row's centre
    for s in steps:
        row = s.rank
        for start, end in s.waits:
            axes.barh(row - 0.12, ms(end) - ms(start), left=ms(start), height=0.34, color="0.93")
        for block in s.blocks:
            left, width = ms(block.start), block.duration * 1e3
            axes.barh(
                row - 0.12,
                width,
                left=left,
                height=0.34,
                color=COLOURS[block.kind],
                edgecolor="black",
                lw=0.5,
            )
            axes.text(
                left + width / 2, row - 0.12, block.label, ha="center", va="center", fontsize=9
            )
        for event in s.wire:
            if event.axis not in lanes:
                continue
            y = row + lanes[event.axis]
            if event.kind == "send":
                axes.plot(ms(event.start), y, marker="|", ms=6, color=COLOURS[event.axis])
            elif event.kind == "all_reduce" and event.end is not None:
                width = max(ms(event.end) - ms(event.start), 0.15)
                axes.barh(y, width, left=ms(event.start), height=0.1, color=COLOURS[event.axis])
    stages = steps[-1].coordinate[0] + 1
    for border in range(1, stages):  # between the stages' rows
        axes.axhline(border * len(steps) / stages - 0.5, color="0.6", lw=0.8)
    axes.set_yticks(range(len(steps)))
    axes.set_yticklabels(
        [f"rank {s.rank}\n({s.coordinate[0]},{s.coordinate[1]},{s.coordinate[2]})" for s in steps],
        fontsize=11,
    )
    axes.set_ylim(len(steps) - 0.45, -0.45)
    cores = os.cpu_count()
    axes.set_xlabel(
        f"ms since the step's first forward (measured: {len(steps)} ranks on {cores} cores)",
        fontsize=11,
    )
    handles = [
        Rectangle((0, 0), 1, 1, color=COLOURS["F"], ec="black", lw=0.5, label="forward F i"),
        Rectangle((0, 0), 1, 1, color=COLOURS["B"], ec="black", lw=0.5, label="backward B i"),
        Rectangle((0, 0), 1, 1, color="0.93", label="waiting for the other stage"),
        Rectangle((0, 0), 1, 1, color=COLOURS["tp"], label="TP all-reduce (f, g, the loss)"),
        Rectangle((0, 0), 1, 1, color=COLOURS["pp"], label="PP: sends |, the tie's all-reduce"),
        Rectangle((0, 0), 1, 1, color=COLOURS["dp"], label="DP all-reduce of the gradients"),
    ]
    axes.legend(
        handles=handles,
        fontsize=10,
        loc="upper center",
        ncol=3,
        bbox_to_anchor=(0.5, -0.12),
        frameon=False,
    )
    m = max((b.microbatch for s in steps for b in s.blocks), default=0) + 1
    axes.set_title(f"one 1F1B step, m = {m} microbatches a replica", fontsize=12)


def mesh_and_step(steps: list[RankStep], path: str | Path, shape: tuple = SHAPE) -> Path:
    """The figure: the mesh on the left, the recorded step on the right. (matplotlib is
    imported here, not above: the 8 ranks of chapters 16 and 16b import this module to measure
    a step, and only one of them draws.)"""
    from miniddp.instruments.figures.draw import plt, save

    figure, (left, right) = plt.subplots(
        1, 2, figsize=(14, 7.2), gridspec_kw={"width_ratios": [1, 2.1]}
    )
    _draw_mesh(left, shape)
    _draw_step(right, steps)
    figure.suptitle(
        "3-D parallelism: chapter 12's GPT on 8 ranks, TP inside a row, DP down a column, "
        "PP through the pages",
        fontsize=14,
    )
    return save(figure, path)
