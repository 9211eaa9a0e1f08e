"""Chapter 11's figure: the memory each rank holds under DDP and the three ZeRO stages; and
chapter 11c's, the same layouts' whole step, activations included, as one rank measured it.

Chapter 11's is drawn from `miniddp.sharding.memory.Formula`, which chapter 11 checks byte for
byte against the storages a rank really holds; so the bars are the measurement, at a size worth
drawing: a 1-billion-parameter model, fp32 with AdamW (4 bytes of parameter, 4 of gradient, 4
of DDP's bucket copy and 8 of Adam's two moments per parameter), on 2, 4 and 8 ranks. Chapter
11c's is the chapter's own measurement, handed over as bytes per term.
"""

from __future__ import annotations

from pathlib import Path

from miniddp.sharding.memory import Formula

STAGES = ("ddp", "zero1", "zero2", "zero3")
KINDS = ("parameters", "gradients", "buckets", "optimizer_state")
PARAMETERS = 10**9
WORLD_SIZES = (2, 4, 8)


def memory_per_rank(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(WORLD_SIZES)
    colours = dict(zip(KINDS, ("#4c72b0", "#dd8452", "#8c8c8c", "#55a868")))
    for w_index, world in enumerate(WORLD_SIZES):
        for s_index, stage in enumerate(STAGES):
            memory = Formula(stage, PARAMETERS, tensors=0, world_size=world).expected()
            x = s_index + (w_index - (len(WORLD_SIZES) - 1) / 2) * width
            bottom = 0.0
            for kind in KINDS:
                height = getattr(memory, kind) / 1e9
                label = kind.replace("_", " ") if (w_index, s_index) == (0, 0) else None
                axes.bar(x, height, width * 0.9, bottom=bottom, color=colours[kind], label=label)
                bottom += height
            axes.text(x, bottom + 0.3, f"W={world}\n{bottom:.1f}", ha="center", fontsize=7)
    axes.set_xticks(range(len(STAGES)), ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"])
    axes.set_ylabel("GB on each rank")
    axes.set_ylim(0, 25)
    axes.set_title(
        "Memory per rank, 1B parameters, fp32 AdamW: DDP keeps 20 bytes per parameter;\n"
        "ZeRO shards Adam's state (1), then the gradients (2), then the parameters (3)"
    )
    axes.legend(loc="upper right", fontsize=8)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return path


def step_memory(
    bars: dict[str, dict[str, dict[str, int]]], path: Path, title: str, unit: int = 2**20
) -> Path:
    """Chapter 11c's figure: per layout (DDP, ZeRO-1, ...), one stacked bar per activation
    checkpointing, each term's bytes measured on one rank. `bars[layout][checkpointing][term]`;
    every bar lists the same terms, drawn bottom to top in that order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(10, 4.6))
    first = next(iter(next(iter(bars.values())).values()))
    colours = dict(zip(first, ("#4c72b0", "#dd8452", "#8c8c8c", "#55a868", "#c44e52", "#8172b3")))
    per_layout = len(next(iter(bars.values())))
    width = 0.8 / per_layout
    for l_index, variants in enumerate(bars.values()):
        for v_index, (variant, terms) in enumerate(variants.items()):
            x = l_index + (v_index - (per_layout - 1) / 2) * width
            bottom = 0.0
            for term, nbytes in terms.items():
                label = term if (l_index, v_index) == (0, 0) else None
                height = nbytes / unit
                axes.bar(x, height, width * 0.9, bottom=bottom, color=colours[term], label=label)
                bottom += height
            axes.text(x, bottom, f"{variant}\n{bottom:.0f}", ha="center", va="bottom", fontsize=7)
    axes.set_xticks(range(len(bars)), list(bars))
    axes.set_ylabel("MiB on rank 0" if unit == 2**20 else f"units of {unit:,} bytes")
    axes.set_ylim(0, axes.get_ylim()[1] * 1.15)
    axes.set_title(title, fontsize=10)
    axes.legend(loc="upper right", fontsize=8)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return path
