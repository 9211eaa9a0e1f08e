"""Chapter 13's picture: who holds which block of each weight, and where the all-reduces sit.

Two rows, the two halves of a transformer block split the Megatron way over W ranks (one colour
a rank): the MLP, Z = GELU(X A) B, with A split by columns and B by rows; and the attention, with
q, k, v split by heads and the output projection by rows. Grey is what every rank holds whole.
f and g mark the only communication: f an all-reduce in backward, g one in forward.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import FancyBboxPatch, Rectangle

from miniddp.instruments.figures.draw import save

WHOLE = "0.82"  # every rank holds it


def _matrix(axes: Axes, x: float, y: float, width: float, height: float, split: str, world: int):
    """A matrix at (x, y) cut into `world` blocks: 'columns', 'rows', or 'none' (whole)."""
    for rank in range(world if split != "none" else 1):
        colour = WHOLE if split == "none" else f"C{rank}"
        if split == "columns":
            block = (x + rank * width / world, y, width / world, height)
        elif split == "rows":
            block = (x, y + height - (rank + 1) * height / world, width, height / world)
        else:
            block = (x, y, width, height)
        axes.add_patch(Rectangle(block[:2], *block[2:], fc=colour, ec="black", lw=0.8))
        if split != "none":
            axes.text(
                block[0] + block[2] / 2,
                block[1] + block[3] / 2,
                f"{rank}",
                ha="center",
                va="center",
                fontsize=8,
                color="white",
                weight="bold",
            )


def _label(axes: Axes, x: float, y: float, text: str, size: int = 8) -> None:
    axes.text(x, y, text, ha="center", va="top", fontsize=size)


def _talk(axes: Axes, x: float, y: float, name: str, what: str) -> None:
    """A communication point: its letter in a box, what it does under it."""
    axes.add_patch(
        FancyBboxPatch(
            (x - 0.22, y - 0.22),
            0.44,
            0.44,
            boxstyle="round,pad=0.05",
            fc="white",
            ec="crimson",
            lw=1.6,
        )
    )
    axes.text(x, y, name, ha="center", va="center", fontsize=12, color="crimson", weight="bold")
    axes.text(x, y - 0.4, what, ha="center", va="top", fontsize=7, color="crimson")


def _arrow(axes: Axes, x0: float, x1: float, y: float) -> None:
    axes.annotate("", xy=(x1, y), xytext=(x0, y), arrowprops={"arrowstyle": "->", "lw": 1.0})


def _mlp(axes: Axes, world: int) -> None:
    middle = 1.5
    _matrix(axes, 0.2, 1.0, 0.6, 1.0, "none", world)
    _label(axes, 0.5, 0.9, "X\n(B·T × H)\nevery rank")
    _talk(axes, 1.35, middle, "f", "forward: copy\nbackward:\nall-reduce dX")
    _arrow(axes, 0.85, 1.1, middle)
    _arrow(axes, 1.6, 1.9, middle)
    _matrix(axes, 2.0, 1.0, 2.0, 1.0, "columns", world)
    _label(axes, 3.0, 0.9, "A (H × 4H), colwise:\nrank r keeps columns A_r\n(weight rows)")
    _arrow(axes, 4.05, 4.4, middle)
    _matrix(axes, 4.5, 1.0, 2.0, 1.0, "columns", world)
    _label(axes, 5.5, 0.9, "Y_r = GELU(X A_r)\nits slice of the hidden,\nno talking")
    _arrow(axes, 6.55, 6.9, middle)
    _matrix(axes, 7.0, 0.6, 0.5, 1.8, "rows", world)
    _label(axes, 7.25, 0.5, "B (4H × H),\nrowwise:\nrows B_r")
    _arrow(axes, 7.55, 7.9, middle)
    for rank in reversed(range(world)):  # the partial products, stacked
        offset = 0.08 * rank
        axes.add_patch(
            Rectangle(
                (8.0 + offset, 1.0 - offset),
                0.6,
                1.0,
                fc=f"C{rank}",
                ec="black",
                lw=0.8,
                alpha=0.85,
            )
        )
    _label(axes, 8.35, 0.75, "Z_r = Y_r B_r\npartial sums")
    _arrow(axes, 8.75, 9.05, middle)
    _talk(axes, 9.3, middle, "g", "forward:\nall-reduce Σ Z_r\nbackward: copy")
    _arrow(axes, 9.55, 9.85, middle)
    _matrix(axes, 9.9, 1.0, 0.6, 1.0, "none", world)
    _label(axes, 10.2, 0.9, "Z + b\nevery rank\n(b added once)")
    axes.set_title("MLP: Z = GELU(X A) B  —  A split by columns, B by rows", fontsize=10)


def _attention(axes: Axes, world: int, heads: int = 4) -> None:
    middle = 1.5
    _matrix(axes, 0.2, 1.0, 0.6, 1.0, "none", world)
    _label(axes, 0.5, 0.9, "LN(x)\nevery rank")
    _arrow(axes, 0.85, 1.1, middle)
    _talk(axes, 1.35, middle, "f", "backward:\nall-reduce")
    _arrow(axes, 1.6, 1.9, middle)
    for index, name in enumerate("qkv"):  # three projections, each cut by whole heads
        _matrix(axes, 2.0 + index * 0.9, 1.0, 0.8, 1.0, "columns", world)
        _label(axes, 2.4 + index * 0.9, 0.9, f"W_{name}")
    per_rank = heads // world
    _label(
        axes,
        3.35,
        0.55,
        f"colwise by whole heads ({per_rank} of {heads} a rank); fused as one qkv: one f",
    )
    _arrow(axes, 4.75, 5.1, middle)
    for head in range(heads):
        rank = head * world // heads
        axes.add_patch(
            Rectangle((5.2 + head * 0.42, 1.1), 0.36, 0.8, fc=f"C{rank}", ec="black", lw=0.8)
        )
    _label(axes, 6.0, 0.9, "softmax(q kᵀ) v, head by head:\nno talking")
    _arrow(axes, 6.95, 7.3, middle)
    _matrix(axes, 7.4, 0.6, 0.8, 1.8, "rows", world)
    _label(axes, 7.8, 0.5, "W_out, rowwise:\nrows of its heads")
    _arrow(axes, 8.25, 9.05, middle)
    _talk(axes, 9.3, middle, "g", "forward:\nall-reduce")
    _arrow(axes, 9.55, 9.85, middle)
    _matrix(axes, 9.9, 1.0, 0.6, 1.0, "none", world)
    _label(axes, 10.2, 0.9, "+ b_out\nevery rank")
    axes.set_title("Attention: q, k, v split by heads, the output projection by rows", fontsize=10)


def column_row_split(path: str | Path, world_size: int = 2) -> Path:
    """The figure, for `world_size` ranks (one colour each)."""
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.4))
    _mlp(top, world_size)
    _attention(bottom, world_size)
    for axes in (top, bottom):
        axes.set_xlim(0, 10.7)
        axes.set_ylim(-0.1, 2.6)
        axes.set_aspect("equal")
        axes.axis("off")
    figure.suptitle(
        f"Tensor parallelism over W = {world_size} ranks (colour = rank, grey = every rank): "
        "per block, 2 all-reduces forward (g) and 2 backward (f)",
        fontsize=10,
    )
    return save(figure, path)
