"""The prefetch section of `python -m miniddp.bench sharding --link ...`: a ZeRO-3 step with
fully_shard's prefetch on against off, on 2 ranks over the simulated link, paired; each one's
exposed communication against the alpha-beta model's prediction (observe/overlap_model.py's
predict_zero3_step); and, from one recorded step of each (sharding/unit_lanes.py), the most full
parameters alive at once and the share of the transfers' time under compute, chapter 04's
overlap fraction.

The model is fed U equal units of n shard bytes per rank, W ranks, a link of latency alpha and
bandwidth B (miniddp/observe/link.py), and the step time C over a free link, split 1 : 2 between
forward and backward (c_f = C/3U, c_b = 2C/3U per unit); each transfer takes
alpha + (W-1) n / B, each unit's 8-byte check (units.py) alpha + (W-1) 8 / B.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn

import miniddp.collectives
from miniddp import fully_shard
from miniddp.bench.paired import paired_ratio, paired_ratio_interval, rotated
from miniddp.observe.link import Link, simulated_link
from miniddp.observe.overlap_model import PredictedZero3Step, predict_zero3_step
from miniddp.sharding.unit_lanes import recording, summarize, unit_timeline
from miniddp.sharding.units import UNIT_NUMBER_BYTES

VARIANTS = ("prefetch", "no prefetch")
# "bare": a link that costs nothing, so that the compute includes what simulating a link costs
# here (a delivery thread's wake-ups: about 20 ms a step on this 2-core machine, under load)
FREE_LINK = Link(alpha=0.0, bandwidth=1e18)


def time_prefetch(model_of, args: argparse.Namespace, group: dist.ProcessGroup) -> dict:
    """Seconds per step of "bare" (prefetch on, over FREE_LINK: the compute) and of the two
    variants over the link, interleaved; the slowest rank's. Then one recorded step of each
    variant: its peak of full parameters and its overlap, rank 0's."""
    x = torch.randn(args.batch, args.width)
    models = {}
    for name in ("bare", *VARIANTS):
        model = model_of()
        for layer in model:
            fully_shard(layer, process_group=group)
        models[name] = fully_shard(model, process_group=group)
        models[name].set_prefetch(name != "no prefetch")
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    seconds = {name: [] for name in models}

    def step(name: str, recorded: dict | None = None) -> None:
        dist.barrier(group)
        link = FREE_LINK if name == "bare" else args.link
        with simulated_link(link, also=(miniddp.collectives,)), contextlib.ExitStack() as stack:
            if recorded is not None:
                recorded[name] = stack.enter_context(recording(models[name]))
            start = time.perf_counter()
            models[name](x).pow(2).mean().backward()
            optimizers[name].step()
            optimizers[name].zero_grad()
            seconds[name].append(time.perf_counter() - start)

    for iteration in range(2 + args.prefetch_iters):  # two warm-up steps: the order is known
        for name in rotated(list(models), iteration):
            step(name)
    times = torch.tensor([seconds[name][2:] for name in models], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    recorded: dict = {}
    for name in VARIANTS:
        step(name, recorded)
    summaries = {name: summarize(unit_timeline(r.events)) for name, r in recorded.items()}
    return {
        "seconds": {name: times[i].tolist() for i, name in enumerate(models)},
        "peak_full_bytes": {name: r.peak_full_bytes for name, r in recorded.items()},
        "overlap": {name: summary.overlap for name, summary in summaries.items()},
        "idle_s": {name: summary.idle_s for name, summary in summaries.items()},
    }


def predicted(
    link: Link, bare: float, units: int, shard_bytes: int, world: int
) -> dict[str, PredictedZero3Step]:
    """The model's step with prefetch off and on (see the module docstring)."""
    transfer = link.seconds((world - 1) * shard_bytes)
    check = link.seconds((world - 1) * UNIT_NUMBER_BYTES)
    forward, backward = bare / (3 * units), 2 * bare / (3 * units)
    return {
        name: predict_zero3_step(units, forward, backward, transfer, transfer, check, on)
        for name, on in (("prefetch", True), ("no prefetch", False))
    }


def report_prefetch(recorded: dict, link: Link, units: int, shard_bytes: int, world: int) -> dict:
    """`recorded`: what time_prefetch returned."""
    times = recorded["seconds"]
    median = {name: sorted(s)[len(s) // 2] for name, s in times.items()}
    steps = predicted(link, median["bare"], units, shard_bytes, world)
    model = {name: step.step_s for name, step in steps.items()}
    speedup = paired_ratio(times["no prefetch"], times["prefetch"])
    low, high = paired_ratio_interval(times["no prefetch"], times["prefetch"])
    print(f"\nZeRO-3 prefetch over the link ({link}), 2 ranks, {units} units of {shard_bytes:,} B")
    print(f"  over a free link (the compute) {median['bare'] * 1e3:7.2f} ms")
    exposed = {}
    for name in VARIANTS:
        exposed[name] = (median[name] - median["bare"], model[name] - median["bare"])
        measured, expected = exposed[name]
        print(
            f"  {name:<12} step {median[name] * 1e3:8.2f} ms, exposed communication "
            f"{measured * 1e3:7.2f} ms, model {expected * 1e3:7.2f} ms "
            f"({measured / expected:.2f}x the model)"
        )
    print(f"  prefetch speedup, paired: {speedup:.2f}x  [{low:.2f}, {high:.2f}]")
    comm = exposed["no prefetch"][0]
    hidden = 1 - exposed["prefetch"][0] / comm if comm > 0 else float("nan")
    print(f"  overlap: prefetch hides {hidden:.0%} of the communication exposed without it")
    unit_bytes = world * shard_bytes
    for name in VARIANTS:
        peak = recorded["peak_full_bytes"][name]
        print(
            f"  {name:<12} full parameters at most {peak:,} B ({peak / unit_bytes:.2f} units), "
            f"{recorded['overlap'][name]:.0%} of transfers under compute"
        )
        print(
            f"  {'':<12} idle (nothing computing, nothing on the link) "
            f"{recorded['idle_s'][name] * 1e3:.1f} ms: checks, copies, wake-ups"
        )
    overlap = steps["prefetch"].overlap
    print(
        f"  (one recorded step each, on rank 0; the model's overlap with prefetch: {overlap:.0%})"
    )
    return {
        **recorded,
        "speedup": speedup,
        "interval": [low, high],
        "exposed_measured_and_model": exposed,
        "hidden_fraction": hidden,
    }


def shard_bytes_per_unit(model: nn.Sequential, world: int) -> int:
    """fp32 bytes of one rank's shard of the first layer (the bench's layers are all alike)."""
    return sum(-(-p.numel() // world) for p in model[0].parameters()) * 4
