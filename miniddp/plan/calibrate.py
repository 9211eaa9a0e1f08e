"""The two constants per GPU, fitted on the development set only, and how a published run is
predicted.

The development set is the smallest and the largest model of two published tables (issue 46):

    A100  Megatron-LM's README, April 2021 (Narayanan et al., SC21, Table 1's weak scaling):
          sequence 2048, vocabulary 51,200, full recomputation, hardware FLOPs (the recomputed
          forward counted: 96·B·s·l·h²·(1 + s/6h + V/16lh))
    H100  Megatron-LM's README, July 2024 (Megatron-Core weak scaling): sequence 4096,
          vocabulary 131,072, DP 48, model FLOPs (72·B·s·l·h²·(1 + s/6h + V/12lh))

Every other published row is held out: tests/test_plan_published.py keeps them, with their
sources, and checks the plan against them. Where a source leaves a knob unpublished
(microbatch, interleaving, ZeRO, and for the 2024 table recomputation) the plan chooses it as
its search would: the fastest layout that fits.

The fit: two unknowns (matmul_efficiency, memory_passes), two rows a GPU, the published TFLOP/s
per GPU of each in its own convention. Newton's method on the two equations, finite
differences for the slopes; each evaluation is a search over the unpublished knobs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from miniddp.plan.clusters import A100, H100, Cluster
from miniddp.plan.layout import Partial
from miniddp.plan.search import Plan, search
from miniddp.plan.shapes import Transformer, gpt

# The plan's memory model is held to the published layouts within 10%: a run that trained
# fits if the plan puts it under 110% of what its GPU leaves for training.
SLACK = 1.1


@dataclass(frozen=True)
class Published:
    """One published training run: what it was and the TFLOP/s per GPU it reported."""

    source: str
    model: Transformer
    gpu: str  # a preset of clusters.py
    gpus: int
    seq: int
    batch: int  # sequences a step
    layout: Partial  # the knobs the source publishes
    tflops_per_gpu: float
    convention: str  # "hardware", "model" or "causal": how the source counts FLOPs
    software: tuple[tuple[str, object], ...] = ()  # the run's own, where it differs (clusters.py)

    def cluster(self, preset: Cluster) -> Cluster:
        return replace(preset, **dict(self.software))

    def predict(self, preset: Cluster, layout: Partial | None = None, slack: float = SLACK) -> Plan:
        """The plan's best layout for this run, with the source's published knobs fixed (or
        those of `layout`: Partial() searches them all, and slack=1.0 holds them to the
        memory a GPU leaves, as the plan's own advice is)."""
        given = self.layout if layout is None else layout
        cluster = self.cluster(preset)
        return search(self.model, cluster, self.seq, self.batch, self.gpus, given, slack)[0]

    def predicted_tflops(self, cluster: Cluster) -> float:
        return self.predict(cluster).tflops_per_gpu(self.convention)


MEGATRON_2021 = "Megatron-LM README, April 2021 (Narayanan et al. SC21, Table 1)"
MEGATRON_2024 = "Megatron-LM README, July 2024 (Megatron-Core weak scaling, model_table.png)"


def megatron_2021(name, layers, hidden, heads, tp, pp, gpus, batch, tflops) -> Published:
    layout = Partial(tp=tp, pp=pp, cp=1, dp=gpus // (tp * pp), recompute="full")
    model = gpt(name, layers, hidden, heads, 51_200)
    return Published(MEGATRON_2021, model, "a100", gpus, 2048, batch, layout, tflops, "hardware")


def megatron_2024(name, layers, hidden, heads, tp, pp, gpus, batch, tflops) -> Published:
    layout = Partial(tp=tp, pp=pp, cp=1, dp=gpus // (tp * pp))
    model = gpt(name, layers, hidden, heads, 131_072)
    return Published(MEGATRON_2024, model, "h100", gpus, 4096, batch, layout, tflops, "model")


DEVELOPMENT = {
    "a100": (
        megatron_2021("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
        megatron_2021("1T", 128, 25600, 160, 8, 64, 3072, 3072, 163),
    ),
    "h100": (
        megatron_2024("1.7B", 24, 2048, 16, 1, 1, 48, 192, 408.8),
        megatron_2024("462B", 112, 18432, 144, 8, 16, 6144, 3072, 459.9),
    ),
}
UNFITTED = {"a100": replace(A100, memory_passes=0.0), "h100": replace(H100, memory_passes=0.0)}


def fit(cluster: Cluster, rows: tuple[Published, Published], steps: int = 8) -> Cluster:
    """The cluster with (matmul_efficiency, memory_passes) that predict both rows."""
    x = [cluster.matmul_efficiency, max(cluster.memory_passes, 1.0)]

    def errors(eta: float, kappa: float) -> list[float]:
        fitted = replace(cluster, matmul_efficiency=eta, memory_passes=kappa)
        return [row.predicted_tflops(fitted) / row.tflops_per_gpu - 1 for row in rows]

    for _ in range(steps):
        e = errors(*x)
        if max(abs(value) for value in e) < 1e-4:
            break
        d_eta = errors(x[0] + 1e-3, x[1])
        d_kappa = errors(x[0], x[1] + 1e-2)
        j = [
            [(d_eta[i] - e[i]) / 1e-3, (d_kappa[i] - e[i]) / 1e-2] for i in range(2)
        ]  # rows: equations; columns: eta, kappa
        det = j[0][0] * j[1][1] - j[0][1] * j[1][0]
        step_eta = (e[0] * j[1][1] - e[1] * j[0][1]) / det
        step_kappa = (j[0][0] * e[1] - j[1][0] * e[0]) / det
        x = [min(1.0, max(0.05, x[0] - step_eta)), max(0.0, x[1] - step_kappa)]
    return replace(cluster, matmul_efficiency=round(x[0], 4), memory_passes=round(x[1], 3))


if __name__ == "__main__":
    for gpu, rows in DEVELOPMENT.items():
        fitted = fit(UNFITTED[gpu], rows)
        print(gpu, fitted.matmul_efficiency, fitted.memory_passes)
        for row in rows:
            plan = row.predict(fitted)
            print(
                f"  {row.model.name}: {plan.tflops_per_gpu(row.convention):.1f} "
                f"(published {row.tflops_per_gpu}) {plan.layout}"
            )
