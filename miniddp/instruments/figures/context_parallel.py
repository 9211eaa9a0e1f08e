"""Chapter 15's picture: which query-key blocks each rank computes in a causal ring attention.

Two panels on W = 4 ranks, drawn from the ring's own plan (miniddp.context_parallel.step_blocks,
no run needed). Queries down, keys across, both in global chunk order; a cell is one chunk of
queries against one chunk of keys, coloured by the rank that computes it and labelled with the
ring step at which that rank holds those keys (rank r holds the K/V of rank r - i at step i).
A diagonal cell is causal within itself: only its lower triangle counts. White is above the
diagonal: never computed.

    plain          W chunks of S/W; rank r computes r + 1/2 chunk pairs' worth of scores
    load-balanced  2W chunks of S/2W, rank r holding chunks r and 2W-1-r: 2W half-size pairs
                   each, the same work on every rank
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import Polygon, Rectangle

from miniddp.context_parallel import chunks_of, step_blocks
from miniddp.instruments.figures.draw import save

WORLD = 4


def cells(world: int, load_balance: bool) -> dict[tuple[int, int], tuple[int, int, bool]]:
    """{(query chunk, key chunk): (rank, step, diagonal)} for every block the ring computes."""
    drawn = {}
    for rank in range(world):
        queries = chunks_of(rank, world, load_balance)
        for step in range(world):
            keys = chunks_of((rank - step) % world, world, load_balance)
            for block in step_blocks(rank, world, step, True, load_balance):
                for slot in range(block.k_start, block.k_stop):
                    drawn[queries[block.q], keys[slot]] = (rank, step, block.causal)
    return drawn


def work(world: int, load_balance: bool) -> list[float]:
    """Each rank's scores, in units of one S/W x S/W block: a diagonal cell counts a half (its
    lower triangle, the diagonal itself left out of the count), a half-size chunk's a quarter."""
    size = (world / (2 * world if load_balance else world)) ** 2
    shares = [0.0] * world
    for rank, _, diagonal in cells(world, load_balance).values():
        shares[rank] += size * (0.5 if diagonal else 1.0)
    return shares


def _panel(axes: Axes, world: int, load_balance: bool) -> None:
    pieces = 2 * world if load_balance else world
    for row in range(pieces):  # every cell outlined, so the skipped ones show as white squares
        for column in range(row + 1, pieces):
            axes.add_patch(Rectangle((column, row), 1, 1, fill=False, edgecolor="0.8"))
    for (row, column), (rank, step, diagonal) in cells(world, load_balance).items():
        colour = f"C{rank}"
        if diagonal:  # the lower triangle: query i sees keys up to i
            corners = [(column, row), (column, row + 1), (column + 1, row + 1)]
            axes.add_patch(Polygon(corners, facecolor=colour, edgecolor="black", alpha=0.75))
            axes.add_patch(Rectangle((column, row), 1, 1, fill=False, edgecolor="black"))
            axes.text(column + 0.3, row + 0.72, f"s{step}", ha="center", va="center", fontsize=8)
        else:
            axes.add_patch(Rectangle((column, row), 1, 1, facecolor=colour, edgecolor="black"))
            axes.text(column + 0.5, row + 0.5, f"s{step}", ha="center", va="center", fontsize=9)
    axes.set_xlim(0, pieces)
    axes.set_ylim(pieces, 0)
    axes.set_aspect("equal")
    axes.set_xticks([c + 0.5 for c in range(pieces)], [str(c) for c in range(pieces)])
    axes.set_yticks([c + 0.5 for c in range(pieces)], [str(c) for c in range(pieces)])
    axes.set_xlabel("key chunk (global order)")
    axes.set_ylabel("query chunk (global order)")
    holds = ", ".join(f"r{r}: {chunks_of(r, world, load_balance)}" for r in range(world))
    shares = ", ".join(f"{w:g}" for w in work(world, load_balance))
    name = "load-balanced (head-tail pairs)" if load_balance else "plain"
    axes.set_title(
        f"causal, W = {world}, {name}: {pieces} chunks\nholds {holds}\n"
        f"work per rank (S/W blocks): {shares}",
        fontsize=9,
        loc="left",
    )


def ring_blocks(path: str | Path, world: int = WORLD) -> Path:
    """Plain and load-balanced causal ring attention side by side, one colour a rank."""
    figure, panels = plt.subplots(1, 2, figsize=(11, 6.2))
    for axes, load_balance in zip(panels, (False, True)):
        _panel(axes, world, load_balance)
    handles = [Rectangle((0, 0), 1, 1, facecolor=f"C{r}") for r in range(world)]
    for axes in panels:  # in the empty upper right: the blocks a causal ring skips
        axes.legend(
            handles,
            [f"rank {r}" for r in range(world)],
            loc="upper right",
            fontsize=9,
            title="computed by (sN: ring step)\nwhite: skipped",
            title_fontsize=8,
        )
    return save(figure, path)
