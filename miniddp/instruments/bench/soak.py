"""`python -m miniddp.bench soak`: a real model's training, for minutes, on a busy machine.

The tests prove that one 100 MB collective or a few 25M-parameter steps are right under load;
this runs long enough for the rare events: a collective that completes just after a fault
watcher looked (a false alarm would end the job), memory that creeps up step by step, a pair of
implementations that drift apart after hundreds of steps. MiniDDP and torch's DDP train the same
25M-parameter model from the same weights on the same batches (AdamW, clipping, a warmup and
cosine schedule), one step each in turn, while `--hogs` processes burn CPU beside them:

    python -m miniddp.bench soak                  # 10 minutes, one CPU hog
    python -m miniddp.bench soak --minutes 1 --hogs 2

It reports the false alarms (a `CollectiveFailed` in this healthy job: must be 0), whether every
parameter stayed bitwise torch's at every check, MiniDDP's step time over torch's as a paired
ratio with its 95% interval, and each rank's resident memory at the start, once the first
steps have made every buffer, and at the end.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from miniddp import MiniDDP
from miniddp.instruments.bench.options import whole_number
from miniddp.instruments.bench.paired import paired_ratio, paired_ratio_interval
from miniddp.job.env import cleanup, init_distributed
from miniddp.job.faults import CollectiveFailed


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m miniddp.bench soak", description=__doc__)
    parser.add_argument("--minutes", type=positive_minutes, default=10.0, help="how long")
    parser.add_argument("--hogs", type=whole_number(at_least=0), default=1, help="CPU burners")
    parser.add_argument("--width", type=whole_number(at_least=1), default=2048, help="per layer")
    parser.add_argument("--depth", type=whole_number(at_least=1), default=6, help="Linear layers")
    parser.add_argument("--batch", type=whole_number(at_least=1), default=8, help="rows per rank")
    parser.add_argument(
        "--check-every", type=whole_number(at_least=1), default=10, help="steps between checks"
    )
    return parser.parse_args(argv)


def positive_minutes(text: str) -> float:
    try:
        minutes = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of minutes") from None
    if not 0 < minutes < math.inf:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}; e.g. --minutes 10")
    return minutes


WARM_STEPS = 3  # after these, every buffer a step needs exists: memory should stay flat


def resident_mib() -> float:
    """This process's resident memory now (not its peak), from /proc."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * 4096 / 2**20


class Trainer:
    """One implementation's model, optimizer and schedule; `step()` trains on one batch."""

    def __init__(self, model: nn.Module, total_steps: int) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        warmup = max(1, total_steps // 20)

        def warmup_then_cosine(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / total_steps)))

        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_then_cosine)
        self.seconds: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        dist.barrier()  # both implementations start their step from the same line
        start = time.perf_counter()
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=1.0)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.seconds.append(time.perf_counter() - start)
        return loss.item()


def same_parameters(ours: Trainer, theirs: Trainer) -> bool:
    pairs = zip(ours.model.parameters(), theirs.model.parameters())
    return all(torch.equal(mine, reference) for mine, reference in pairs)


def build(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(args.width, args.width) for _ in range(args.depth)]
    return nn.Sequential(*[m for layer in layers for m in (layer, nn.GELU())][:-1])


def soak(args: argparse.Namespace) -> dict:
    """Train both until the time is up; return this rank's findings."""
    rank = dist.get_rank()
    estimated_steps = max(10, int(args.minutes * 60))  # for the schedule's length only
    ours = Trainer(MiniDDP(build(args)), estimated_steps)
    theirs = Trainer(nn.parallel.DistributedDataParallel(build(args)), estimated_steps)
    generator = torch.Generator().manual_seed(1000 + rank)
    findings = {"rss_start": resident_mib(), "false_alarms": 0, "checks": 0, "differed": 0}
    deadline = torch.tensor([time.monotonic() + args.minutes * 60], dtype=torch.float64)
    dist.broadcast(deadline, src=0)  # rank 0's clock decides, so every rank stops together
    steps = 0
    try:
        while True:
            stop = torch.tensor([float(time.monotonic() > deadline.item())])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                break
            x = torch.randn(args.batch, args.width, generator=generator)
            y = torch.randn(args.batch, args.width, generator=generator)
            same_loss = ours.step(x, y) == theirs.step(x, y)
            steps += 1
            if steps == WARM_STEPS:  # optimizer states and buckets exist from here on
                findings["rss_warm"] = resident_mib()
            if steps % args.check_every == 0 or not same_loss:
                findings["checks"] += 1
                findings["differed"] += not (same_loss and same_parameters(ours, theirs))
        findings["checks"] += 1  # and once at the end
        findings["differed"] += not same_parameters(ours, theirs)
    except CollectiveFailed as error:  # a healthy job: any such error is a false alarm
        findings["false_alarms"] += 1
        findings["error"] = str(error).splitlines()[0]
    findings.update(steps=steps, rss_end=resident_mib(), ours=ours.seconds, theirs=theirs.seconds)
    return findings


def report(everyone: list[dict], args: argparse.Namespace, load: tuple[float, float]) -> None:
    ours = [max(times) for times in zip(*(f["ours"] for f in everyone))]  # the slowest rank's
    theirs = [max(times) for times in zip(*(f["theirs"] for f in everyone))]
    params = sum(p.numel() for p in build(args).parameters())
    print(
        f"\nsoak: {params / 1e6:.1f}M parameters, {everyone[0]['steps']} steps of each in "
        f"{args.minutes:g} min, {args.hogs} CPU hog(s); load average {load[0]:.1f} -> "
        f"{load[1]:.1f}"
    )
    alarms = sum(f["false_alarms"] for f in everyone)
    cause = f": {everyone[0]['error']}" if alarms else ""
    print(f"  false alarms: {alarms} (must be 0){cause}")
    checks, differed = everyone[0]["checks"], sum(f["differed"] for f in everyone)
    print(
        f"  bitwise torch's DDP: {'yes' if not differed else 'NO'} "
        f"({checks} checks of every parameter and loss, {differed} differed)"
    )
    if ours:
        low, high = paired_ratio_interval(ours, theirs) if len(ours) >= 6 else (math.nan,) * 2
        print(
            f"  step time, MiniDDP / torch's DDP: {paired_ratio(ours, theirs):.3f} "
            f"(95% interval {low:.3f}-{high:.3f}); medians {statistics.median(ours):.3f} s "
            f"and {statistics.median(theirs):.3f} s"
        )
    for rank, f in enumerate(everyone):
        warm = f"{f['rss_warm']:.0f} MiB after {WARM_STEPS} steps, " if "rss_warm" in f else ""
        print(
            f"  rank {rank} resident memory: {f['rss_start']:.0f} MiB at the start, {warm}"
            f"{f['rss_end']:.0f} MiB at the end"
        )


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    init_distributed()
    spin = [sys.executable, "-c", "while True: pass"]
    hogs = [subprocess.Popen(spin) for _ in range(args.hogs)] if dist.get_rank() == 0 else []
    load_before = _load_average()
    try:
        findings = soak(args)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    if findings["false_alarms"]:  # the group is unusable now: say so from this rank, and fail
        report([findings], args, (load_before, _load_average()))
        sys.exit(1)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, findings)
    if dist.get_rank() == 0:
        report(everyone, args, (load_before, _load_average()))
    cleanup()


def _load_average() -> float:
    with open("/proc/loadavg") as loadavg:
        return float(loadavg.read().split()[0])
