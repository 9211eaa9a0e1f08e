"""Chapter 18's picture: where the tokens go, what capacity drops, and what the auxiliary loss
does to the experts' load over training. The chapter gathers the numbers; this draws them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt

from miniddp.instruments.figures.draw import save


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
    figure, ((routed, dropped), (load, loss)) = plt.subplots(2, 2, figsize=(11, 7.5))
    bottom = [0] * len(tokens_per_rank[0])
    for rank, counts in enumerate(tokens_per_rank):
        routed.bar(range(len(counts)), counts, bottom=bottom, label=f"from rank {rank}")
        bottom = [b + c for b, c in zip(bottom, counts)]
    routed.set_xlabel("expert")
    routed.set_ylabel("choices of it (top-k: k per token)")
    routed.set_title("1. choices per expert, by the rank they come from", fontsize=10)
    routed.legend(fontsize=8)
    factors = sorted(drops)
    dropped.plot(factors, [drops[f][0] for f in factors], "o-", label="capacity per rank")
    dropped.plot(factors, [drops[f][1] for f in factors], "s--", label="one global capacity")
    dropped.set_xlabel("capacity factor")
    dropped.set_ylabel("share of choices dropped")
    dropped.set_title("3. drops against the capacity factor", fontsize=10)
    dropped.legend(fontsize=8)
    for label, values in loads.items():
        load.plot(range(1, len(values) + 1), values, label=label)
    load.axhline(1 / len(bottom), color="grey", linestyle=":", label="even")
    load.set_xlabel("training step")
    load.set_ylabel("busiest expert's share of the choices")
    load.set_title("5. the experts' load over training", fontsize=10)
    load.legend(fontsize=8)
    for label, values in losses.items():
        loss.plot(range(1, len(values) + 1), values, label=label)
    loss.set_xlabel("training step")
    loss.set_ylabel("cross-entropy (nats per character)")
    loss.set_title("5. the loss over training", fontsize=10)
    loss.legend(fontsize=8)
    return save(figure, path)
