"""`python -m miniddp.bench pp`: a pipeline step of miniddp.pipeline against torch's own
torch.distributed.pipelining, the same model cut the same way, GPipe and 1F1B.

Every rank is one stage (2 by default: relaunched under torchrun). Each iteration runs every
design once, in an order rotated by one per iteration, a barrier before each step; a step's
time is the slowest stage's. Reported: the median over iterations of ours / torch's, each pair
from the same iteration, with its 95% interval (miniddp/bench/paired.py).

    --link none                      the bare machine: gloo over loopback
    --link alpha=1ms,bandwidth=1gbit every activation and gradient crosses a simulated link

The simulated link (`p2p_link`) delays each send, ours and torch's alike, until the link would
have carried it: alpha + bytes / bandwidth, one transfer at a time per rank, as
miniddp/observe/link.py does for collectives (which do not cover send and receive).
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn

from miniddp.bench.options import whole_number, writable_file
from miniddp.bench.paired import paired_ratio, paired_ratio_interval, quantile, rotated
from miniddp.job.env import cleanup, init_distributed
from miniddp.observe.link import Link, LinkQueue, LinkWork
from miniddp.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe

DESIGNS = ("gpipe", "torch-gpipe", "1f1b", "torch-1f1b")


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def build_stage_module(width: int, layers: int, rank: int) -> nn.Sequential:
    torch.manual_seed(rank)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    )


def build(design: str, module: nn.Module, m: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    if design.startswith("torch-"):
        from torch.distributed.pipelining import PipelineStage as TorchStage
        from torch.distributed.pipelining import Schedule1F1B as Torch1F1B
        from torch.distributed.pipelining import ScheduleGPipe as TorchGPipe

        cls = TorchGPipe if design == "torch-gpipe" else Torch1F1B
        return cls(TorchStage(module, rank, world, "cpu"), m, loss_fn=mse)
    cls = ScheduleGPipe if design == "gpipe" else Schedule1F1B
    return cls(PipelineStage(module, rank, world, "cpu"), m, mse)


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


class _DelayedSends:
    """One thread that issues each send when the link has carried it; dues only grow, so a
    FIFO keeps every pair's messages in order."""

    def __init__(self, original_isend) -> None:
        self.original = original_isend
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True, name="bench-p2p-link").start()

    def _serve(self) -> None:
        while True:
            due, args, kwargs, future, delivered = self.queue.get()
            time.sleep(max(0.0, due - time.perf_counter()))
            work = self.original(*args, **kwargs)
            threading.Thread(target=_complete, args=(work, future, delivered), daemon=True).start()


def _complete(work, future: torch.futures.Future, delivered: threading.Event) -> None:
    try:
        work.wait()
        future.set_result(None)
    except Exception as error:
        future.set_exception(error)
    delivered.set()


@contextmanager
def p2p_link(link: Link | None) -> Iterator[None]:
    """Inside, every `dist.isend` (ours and torch's, which both go through it) is delayed until
    the simulated link would have delivered it. Receives are untouched: they complete when the
    data arrives."""
    if link is None:
        yield
        return
    original = c10d.isend
    wire, sender = LinkQueue(link), _DelayedSends(original)

    def isend_over_the_link(tensor, dst=None, group=None, tag=0, group_dst=None):
        due = wire.deliver_at(time.perf_counter(), tensor.numel() * tensor.element_size())
        future: torch.futures.Future = torch.futures.Future()
        delivered = threading.Event()
        kwargs = {"dst": dst, "group": group, "tag": tag, "group_dst": group_dst}
        sender.queue.put((due, (tensor,), kwargs, future, delivered))
        return LinkWork(future, delivered)

    # torch checks a P2POp's function against c10d.isend, so both names must change.
    c10d.isend = dist.isend = isend_over_the_link
    try:
        yield
    finally:
        c10d.isend = dist.isend = original


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
    print(f"  {'design':<12} {'median':>9} {'p10':>9} {'p90':>9}")
    for design, values in times.items():
        row = [quantile(values, q) * 1e3 for q in (0.5, 0.1, 0.9)]
        print(f"  {design:<12} " + " ".join(f"{v:>7.2f}ms" for v in row))
    ratios = {}
    print("  paired ratio ours / torch's (median, 95% interval):")
    for ours in ("gpipe", "1f1b"):
        theirs = f"torch-{ours}"
        ratio = paired_ratio(times[ours], times[theirs])
        low, high = paired_ratio_interval(times[ours], times[theirs])
        ratios[ours] = {"ratio": ratio, "interval": [low, high]}
        print(f"  {ours:<5} vs {theirs:<11} {ratio:5.2f}x  [{low:.2f}, {high:.2f}]")
    return {"link": str(link) if link else "none", "times": times, "ratios": ratios}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m miniddp.bench pp", description=__doc__)
    count = whole_number(at_least=1)
    parser.add_argument("--width", type=count, default=512, help="Linear width (default 512)")
    parser.add_argument("--layers", type=count, default=2, help="Linear+GELU per stage (default 2)")
    parser.add_argument("--batch", type=count, default=64, help="samples per step (default 64)")
    parser.add_argument("--microbatches", type=count, default=4, help="m (default 4)")
    parser.add_argument("--iters", type=count, default=30, help="timed iterations (default 30)")
    parser.add_argument("--warmup", type=whole_number(at_least=0), default=3)
    parser.add_argument(
        "--link",
        type=Link.parse,
        action="append",
        help="'none' or e.g. alpha=1ms,bandwidth=1gbit; repeat to run several "
        "(default: none, then alpha=1ms,bandwidth=1gbit)",
    )
    parser.add_argument(
        "--json", metavar="PATH", type=writable_file, help="also write the results here"
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    links = args.link or [None, Link.parse("alpha=1ms,bandwidth=1gbit")]
    init_distributed()
    results = []
    for link in links:
        with p2p_link(link):
            times = time_designs(args)
        if dist.get_rank() == 0:
            results.append(report(times, link))
    if dist.get_rank() == 0 and args.json:
        with open(args.json, "w") as file:
            json.dump({"settings": vars(args) | {"link": None}, "runs": results}, file, indent=2)
        print(f"wrote {args.json}")
    cleanup()
