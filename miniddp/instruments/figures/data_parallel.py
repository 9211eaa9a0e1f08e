"""Chapter 02's figure: data parallelism in one picture. W replicas of one model, each fed its
own shard of the global batch, and one all-reduce that gives every replica the same gradient.

The shards are real: `miniddp.DistributedSampler`'s indices for a 12-sample dataset at W = 3,
unshuffled so that the picture can be checked by eye (rank r takes samples r, r + W, ...; with
shuffle=True they are a permutation, cut the same way). The gradients are written as sums:
rank r computes g_r from its shard alone, and after the all-reduce every rank holds
(g_0 + ... + g_{W-1}) / W, the gradient of the mean loss over the global batch.
"""

from __future__ import annotations

from pathlib import Path

from miniddp.data_parallel.sampler import DistributedSampler

WORLD_SIZE = 3
SAMPLES = 12


def shards(world_size: int = WORLD_SIZE, samples: int = SAMPLES) -> list[list[int]]:
    """Each rank's sample indices, as DistributedSampler hands them out."""
    dataset = range(samples)
    return [
        list(DistributedSampler(dataset, num_replicas=world_size, rank=r, shuffle=False))
        for r in range(world_size)
    ]


def data_parallel(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    per_rank = shards()
    world = len(per_rank)
    figure, axes = plt.subplots(figsize=(10, 5.2))
    axes.set_xlim(0, 10)
    axes.set_ylim(0, 5.6)
    axes.axis("off")

    def box(x: float, y: float, w: float, h: float, text: str, colour: str) -> None:
        axes.add_patch(
            FancyBboxPatch(
                (x, y), w, h, boxstyle="round,pad=0.04", fc=colour, ec="black", lw=1, alpha=0.8
            )
        )
        axes.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=9)

    def arrow(start: tuple[float, float], end: tuple[float, float], colour: str = "black"):
        axes.add_patch(
            FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, color=colour, lw=1.2)
        )

    # The global batch, each sample coloured by the rank it goes to.
    owner = {index: rank for rank, indices in enumerate(per_rank) for index in indices}
    cell = 0.5
    left = 5 - SAMPLES * cell / 2
    axes.text(5, 5.35, "the global batch: 12 samples", ha="center", fontsize=10)
    for index in range(SAMPLES):
        x = left + index * cell
        axes.add_patch(
            plt.Rectangle((x, 4.7), cell, 0.45, fc=f"C{owner[index]}", ec="white", alpha=0.75)
        )
        axes.text(x + cell / 2, 4.92, str(index), ha="center", va="center", fontsize=8)

    column = 10 / world
    for rank, indices in enumerate(per_rank):
        centre = column * (rank + 0.5)
        arrow((left + (indices[0] + 0.5) * cell, 4.68), (centre, 4.1), f"C{rank}")
        shard = ", ".join(map(str, indices))
        box(centre - 1.25, 3.45, 2.5, 0.6, f"rank {rank}'s shard\nsamples {shard}", f"C{rank}")
        arrow((centre, 3.42), (centre, 3.0))
        box(
            centre - 1.25,
            2.3,
            2.5,
            0.65,
            f"replica {rank}: the same weights\nforward, backward",
            "#eeeeee",
        )
        arrow((centre, 2.27), (centre, 1.85))
        axes.text(centre, 1.68, f"g{rank} (its shard's gradient)", ha="center", fontsize=9)

    # One all-reduce across all ranks, then the same gradient everywhere.
    box(0.4, 0.75, 9.2, 0.55, "", "#fff2cc")
    total = " + ".join(f"g{r}" for r in range(world))
    reduced = f"one all-reduce per gradient: every rank gets ({total}) / {world}"
    axes.text(5, 1.02, reduced, ha="center", va="center", fontsize=10)
    for rank in range(world):
        centre = column * (rank + 0.5)
        arrow((centre, 1.55), (centre, 1.33))
        arrow((centre, 0.72), (centre, 0.42))
        axes.text(centre, 0.22, "same gradient, same step", ha="center", fontsize=9)
    axes.set_title(
        f"Data parallelism on W = {world}: replicas start equal (a broadcast at construction), "
        "each\nsees its own shard (DistributedSampler), and an all-reduce keeps them equal",
        fontsize=10,
    )
    figure.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(figure)
    return path
