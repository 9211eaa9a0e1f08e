"""The prefetch section of `python -m miniddp.bench sharding --link ...`: a ZeRO-3 step with
fully_shard's prefetch on against off, on 2 ranks over the simulated link, paired; each one's
time beyond compute against the model's prediction (below); the most full parameters alive at
once; and the share of the transfers' time under compute, chapter 04's overlap fraction.

Each variant runs over the link and over a free one (no latency, no bandwidth limit),
interleaved, and every timed step is recorded (sharding/unit_lanes.py: a few events a unit), so
that its compute is measured, not assumed: the union of its units' forward and backward spans.
A step is the forward and backward (the optimizer's step, the same everywhere, is left out).

The model (observe/overlap_model.py's predict_zero3_step) is alpha-beta plus LogP's o. Its
inputs: each unit's forward and backward, and the host's time per collective, both measured on
the steps without prefetch, where nothing runs beside them (o: their idle time, no unit
computing and nothing on the link, divided by their 3U collectives); U units of n shard bytes
per rank, W ranks, and the link's latency alpha and bandwidth B (miniddp/observe/link.py): each
gather and each reduce-scatter takes alpha + (W-1) n / B (a gather's 8-byte label, units.py,
rides in its messages). It then predicts the steps with prefetch, where nothing of theirs was
fitted. Compared:

    beyond compute   step - compute, against the model's: its exposed transfers and its o's
    the link adds    step over the link - step over a free link (paired), against the model's
                     exposed transfers; it comes out under them, because over the free link the
                     real gloo transfers still cost (two ranks computing on 2 cores: a transfer
                     shares a core), and over the link its delay hides them
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn

from miniddp import fully_shard
from miniddp.instruments.bench.paired import paired_ratio, paired_ratio_interval, rotated
from miniddp.instruments.link_group import simulated_link
from miniddp.observe.link import Link
from miniddp.observe.overlap_model import PredictedZero3Step, predict_zero3_step
from miniddp.sharding.unit_lanes import recording, summarize, unit_timeline

VARIANTS = ("prefetch", "no prefetch")
FREE = ", free link"  # the same variant over a link that costs nothing
FREE_LINK = Link(alpha=0.0, bandwidth=1e18)


def time_prefetch(model_of, args: argparse.Namespace, group: dist.ProcessGroup) -> dict:
    """Each variant's steps over the link and over a free one, interleaved and recorded: the
    step (the slowest rank's), and on rank 0 its compute, its peak of full parameters and its
    overlap; and what no-prefetch's units computed, per unit, for the model."""
    x = torch.randn(args.prefetch_batch, args.width)
    models = {}
    for name in [*VARIANTS, *(variant + FREE for variant in VARIANTS)]:
        model = model_of()
        for layer in model:
            fully_shard(layer, process_group=group)
        models[name] = fully_shard(model, process_group=group)
        models[name].set_prefetch(name.startswith("prefetch"))
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    steps = {name: [] for name in models}

    def step(name: str) -> None:
        dist.barrier(group)
        link = FREE_LINK if name.endswith(FREE) else args.link
        with simulated_link(link):
            with recording(models[name]) as recorded:
                start = time.perf_counter()
                models[name](x).pow(2).mean().backward()
                seconds = time.perf_counter() - start
            optimizers[name].step()
            optimizers[name].zero_grad()
        steps[name].append((seconds, recorded))

    for iteration in range(2 + args.prefetch_iters):  # two warm-up steps: the order is known
        for name in rotated(list(models), iteration):
            step(name)
    timed = {name: done[2:] for name, done in steps.items()}
    times = torch.tensor([[s for s, _ in timed[name]] for name in models], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    timelines = {name: [unit_timeline(r.events) for _, r in timed[name]] for name in VARIANTS}
    summaries = {name: [summarize(t) for t in timelines[name]] for name in VARIANTS}
    per_unit = {  # no-prefetch's compute, one unit's forward and backward, each step
        kind: [
            sum(s.duration for s in t.spans if s.name.startswith(kind)) / len(model)
            for t in timelines["no prefetch"]
        ]
        for kind in ("forward", "backward")
    }
    return {
        "seconds": {name: times[i].tolist() for i, name in enumerate(models)},
        "compute_s": {name: [s.compute_s for s in summaries[name]] for name in VARIANTS},
        "unit_compute_s": per_unit,
        "peak_full_bytes": {
            name: max(r.peak_full_bytes for _, r in timed[name]) for name in VARIANTS
        },
        "overlap": {name: median([s.overlap for s in summaries[name]]) for name in VARIANTS},
        "idle_s": {name: median([s.idle_s for s in summaries[name]]) for name in VARIANTS},
    }


def predicted(
    link: Link,
    forward: float,
    backward: float,
    units: int,
    shard_bytes: int,
    world: int,
    host: float = 0.0,
) -> dict[str, PredictedZero3Step]:
    """The model's step with prefetch off and on (see the module docstring)."""
    transfer = link.seconds((world - 1) * shard_bytes)  # a gather's label rides along: 8 B
    return {
        name: predict_zero3_step(units, forward, backward, transfer, transfer, on, host)
        for name, on in (("prefetch", True), ("no prefetch", False))
    }


def report_prefetch(recorded: dict, link: Link, units: int, shard_bytes: int, world: int) -> dict:
    """`recorded`: what time_prefetch returned."""
    times, compute = recorded["seconds"], recorded["compute_s"]
    forward, backward = (median(recorded["unit_compute_s"][k]) for k in ("forward", "backward"))
    host = recorded["idle_s"]["no prefetch"] / (3 * units)  # LogP's o: see the module docstring
    model = predicted(link, forward, backward, units, shard_bytes, world, host)
    speedup = paired_ratio(times["no prefetch"], times["prefetch"])
    low, high = paired_ratio_interval(times["no prefetch"], times["prefetch"])
    transfer = link.seconds((world - 1) * shard_bytes)
    ms = lambda seconds: f"{seconds * 1e3:6.2f} ms"  # noqa: E731
    print(f"\nZeRO-3 prefetch over the link ({link}), 2 ranks, {units} units of {shard_bytes:,} B")
    print(
        f"  a unit computes {ms(forward)} forward, {ms(backward)} backward (no prefetch's); "
        f"a transfer takes {ms(transfer)}; the host {ms(host)} a collective"
    )
    beyond, added = {}, {}
    for name in VARIANTS:
        beyond[name] = (
            median([step - busy for step, busy in zip(times[name], compute[name])]),
            model[name].beyond_compute_s,
        )
        added[name] = median([a - b for a, b in zip(times[name], times[name + FREE])])  # paired
        measured, expected = beyond[name]
        print(
            f"  {name:<12} step {ms(median(times[name]))} (model {ms(model[name].step_s)}); "
            f"beyond compute {ms(measured)}, model {ms(expected)} "
            f"({measured / expected:.2f}x the model)"
        )
        print(
            f"  {'':<12} over a free link {ms(median(times[name + FREE]))}: the link adds "
            f"{ms(added[name])} (the model's exposed transfers: {ms(model[name].exposed_s)})"
        )
    print(f"  prefetch speedup, paired: {speedup:.2f}x  [{low:.2f}, {high:.2f}]")
    exposed = {name: beyond[name][0] - model[name].host_s for name in VARIANTS}
    hidden = 1 - exposed["prefetch"] / exposed["no prefetch"]
    print(
        f"  overlap: prefetch hides {hidden:.0%} of the transfers exposed without it (model "
        f"{1 - model['prefetch'].exposed_s / model['no prefetch'].exposed_s:.0%})"
    )
    unit_bytes = world * shard_bytes
    for name in VARIANTS:
        peak = recorded["peak_full_bytes"][name]
        print(
            f"  {name:<12} full parameters at most {peak:,} B ({peak / unit_bytes:.2f} units), "
            f"{recorded['overlap'][name]:.0%} of transfers under compute (model "
            f"{model[name].overlap:.0%}), idle {ms(recorded['idle_s'][name])}"
        )
    print("  (rank 0's recorded steps; idle: nothing computing, nothing on the link)")
    return {
        **recorded,
        "speedup": speedup,
        "interval": [low, high],
        "beyond_compute_measured_and_model": beyond,
        "link_adds_s": added,
        "host_s": host,
        "hidden_fraction": hidden,
    }


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def shard_bytes_per_unit(model: nn.Sequential, world: int) -> int:
    """fp32 bytes of one rank's shard of the first layer (the bench's layers are all alike)."""
    return sum(-(-p.numel() // world) for p in model[0].parameters()) * 4
