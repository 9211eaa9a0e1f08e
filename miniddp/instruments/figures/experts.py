"""Chapter 18's picture: where the tokens go, what capacity drops, and what the auxiliary loss
does to the experts' load over training. The chapter gathers the numbers; this draws them.

A step's load and loss jump from batch to batch, and two such curves drawn over each other hide
each other: each training run is drawn faint as measured, and over it the mean of the last
`WINDOW` steps, which is what the eye compares.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from pathlib import Path

import matplotlib.pyplot as plt

from miniddp.instruments.figures.draw import save

WINDOW = 10  # steps in the running mean over the training curves
LEGEND = {"fontsize": 9}


def running_mean(values: Sequence[float], window: int = WINDOW) -> list[float]:
    """The mean of each value and the window - 1 before it (fewer at the start)."""
    sums = [0.0, *accumulate(values)]
    return [
        (sums[i + 1] - sums[max(0, i + 1 - window)]) / min(i + 1, window)
        for i in range(len(values))
    ]


def training_curves(axes: plt.Axes, runs: dict[str, Sequence[float]]) -> None:
    for label, values in runs.items():
        steps = range(1, len(values) + 1)
        (faint,) = axes.plot(steps, values, linewidth=0.8, alpha=0.35)
        axes.plot(steps, running_mean(values), color=faint.get_color(), linewidth=2, label=label)
    axes.set_xlabel("training step")


def experts(
    tokens_per_rank: Sequence[Sequence[int]],
    drops: dict[float, tuple[float, float]],
    loads: dict[str, Sequence[float]],
    losses: dict[str, Sequence[float]],
    path: str | Path,
) -> Path:
    """Four panels: tokens each rank routes to each expert (stacked bars); the share of
    choices dropped against the capacity factor, per rank and global; the busiest expert's
    share of the choices over training; the loss over training (with and without aux)."""
    figure, ((routed, dropped), (load, loss)) = plt.subplots(2, 2, figsize=(10, 7))
    bottom = [0] * len(tokens_per_rank[0])
    for rank, counts in enumerate(tokens_per_rank):
        routed.bar(range(len(counts)), counts, bottom=bottom, label=f"from rank {rank}")
        bottom = [b + c for b, c in zip(bottom, counts)]
    routed.set_xticks(range(len(bottom)))
    routed.set_xlabel("expert")
    routed.set_ylabel("times chosen (k choices a token)")
    routed.set_title("1. choices per expert, by the rank they come from")
    routed.legend(**LEGEND)
    factors = sorted(drops)
    dropped.plot(factors, [drops[f][0] for f in factors], "o-", label="capacity per rank")
    dropped.plot(factors, [drops[f][1] for f in factors], "s--", label="one global capacity")
    dropped.set_xlabel("capacity factor")
    dropped.set_ylabel("share of choices dropped")
    dropped.set_title("3. drops against the capacity factor")
    dropped.legend(**LEGEND)
    training_curves(load, loads)
    load.axhline(1 / len(bottom), color="grey", linestyle=":", label="even")
    load.set_ylabel("busiest expert's share of choices")
    load.set_title(f"5. the experts' load (faint: each step; bold: mean of {WINDOW})")
    load.legend(**LEGEND)
    training_curves(loss, losses)
    loss.set_ylabel("cross-entropy (nats per character)")
    loss.set_title("5. the loss over the same runs")
    loss.legend(**LEGEND)
    return save(figure, path)
