"""Chapter 11's prefetch figure: one ZeRO-3 step without and with fully_shard's prefetch, over
the simulated link, as rank 0 recorded it (miniddp/sharding/unit_lanes.py): a lane of compute
(each unit's forward, then its backward), one of all-gathers and one of reduce-scatters, each
span labelled with its unit's place in the forward (1 first). Without prefetch the lanes take
turns; with it, a gather travels under the previous unit's compute, and a reduce-scatter under
the next one's backward.
"""

from __future__ import annotations

from pathlib import Path

from miniddp.instruments.figures.draw import plt, save
from miniddp.observe.timeline import StepTimeline
from miniddp.sharding.unit_lanes import LANES

COLOURS = {
    "forward": "tab:blue",
    "backward": "tab:green",
    "all-gather": "tab:orange",
    "reduce-scatter": "tab:purple",
}


def prefetch_timelines(designs: dict[str, StepTimeline], path: str | Path) -> Path:
    """One panel per design (title -> its recorded step), on one axis of ms from its start."""
    figure, panels = plt.subplots(
        len(designs), 1, figsize=(10, 0.6 + 1.2 * len(designs)), sharex=True, squeeze=False
    )
    for axes, (title, step) in zip(panels[:, 0], designs.items()):
        first = min(
            int(span.name.split()[1]) for span in step.spans
        )  # fully_shard numbers units in call order
        for row, lane in enumerate(LANES):
            for span in (s for s in step.spans if s.lane == lane):
                kind, number = span.name.split()
                unit = str(int(number) - first + 1)
                start_ms, width_ms = (span.start - step.start) * 1e3, span.duration * 1e3
                axes.broken_barh(
                    [(start_ms, width_ms)], (row - 0.4, 0.8), color=COLOURS[kind], ec="white"
                )
                axes.text(start_ms + width_ms / 2, row, unit, ha="center", va="center", fontsize=7)
        axes.set_yticks(range(len(LANES)), LANES)
        axes.invert_yaxis()
        axes.set_title(title, fontsize=10, loc="left")
    panels[-1, 0].set_xlabel("ms since the step's first gather (rank 0; labels: the unit, 1 first)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, label=k) for k, c in COLOURS.items()]
    panels[0, 0].legend(
        handles=handles, loc="lower right", bbox_to_anchor=(1, 1), ncol=4, fontsize=8, frameon=False
    )
    return save(figure, path)
