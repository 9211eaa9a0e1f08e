"""Chapter 19's figure: validation loss against simulated wall-clock time, and against the bytes
each replica sent, one line per way of syncing (DDP, DiLoCo at each H, streaming, alone)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from miniddp.instruments.figures.draw import save


def loss_against_time_and_bytes(
    runs: dict[str, Sequence[tuple[float, float, float]]], path: str | Path, title: str
) -> Path:
    """`runs[label]`: (simulated seconds, bytes sent per replica, validation loss) points."""
    figure, (by_time, by_bytes) = plt.subplots(1, 2, figsize=(11, 4.2))
    for number, (label, points) in enumerate(runs.items()):
        seconds, sent, loss = zip(*points)
        style = {"color": f"C{number}", "marker": "o", "markersize": 3, "label": label}
        by_time.plot([s / 60 for s in seconds], loss, **style)
        sending = [(b / 2**20, v) for b, v in zip(sent, loss) if b > 0]  # log axis: no zero
        if sending:
            by_bytes.plot(*zip(*sending), **style)
    by_time.set_xlabel("simulated wall-clock, minutes (compute + link)")
    by_bytes.set_xlabel("MiB sent by each replica (log scale)")
    by_bytes.set_xscale("log")
    for axes in (by_time, by_bytes):
        axes.set_ylabel("validation loss, nats per character")
        axes.grid(alpha=0.3)
    by_time.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    return save(figure, path)
