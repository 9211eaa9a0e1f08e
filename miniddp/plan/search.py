"""One layout evaluated, and the search over layouts: those that fit, best first, and why.

`evaluate` puts the memory terms and the time terms together into a Plan: memory per GPU and
whether it fits, the step's time, tokens per second, TFLOP/s per GPU both ways, MFU. `search`
tries every layout the model and the GPUs allow, keeps those that fit, and sorts them by
step time; a `Partial` layout fixes some knobs and the search chooses the rest.

The search keeps TP inside a node (tp <= gpus_per_node): its collectives run 4 to 6 times a
layer and microbatch, too often for the network (a --layout may still ask for more). It skips
the time of a layout whose memory does not fit.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from miniddp.plan.clusters import Cluster
from miniddp.plan.layout import RECOMPUTE, BadLayout, Layout, Partial, check_layout
from miniddp.plan.memory_terms import memory_terms
from miniddp.plan.shapes import Transformer
from miniddp.plan.terms import Term
from miniddp.plan.time_terms import time_terms

GiB = 1024**3
# The search splits a sequence over cp ranks only while each keeps 1,024 tokens or more: below
# that a ring hop's latency outweighs its block's scores (time_terms' cp), and TP or PP split
# the same activations for less.
MIN_CP_TOKENS = 1024


@dataclass(frozen=True)
class Plan:
    """A layout, evaluated."""

    model: Transformer
    cluster: Cluster
    layout: Layout
    seq: int
    batch: int
    memory: list[Term]
    time: list[Term]

    @property
    def memory_bytes(self) -> float:
        return sum(term.value for term in self.memory)

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.cluster.memory_bytes

    @property
    def step_s(self) -> float:
        return sum(term.exposed for term in self.time)

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.seq / self.step_s

    def tflops_per_gpu(self, convention: str = "model") -> float:
        """TFLOP/s per GPU: "model" (Megatron's count, all s² scores), "causal" (half the
        scores, Llama 3's), or "hardware" (model + the recomputed forward, Megatron 2021's)."""
        model, batch, seq = self.model, self.batch, self.seq
        if convention == "hardware":
            flops = model.hardware_flops(batch, seq, self.layout.recompute)
        elif convention == "causal":
            flops = model.executed_flops(batch, seq, "none", causal_half=True)
        else:
            flops = model.model_flops(batch, seq)
        return flops / self.step_s / self.layout.gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu() * 1e12 / self.cluster.peak_flops

    def dominant_memory(self) -> Term:
        return max(self.memory, key=lambda term: term.value)

    def as_dict(self) -> dict:
        return {
            **self.layout.as_dict(),
            "memory_gib": self.memory_bytes / GiB,
            "fits": self.fits,
            "step_s": self.step_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu("model"),
            "hardware_tflops_per_gpu": self.tflops_per_gpu("hardware"),
            "causal_tflops_per_gpu": self.tflops_per_gpu("causal"),
            "mfu": self.mfu,
            "terms": {
                "memory": {term.name: term.as_dict("gib") for term in self.memory},
                "time": {term.name: term.as_dict("s") for term in self.time},
            },
        }


def evaluate(
    model: Transformer,
    cluster: Cluster,
    layout: Layout,
    seq: int,
    batch: int,
    gpus: int,
    only_if_fits: float = 0.0,
) -> Plan | None:
    """Every term of one layout (refused first if it cannot run); `only_if_fits`: None, with no
    time computed, for a layout whose memory passes that share of what a GPU leaves for
    training (the search skips those)."""
    check_layout(layout, model, gpus, seq, batch)
    check_software(layout, cluster)
    microbatches = batch // (layout.dp * layout.microbatch)
    memory = memory_terms(model, cluster, layout, seq, microbatches)
    if only_if_fits and sum(term.value for term in memory) > only_if_fits * cluster.memory_bytes:
        return None
    time = time_terms(model, cluster, layout, seq, microbatches)
    return Plan(model, cluster, layout, seq, batch, memory, time)


def check_software(layout: Layout, cluster: Cluster) -> None:
    """Refuse what the cluster's software cannot run (clusters.py: 2021's Megatron had neither
    context parallelism nor selective recomputation)."""
    if layout.cp > 1 and not cluster.context_parallel:
        raise BadLayout(f"cp={layout.cp}: {cluster.name}'s software has no context parallelism")
    if layout.zero > cluster.max_zero:
        raise BadLayout(
            f"zero={layout.zero}: {cluster.name}'s software shards up to ZeRO-{cluster.max_zero}"
            " (clusters.py); choose a lower stage, or a cluster file with a higher max_zero"
        )
    if layout.recompute == "selective" and not cluster.sequence_parallel:
        raise BadLayout(
            f"recompute=selective: {cluster.name}'s software recomputes whole layers only (full)"
        )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    model: Transformer, cluster: Cluster, seq: int, batch: int, gpus: int, partial: Partial
):
    """Every complete layout the partial admits that can run (check_layout passes)."""
    given = partial.given()

    def options(name: str, values) -> list:
        return [given[name]] if name in given else list(values)

    powers = [2**k for k in range(21) if 2**k <= gpus]
    tps = options("tp", [t for t in powers if t <= cluster.gpus_per_node])
    cps = options("cp", [c for c in powers if c == 1 or seq // c >= MIN_CP_TOKENS])
    for tp, cp in itertools.product(tps, cps):
        if gpus % (tp * cp):
            continue
        for pp in options("pp", divisors(gpus // (tp * cp))):
            dp = gpus // (tp * cp * pp)
            if "dp" in given and given["dp"] != dp:
                continue
            for v, microbatch, zero, recompute in itertools.product(
                options("v", range(1, 9) if pp > 1 else [1]),
                options("microbatch", (1, 2, 4, 8)),
                options("zero", (0, 1, 2, 3)),
                options("recompute", RECOMPUTE),
            ):
                layout = Layout(tp, pp, cp, dp, 1, v, microbatch, zero, recompute)
                try:
                    check_layout(layout, model, gpus, seq, batch)
                    check_software(layout, cluster)
                except BadLayout:
                    continue
                yield layout


def search(
    model: Transformer,
    cluster: Cluster,
    seq: int,
    batch: int,
    gpus: int,
    partial: Partial | None = None,
    slack: float = 1.0,
) -> list[Plan]:
    """The layouts that fit, fastest first. Raises BadLayout naming why when none fits.
    `slack` > 1 lets memory pass by that factor: a published layout that ran is held to the
    plan's memory model within 10% (calibrate.py)."""
    partial = Partial() if partial is None else partial
    layouts = list(candidates(model, cluster, seq, batch, gpus, partial))
    if not layouts:
        refuse_as_given(model, cluster, seq, batch, gpus, partial)
        given = ",".join(f"{k}={v}" for k, v in partial.given().items()) or "no layout"
        raise BadLayout(
            f"no layout of {gpus} GPUs runs {model.name} with {given}: check that tp divides the "
            "heads, pp·v the layers, 2·cp the sequence and dp·microbatch the global batch"
        )
    plans = [evaluate(model, cluster, layout, seq, batch, gpus, slack) for layout in layouts]
    fitting = [plan for plan in plans if plan is not None]
    if not fitting:
        closest = min(
            (evaluate(model, cluster, layout, seq, batch, gpus) for layout in layouts),
            key=lambda plan: plan.memory_bytes,
        )
        raise BadLayout(not_fitting(closest))
    return sorted(fitting, key=ranking)


def ranking(plan: Plan) -> tuple:
    """Fastest first; among equals, the least memory, then the fewest context and pipeline
    ranks (a tie is a layout whose extra axis the model finds free: keep the simpler one)."""
    return (plan.step_s, plan.memory_bytes, plan.layout.cp, plan.layout.pp, plan.layout.v)


def refuse_as_given(
    model: Transformer, cluster: Cluster, seq: int, batch: int, gpus: int, partial: Partial
) -> None:
    """Raise the exact refusal for the layout as given, the knobs it leaves out at their
    simplest (1, dp whatever the GPUs leave), so that a bad --layout is told its own problem."""
    given = partial.given()
    tp, pp, cp = (given.get(name, 1) for name in ("tp", "pp", "cp"))
    dp = given.get("dp", max(1, gpus // (tp * pp * cp)))
    knobs = ("ep", "v", "microbatch", "zero", "recompute")
    layout = Layout(tp, pp, cp, dp, **{k: v for k, v in given.items() if k in knobs})
    check_layout(layout, model, gpus, seq, batch)
    check_software(layout, cluster)


def not_fitting(plan: Plan) -> str:
    over = (plan.memory_bytes - plan.cluster.memory_bytes) / GiB
    dominant = plan.dominant_memory()
    return (
        f"{plan.layout} does not fit: {plan.memory_bytes / GiB:.1f} GiB a GPU, {over:.1f} GiB "
        f"over the {plan.cluster.memory_bytes / GiB:g} GiB a {plan.cluster.name} leaves for "
        f"training ({plan.cluster.memory_gib:g} less {plan.cluster.reserved_gib:g} reserved); "
        "the largest term is "
        f"{dominant.name}, {dominant.value / GiB:.1f} GiB ({dominant.why}). Shard it further: "
        "more tp or pp, a higher zero stage, or recompute=full"
    )


def why_best(plans: list[Plan]) -> str:
    """A sentence on why the first plan beats the next one: the terms that differ most."""
    if len(plans) < 2:
        return "the only layout that fits"
    best, next_ = plans[0], plans[1]
    differences = sorted(
        (
            (b.exposed - n.exposed, b.name)
            for b, n in zip(best.time, next_.time, strict=True)
            if abs(b.exposed - n.exposed) > 1e-9
        ),
    )
    said = ", ".join(f"{name} {delta * 1e3:+.0f} ms" for delta, name in differences[:3])
    if next_.step_s - best.step_s < 1e-3 * best.step_s:
        return f"{best.layout} and {next_.layout} tie (within 0.1%); the first holds less memory"
    return (
        f"{best.layout} beats {next_.layout} by {(next_.step_s - best.step_s) * 1e3:.0f} ms a "
        f"step: {said}"
    )
