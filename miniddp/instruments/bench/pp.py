"""`python -m miniddp.bench pp`: a pipeline step of miniddp.pipeline against torch's own
torch.distributed.pipelining, the same model cut the same way: GPipe, 1F1B, interleaved 1F1B
and interleaved zero bubble.

Every rank is one stage (2 ranks by default: relaunched under torchrun), or for the interleaved
designs two stages of half its layers each (v = 2, stage s on rank s % W). Each iteration runs every
design once, in an order rotated by one per iteration, a barrier before each step; a step's
time is the slowest stage's. Reported: the median over iterations of ours / torch's, each pair
from the same iteration, with its 95% interval (miniddp/instruments/bench/paired.py).

    --link none                      the bare machine: gloo over loopback
    --link alpha=1ms,bandwidth=1gbit every activation and gradient crosses a simulated link

The simulated link (`simulated_link`, miniddp/instruments/link_group.py) is a process group that
delays each send, ours and torch's alike, until the link would have carried it:
alpha + bytes / bandwidth, one transfer at a time per rank.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch import nn

from miniddp.instruments.bench.options import (
    add_iters_and_json,
    add_links_option,
    links_to_run,
    whole_number,
)
from miniddp.instruments.bench.paired import paired_ratio, paired_ratio_interval, quantile, rotated
from miniddp.instruments.link_group import simulated_link
from miniddp.job.env import cleanup, init_distributed
from miniddp.observe.link import Link
from miniddp.pipeline import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

OURS = ("gpipe", "1f1b", "interleaved", "zero-bubble")
DESIGNS = tuple(d for ours in OURS for d in (ours, f"torch-{ours}"))
INTERLEAVED = ("interleaved", "zero-bubble")
V = 2  # stages a rank in the interleaved designs


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def build_stage_module(width: int, layers: int, rank: int) -> nn.Sequential:
    torch.manual_seed(rank)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    )


def build(design: str, module: nn.Sequential, m: int):
    """`design`'s schedule over this rank's layers `module`: one stage, or (interleaved) V
    stages of consecutive layers, stage rank + i W holding the i-th part."""
    import torch.distributed.pipelining as theirs

    rank, world = dist.get_rank(), dist.get_world_size()
    torch_design = design.startswith("torch-")
    name = design.removeprefix("torch-")
    classes = {
        "gpipe": (ScheduleGPipe, theirs.ScheduleGPipe),
        "1f1b": (Schedule1F1B, theirs.Schedule1F1B),
        "interleaved": (ScheduleInterleaved1F1B, theirs.ScheduleInterleaved1F1B),
        "zero-bubble": (ScheduleInterleavedZeroBubble, theirs.ScheduleInterleavedZeroBubble),
    }
    cls = classes[name][torch_design]
    stage_class = theirs.PipelineStage if torch_design else PipelineStage
    if name in INTERLEAVED:
        layers = list(module)
        if len(layers) < V:
            raise SystemExit(f"the interleaved designs cut a rank's layers in {V}: --layers >= {V}")
        cut = [len(layers) * i // V for i in range(V + 1)]
        parts = [nn.Sequential(*layers[cut[i] : cut[i + 1]]) for i in range(V)]
        stages = [
            stage_class(part, rank + i * world, V * world, "cpu") for i, part in enumerate(parts)
        ]
    else:
        stages = stage_class(module, rank, world, "cpu")
    return cls(stages, m, loss_fn=mse) if torch_design else cls(stages, m, mse)


def step(schedule, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for param in module.parameters():
        param.grad = None
    if rank == 0:
        schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=y, losses=[])
    else:
        schedule.step()


def time_designs(args: argparse.Namespace) -> dict[str, list[float]]:
    """Each design's step time (the slowest stage's wall seconds) in every timed iteration."""
    rank = dist.get_rank()
    modules = {d: build_stage_module(args.width, args.layers, rank) for d in DESIGNS}
    schedules = {d: build(d, modules[d], args.microbatches) for d in DESIGNS}
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.width, generator=generator)
    y = torch.randn(args.batch, args.width, generator=generator)
    times: dict[str, list[float]] = {d: [] for d in DESIGNS}
    for iteration in range(args.warmup + args.iters):
        for design in rotated(list(DESIGNS), iteration):
            dist.barrier()
            start = time.perf_counter()
            step(schedules[design], modules[design], x, y)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if iteration >= args.warmup:
                times[design].append(elapsed.item())
    return times


def report(times: dict[str, list[float]], link: Link | None) -> dict:
    where = "the bare machine" if link is None else f"a simulated link ({link})"
    print(f"\npipeline step on {dist.get_world_size()} stages, {where}")
    print(f"  {'design':<17} {'median':>9} {'p10':>9} {'p90':>9}")
    for design, values in times.items():
        row = [quantile(values, q) * 1e3 for q in (0.5, 0.1, 0.9)]
        print(f"  {design:<17} " + " ".join(f"{v:>7.2f}ms" for v in row))
    ratios = {}
    print("  paired ratio ours / torch's (median, 95% interval):")
    for ours in OURS:
        theirs = f"torch-{ours}"
        ratio = paired_ratio(times[ours], times[theirs])
        low, high = paired_ratio_interval(times[ours], times[theirs])
        ratios[ours] = {"ratio": ratio, "interval": [low, high]}
        print(f"  {ours:<11} vs {theirs:<17} {ratio:5.2f}x  [{low:.2f}, {high:.2f}]")
    return {"link": str(link) if link else "none", "times": times, "ratios": ratios}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m miniddp.bench pp", description=__doc__)
    count = whole_number(at_least=1)
    parser.add_argument("--width", type=count, default=512, help="Linear width (default 512)")
    parser.add_argument("--layers", type=count, default=2, help="Linear+GELU per stage (default 2)")
    parser.add_argument("--batch", type=count, default=64, help="samples per step (default 64)")
    parser.add_argument("--microbatches", type=count, default=4, help="m (default 4)")
    add_iters_and_json(parser, 30, "timed iterations")
    parser.add_argument("--warmup", type=whole_number(at_least=0), default=3)
    add_links_option(parser, "every activation and gradient")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    links = links_to_run(args)
    init_distributed()
    results = []
    for link in links:
        with simulated_link(link):
            times = time_designs(args)
        if dist.get_rank() == 0:
            results.append(report(times, link))
    if dist.get_rank() == 0 and args.json:
        with open(args.json, "w") as file:
            json.dump({"settings": vars(args) | {"link": None}, "runs": results}, file, indent=2)
        print(f"wrote {args.json}")
    cleanup()
