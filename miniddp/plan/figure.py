"""`--plot`: memory and time per term for the best layouts, as two stacked bar charts.

Drawn here with matplotlib alone (miniddp/instruments/figures is a floor above the plan, so the
plan does not import it); the PNG carries no matplotlib version, so the same plan draws the same
bytes.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from miniddp.plan.search import GiB, Plan


def draw(plans: list[Plan], path: Path) -> Path:
    figure, (memory, time) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [
        f"tp{p.layout.tp} pp{p.layout.pp} cp{p.layout.cp}\ndp{p.layout.dp} v{p.layout.v} "
        f"mb{p.layout.microbatch}\nz{p.layout.zero} {p.layout.recompute}"
        for p in plans
    ]
    for panel, terms_of, scale, unit in (
        (memory, lambda p: [(t.name, t.value) for t in p.memory], GiB, "GiB per GPU"),
        (time, lambda p: [(t.name, t.exposed) for t in p.time], 1.0, "seconds a step (exposed)"),
    ):
        names = [name for name, _ in terms_of(plans[0])]
        bottoms = [0.0] * len(plans)
        for index, name in enumerate(names):
            values = [dict(terms_of(plan))[name] / scale for plan in plans]
            if not any(values):
                continue
            panel.bar(labels, values, bottom=bottoms, label=name, color=f"C{index}")
            bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
        panel.set_ylabel(unit)
        panel.legend(fontsize=8)
        panel.tick_params(axis="x", labelsize=7)
    cluster = plans[0].cluster
    usable = cluster.memory_bytes / GiB
    memory.axhline(usable, color="black", linestyle="--", linewidth=1)
    memory.set_title(f"memory per term; dashed: the {usable:g} GiB a {cluster.name} leaves")
    time.set_title(f"time per term; {plans[0].model.name} on {plans[0].layout.gpus} GPUs")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(figure)
    return path
