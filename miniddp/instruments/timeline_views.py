"""Three views of recorded steps (miniddp/observe/timeline.py): an ASCII timeline for the
terminal, a Chrome trace (Perfetto, chrome://tracing) merged across ranks, and a matplotlib
figure. Each draws the two lanes per rank, compute and communication, and a bucket's span from
its launch to its all-reduce's completion.
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miniddp.observe.timeline import COMM, COMPUTE, Span, StepTimeline

BUCKET_LABELS = string.digits + string.ascii_lowercase + string.ascii_uppercase
COMPUTE_LABELS = {"forward": "f", "backward": "b", "wait": "w"}


def _label(span: Span) -> str:
    if span.lane == COMPUTE:
        return COMPUTE_LABELS.get(span.name, "?")
    index = int(span.name.split()[-1]) if span.name.split()[-1].isdigit() else 0
    return BUCKET_LABELS[index % len(BUCKET_LABELS)]


LINE = 100  # characters: a drawing fits a terminal, and a chapter's output, without wrapping


def ascii_timeline(
    steps: Sequence[StepTimeline], width: int | None = None, travels: str = "bucket"
) -> str:
    """Draw steps on a shared time axis: a compute and a communication lane per rank and step.

    Compute: f forward, b backward, w waiting for the last all-reduces after backward.
    Communication: the bucket's index (0-9, then a-z, A-Z); where several buckets are in flight,
    the oldest, which is the one gloo works on: launches are queued in order. A bucket that is
    never the oldest (launched and done while an older one was in flight: its completion is
    often seen only at the final wait, with the older one's) is drawn once, where it was
    launched, so that no bucket is missing from the picture. By default the
    drawing is LINE characters wide. A design that sends each gradient alone (rungs 1 and 2)
    records one "bucket" per gradient: pass `travels="gradient"` and the legend says what the
    index counts.
    """
    if not steps:
        return "(no steps recorded)"
    several_steps = len({step.step for step in steps}) > 1
    names = {
        id(step): f"rank {step.rank}" + (f" step {step.step}" if several_steps else "")
        for step in steps
    }
    lane_width = max(len(COMPUTE), len(COMM))  # lane names in full
    indent = max(map(len, names.values())) + lane_width + 2
    width = width or LINE - indent - 2  # columns of time, between the two bars
    t0 = min(step.start for step in steps)
    total = max(step.end for step in steps) - t0 or 1e-9
    cell = total / width
    lines = [f"{'':{indent}}|0 ms{f'{total * 1e3:.2f} ms':>{width - 4}}|"]
    for step in sorted(steps, key=lambda s: (s.step, s.rank)):
        for lane in (COMPUTE, COMM):
            spans = [s for s in step.spans if s.lane == lane]
            row = "".join(_cell(spans, t0 + i * cell, t0 + (i + 1) * cell) for i in range(width))
            row = _show_the_hidden(row, spans, t0, cell)
            who = names[id(step)] if lane == COMPUTE else ""
            lines.append(f"{who:<{indent - lane_width - 2}} {lane:<{lane_width}} |{row}|")
    lines.append(
        f"{'':{indent}} f forward, b backward, w wait after backward; 0-9a-z: {travels} index"
    )
    return "\n".join(lines)


def _show_the_hidden(row: str, spans: list[Span], t0: float, cell: float) -> str:
    """`row` with each span that no cell shows written into the cell of its start."""
    cells = list(row)
    for span in spans:
        label = _label(span)
        if label not in row:
            cells[min(max(int((span.start - t0) / cell), 0), len(cells) - 1)] = label
    return "".join(cells)


def _cell(spans: list[Span], start: float, end: float) -> str:
    middle = (start + end) / 2
    in_flight = [s for s in spans if s.start <= middle < s.end]
    touching = in_flight or [s for s in spans if s.start < end and s.end > start]
    if not touching:
        return " "
    return _label(min(touching, key=lambda s: s.start))


def chrome_trace(steps: Sequence[StepTimeline]) -> dict[str, Any]:
    """The steps as a Chrome trace (JSON object format): one process per rank, threads for
    compute and communication. Buckets in flight at the same time go on separate rows, since
    a trace viewer needs the spans on one thread to nest."""
    t0 = min((step.start for step in steps), default=0.0)

    def micros(seconds: float) -> float:
        return round((seconds - t0) * 1e6, 3)

    trace: list[dict[str, Any]] = []
    rows_of_rank: dict[int, list[float]] = {}
    for step in steps:
        pid = step.rank
        if pid not in rows_of_rank:
            rows_of_rank[pid] = []
            trace.append(_meta("process_name", pid, 0, f"rank {pid}"))
            trace.append(_meta("process_sort_index", pid, 0, pid))
            trace.append(_meta("thread_name", pid, 0, COMPUTE))
        rows = rows_of_rank[pid]
        for span in sorted(step.spans, key=lambda s: s.start):
            tid = 0
            if span.lane == COMM:
                row = next((i for i, free_at in enumerate(rows) if free_at <= span.start), None)
                if row is None:
                    row = len(rows)
                    rows.append(0.0)
                    suffix = f" {row + 1}" if row else ""
                    trace.append(_meta("thread_name", pid, row + 1, COMM + suffix))
                rows[row] = span.end
                tid = row + 1
            trace.append(
                {
                    "name": span.name,
                    "cat": span.lane,
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "ts": micros(span.start),
                    "dur": round(span.duration * 1e6, 3),
                    "args": {"step": step.step},
                }
            )
        for mark in step.marks:
            trace.append(
                {
                    "name": f"{mark.kind} {mark.name}",
                    "cat": mark.kind,
                    "ph": "i",
                    "s": "t",
                    "pid": pid,
                    "tid": 0,
                    "ts": micros(mark.time),
                    "args": {"step": step.step},
                }
            )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def _meta(name: str, pid: int, tid: int, value: Any) -> dict[str, Any]:
    key = "sort_index" if name.endswith("sort_index") else "name"
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def write_chrome_trace(steps: Sequence[StepTimeline], path: str | Path) -> Path:
    """Write the merged trace; open it at ui.perfetto.dev or chrome://tracing."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(steps)))
    return path


def plot(steps: Sequence[StepTimeline], path: str | Path, title: str = "") -> Path:
    """Save the timeline as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(12, 0.5 + 0.9 * len(steps)))
    draw(axes, steps)
    axes.set_title(title)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


COMPUTE_COLORS = {"forward": "tab:blue", "backward": "tab:green", "wait": "tab:red"}
# The least room between two labels of a communication lane, as a share of the time drawn: a
# label is one to five characters at 7 points, up to 3% of a 10-inch axis, and panels that
# share an axis can be drawn on one up to twice as long as their own.
LABEL_GAP = 0.06


def legend_handles() -> list[Any]:
    """What `draw`'s colours mean, for a figure's legend."""
    from matplotlib.patches import Patch

    meanings = [
        ("tab:blue", "forward"),
        ("tab:green", "backward"),
        ("tab:red", "waiting for the last all-reduces"),
        ("tab:orange", "an all-reduce in flight (colours alternate)"),
    ]
    return [Patch(color=color, label=label) for color, label in meanings]


def draw(axes: Any, steps: Sequence[StepTimeline], t0: float | None = None) -> None:
    """Draw the steps' lanes on matplotlib `axes`, in ms from `t0` (default: the first start)."""
    t0 = min(step.start for step in steps) if t0 is None else t0
    lanes = [(step, lane) for step in steps for lane in (COMPUTE, COMM)]
    colors = COMPUTE_COLORS
    span_ms = (max(step.end for step in steps) - t0) * 1e3
    for row, (step, lane) in enumerate(lanes):
        for span in (s for s in step.spans if s.lane == lane):
            color = colors.get(span.name, "tab:orange" if _label(span) in "02468" else "tab:brown")
            start_ms = (span.start - t0) * 1e3
            axes.broken_barh([(start_ms, span.duration * 1e3)], (row - 0.4, 0.8), color=color)
        if lane == COMM:
            for start_ms, text in _launch_labels(step, t0, LABEL_GAP * span_ms):
                axes.text(start_ms, row, text, va="center", fontsize=7)
    axes.set_yticks(range(len(lanes)))
    axes.set_yticklabels([f"rank {s.rank} step {s.step} {lane}" for s, lane in lanes])
    axes.invert_yaxis()
    axes.set_xlabel("ms")


def _launch_labels(step: StepTimeline, t0: float, gap_ms: float) -> list[tuple[float, str]]:
    """(where, text) for the launches on a step's communication lane, at least `gap_ms` apart.

    Launches closer than that (rung 2 sends one all-reduce per gradient, dozens within a few
    ms) share one label naming the first and the last, "v-0": printed one by one they would
    overwrite each other into an unreadable smear."""
    spans = sorted((s for s in step.spans if s.lane == COMM), key=lambda s: s.start)
    groups: list[list[Span]] = []
    for span in spans:
        if groups and (span.start - groups[-1][0].start) * 1e3 < gap_ms:
            groups[-1].append(span)
        else:
            groups.append([span])
    return [
        (
            (group[0].start - t0) * 1e3,
            _label(group[0]) if len(group) == 1 else f"{_label(group[0])}-{_label(group[-1])}",
        )
        for group in groups
    ]
