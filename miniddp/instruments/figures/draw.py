"""Each picture from its data: the functions behind `python -m miniddp.figures` and the
chapters' `--plot`. They take plain records (messages, bucket descriptions, timelines, sweep
points) and write one PNG each; gathering the data is the caller's job.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt

from miniddp.collectives import Message
from miniddp.data_parallel.bucket import BucketInfo
from miniddp.instruments import timeline_views
from miniddp.observe.timeline import StepTimeline

DPI = 100
# PNGs without the matplotlib version stamped in: the same data gives the same bytes.
METADATA = {"Software": None}


def save(figure: plt.Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=DPI, metadata=METADATA)
    plt.close(figure)
    return path


def messages(runs: dict[str, Sequence[Message]], world_size: int, path: str | Path) -> Path:
    """One panel per algorithm: ranks top to bottom, steps left to right, an arrow per message
    from its sender (before the step) to its receiver (after it), labelled with what it carries."""
    figure, panels = plt.subplots(
        len(runs), 1, figsize=(9, 2.1 * len(runs)), squeeze=False, sharex=False
    )
    for axes, (title, log) in zip(panels[:, 0], runs.items()):
        steps = max((m.step for m in log), default=0)
        for rank in range(world_size):
            axes.plot([0, steps], [rank, rank], color="lightgray", zorder=0)
        for m in log:
            axes.annotate(
                "",
                xy=(m.step, m.dst),
                xytext=(m.step - 1, m.src),
                arrowprops={"arrowstyle": "->", "color": f"C{m.src}", "lw": 1.4},
            )
            axes.text(
                m.step - 0.5,
                (m.src + m.dst) / 2,
                m.what,
                fontsize=7,
                ha="center",
                color=f"C{m.src}",
                bbox={"fc": "white", "ec": "none", "pad": 0.5},
            )
        axes.set_xticks(range(steps + 1))
        axes.set_xticklabels(["start"] + [f"after step {s}" for s in range(1, steps + 1)])
        axes.set_yticks(range(world_size))
        axes.set_yticklabels([f"rank {r}" for r in range(world_size)])
        axes.set_ylim(world_size - 0.5, -0.5)
        axes.set_title(f"{title}: {steps} steps, {len(log)} messages", fontsize=10)
    return save(figure, path)


def bucket_layouts(layouts: dict[str, Sequence[BucketInfo]], path: str | Path) -> Path:
    """One bar per layout: its buckets in launch order, each as wide as its bytes, labelled with
    the parameters it holds."""
    figure, axes = plt.subplots(figsize=(10, 0.6 + 1.1 * len(layouts)))
    for row, buckets in enumerate(layouts.values()):
        left = 0
        for bucket in buckets:
            mib = bucket.nbytes / 2**20
            axes.barh(row, mib, left=left, color=f"C{bucket.index % 10}", edgecolor="black")
            names = _short(bucket.param_names)
            axes.text(
                left + mib / 2,
                row,
                f"bucket {bucket.index}\n{mib:.2f} MiB\n{names}",
                ha="center",
                va="center",
                fontsize=9,
            )
            left += mib
    axes.set_yticks(range(len(layouts)))
    axes.set_yticklabels(list(layouts), fontsize=10)
    axes.invert_yaxis()
    axes.set_xlabel("MiB of gradients, in launch order (torch's caps: 1 MiB first, then 25)")
    return save(figure, path)


def _short(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]}\n... {names[-1]}"


def timelines(designs: dict[str, Sequence[StepTimeline]], path: str | Path) -> Path:
    """One panel per design, on one time axis: compute and communication lanes of one step."""
    figure, panels = plt.subplots(
        len(designs), 1, figsize=(10, 0.4 + 1.35 * len(designs)), sharex=True, squeeze=False
    )
    for axes, (title, steps) in zip(panels[:, 0], designs.items()):
        timeline_views.draw(axes, steps)
        axes.set_title(title, fontsize=10, loc="left")
        axes.set_xlabel("")
    panels[-1, 0].set_xlabel("ms since the step's forward began")
    handles = timeline_views.legend_handles()
    panels[-1, 0].legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=4, fontsize=8
    )
    return save(figure, path)


def sweep(
    rows: Sequence[tuple[float, float, float]],
    model: Callable[[float], float],
    total: int,
    path: str | Path,
    title: str,
) -> Path:
    """Step time against bucket size: (mean bucket bytes, measured s, model s) per layout, and
    `model(bucket bytes)` over even buckets from 1/64 of `total` to all of it."""
    figure, axes = plt.subplots(figsize=(8, 4.5))
    sizes = [total / 2 ** (i / 4) for i in range(25)]
    axes.plot(
        [b / 1024 for b in sizes],
        [model(b) * 1e3 for b in sizes],
        color="gray",
        label="alpha-beta model, even buckets",
    )
    kib = [size / 1024 for size, _, _ in rows]
    axes.plot(
        kib,
        [m * 1e3 for _, _, m in rows],
        "x",
        color="black",
        markersize=8,
        label="model, these layouts",
    )
    axes.plot(
        kib,
        [m * 1e3 for _, m, _ in rows],
        "o",
        color="C1",
        markersize=8,
        label="measured (median step)",
    )
    axes.set_xscale("log", base=2)
    axes.set_xlabel("mean bucket size (KiB)")
    axes.set_ylabel("step (ms)")
    axes.set_title(title, fontsize=10)
    axes.legend()
    return save(figure, path)


def accumulation(losses: dict[str, Sequence[float]], path: str | Path, title: str) -> Path:
    """Training loss per optimizer step, one line per recipe."""
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for (label, values), style in zip(losses.items(), itertools.cycle(["-", "--", ":"])):
        axes.plot(range(1, len(values) + 1), values, style, label=label, linewidth=2)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss on the whole batch")
    axes.set_yscale("log")
    axes.set_title(title, fontsize=10)
    axes.legend()
    return save(figure, path)


def loss_curves(
    runs: dict[str, tuple[Sequence[float], Sequence[tuple[int, float]]]],
    path: str | Path,
    title: str,
) -> Path:
    """Training loss per step (a line) and validation loss (dots), one colour per run; later
    runs dashed and thinner, so that a run equal to the first lies visibly on top of it."""
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for number, (label, (train, validation)) in enumerate(runs.items()):
        style = {"linewidth": max(0.8, 2.5 - 0.9 * number)}
        style["linestyle"] = "-" if number == 0 else (0, (4, 3))
        training = {"color": f"C{2 * number}", "label": f"{label}: training"}
        axes.plot(range(1, len(train) + 1), train, **training, **style)
        steps, values = zip(*validation)
        held_out = {"color": f"C{2 * number + 1}", "label": f"{label}: validation"}
        axes.plot(steps, values, marker="o", markersize=max(3, 9 - 3 * number), **held_out, **style)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss, nats per character")
    axes.set_title(title, fontsize=10)
    axes.legend()
    return save(figure, path)
