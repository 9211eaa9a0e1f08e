"""`python -m miniddp.bench sharding`: memory, traffic and step time of DDP, ZeRO-1, ZeRO-2 and
ZeRO-3, measured in one run against the formulas and against torch's own implementations.

Runs on 4 ranks (relaunched under torchrun) and forms groups of the first 1, 2 and 4 of them:

    memory    bytes per rank before the optimizer step, by kind (miniddp/sharding/memory.py),
              against the formulas; each rank's own share, so uneven partitions show
    traffic   bytes each rank sends in one step through MiniDDP's collectives (DDP and ZeRO-1
              average over our ring all-reduce here, so that every byte is counted), against
              2(W-1)/W·Ψ for DDP and ZeRO-2, 3(W-1)/W·Ψ for ZeRO-1 as torch builds it (a whole
              all-reduce, then the parameters again) and for ZeRO-3; padding is the difference
    time      on the 2-rank group: each of ours against torch's nearest design, interleaved and
              paired as in `bench step` (median of per-iteration ratios, 95% interval)
    prefetch  with --link: on the 2-rank group, ZeRO-3 with fully_shard's prefetch on against
              off over the simulated link, paired, and each one's time beyond compute against
              the model's (alpha-beta plus the host's time per collective); from the recorded
              steps, the most full parameters alive at once and the overlap fraction
              (miniddp/instruments/bench/sharding_overlap.py)

The model is an MLP of fp32 Linear layers, trained with AdamW.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch import nn

from miniddp import MiniDDP, ZeroRedundancyOptimizer, fully_shard
from miniddp.collectives import traffic
from miniddp.data_parallel.default_hooks import all_reduce_hook
from miniddp.instruments.bench.options import (
    add_iters_and_json,
    add_link_option,
    link_or_environment,
    whole_number,
)
from miniddp.instruments.bench.paired import (
    SAME_SPEED_AS_TORCH,
    paired_ratio,
    paired_ratio_interval,
    rotated,
)
from miniddp.instruments.bench.sharding_overlap import (
    report_prefetch,
    shard_bytes_per_unit,
    time_prefetch,
)
from miniddp.instruments.link_group import link_groups
from miniddp.job.env import cleanup, init_distributed
from miniddp.sharding import Formula, ddp_buckets, measure_memory, reduce_scatter_hook

STAGES = ("ddp", "zero1", "zero2", "zero3")
# ours -> torch's nearest: torch has no ZeRO-2, whose traffic is DDP's and whose update is ZeRO's
TIMED = {"zero1": "torch-zero1", "zero2": "torch-zero1", "zero3": "torch-zero3"}


def build_model(width: int, depth: int) -> nn.Sequential:
    """Linear layers alternating width -> width+1 -> width: sizes W rarely divides."""
    torch.manual_seed(0)
    sizes = [width + i % 2 for i in range(depth + 1)]
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])])


def setup(stage: str, model: nn.Sequential, group: dist.ProcessGroup, counted: bool) -> tuple:
    """(the module to call, the optimizer, the DDP buckets) for one design. `counted`: DDP and
    ZeRO-1 average over our ring, whose bytes `traffic` counts; else over gloo, as torch's do."""
    options = {"lr": 1e-3, "weight_decay": 0.01}
    if stage in ("zero3", "torch-zero3"):
        if stage == "zero3":
            shard = lambda m: fully_shard(m, process_group=group)  # noqa: E731
        else:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard as torch_fully_shard

            mesh = DeviceMesh.from_group(group, "cpu")
            shard = lambda m: torch_fully_shard(m, mesh=mesh)  # noqa: E731
        for layer in model:
            shard(layer)
        shard(model)
        return model, torch.optim.AdamW(model.parameters(), **options), []
    ddp = MiniDDP(model, process_group=group)
    if stage == "ddp":
        optimizer = torch.optim.AdamW(model.parameters(), **options)
    elif stage == "torch-zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

        optimizer = TorchZero(model.parameters(), torch.optim.AdamW, process_group=group, **options)
    else:
        optimizer = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, process_group=group, **options
        )
    if stage == "zero2":
        ddp.register_comm_hook(optimizer, reduce_scatter_hook)
    elif stage in ("ddp", "zero1") and counted:
        ddp.register_comm_hook(group, all_reduce_hook("ring"))  # so that traffic counts it
    return ddp, optimizer, ddp_buckets(ddp)


def train_step(module: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    module(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def measure(stage: str, args: argparse.Namespace, group: dist.ProcessGroup) -> dict:
    """One rank's memory before its second optimizer step, and the bytes it sent in that step."""
    model = build_model(args.width, args.depth)
    psi, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    module, optimizer, buckets = setup(stage, model, group, counted=True)
    x = torch.randn(args.batch, args.width)
    train_step(module, optimizer, x)
    traffic.reset()
    module(x).pow(2).mean().backward()
    memory = measure_memory(model.parameters(), optimizer, buckets)
    optimizer.step()
    sent = traffic.bytes_sent
    world = dist.get_world_size(group)
    if stage == "zero3":
        owned, owned_tensors = sum(p.numel() for p in model.parameters()), tensors
    elif stage == "ddp":
        owned, owned_tensors = psi, tensors
    else:
        mine = [p for p in model.parameters() if optimizer.owner_of(p) == optimizer.rank]
        owned, owned_tensors = sum(p.numel() for p in mine), len(mine)
    expected = Formula(stage, psi, owned_tensors, world).expected(owned)
    theory = {"ddp": 2, "zero1": 3, "zero2": 2, "zero3": 3}[stage] * (world - 1) / world * psi * 4
    return {
        "stage": stage,
        "world_size": world,
        "psi": psi,
        "owned_elements": owned,
        "memory": memory.__dict__,
        "total": memory.total,
        "formula_total": expected.total,
        "exact": memory == expected,
        "sent": sent,
        "sent_theory": theory,
    }


def time_designs(args: argparse.Namespace, group: dist.ProcessGroup) -> dict[str, list[float]]:
    """Seconds per training step of every design, interleaved; the slowest rank's."""
    names = sorted(set(TIMED) | set(TIMED.values()))
    designs: dict[str, tuple] = {}
    for name in names:
        designs[name] = setup(name, build_model(args.width, args.depth), group, counted=False)
    x = torch.randn(args.batch, args.width)
    for module, optimizer, _ in designs.values():
        for _ in range(2):
            train_step(module, optimizer, x)
    seconds = torch.zeros(len(names), args.iters, dtype=torch.float64)
    for iteration in range(args.iters):
        for name in rotated(names, iteration):
            module, optimizer, _ = designs[name]
            dist.barrier(group)
            start = time.perf_counter()
            train_step(module, optimizer, x)
            seconds[names.index(name), iteration] = time.perf_counter() - start
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    return {name: seconds[i].tolist() for i, name in enumerate(names)}


def report(rows: list[dict], times: dict[str, list[float]] | None) -> dict:
    print(f"\nmemory per rank (bytes, before the optimizer step), Ψ = {rows[0]['psi']:,} fp32")
    columns = ("params", "grads", "buckets", "adam", "total", "formula", "sent/step", "theory")
    print(f"{'W':>2} {'rank':>4} {'stage':<6} " + " ".join(f"{c:>11}" for c in columns))
    for row in rows:
        m = row["memory"]
        values = [m["parameters"], m["gradients"], m["buckets"], m["optimizer_state"]]
        values += [row["total"], row["formula_total"], row["sent"], round(row["sent_theory"])]
        mark = "" if row["exact"] else "  (differs from the formula)"
        print(
            f"{row['world_size']:>2} {row['rank']:>4} {row['stage']:<6} "
            + " ".join(f"{v:>11,}" for v in values)
            + mark
        )
    for row in rows:
        if row["stage"] == "zero3" and row["rank"] == 0 and row["world_size"] > 1:
            padding = row["owned_elements"] * row["world_size"] - row["psi"]
            per_rank = 16 * padding // row["world_size"]  # 4 + 4 + 8 bytes per element
            print(
                f"ZeRO-3 at W = {row['world_size']}: {padding} padding elements over all "
                f"ranks, {per_rank:,} bytes per rank (parameter, gradient, Adam)"
            )
    summary: dict = {"rows": rows}
    if times:
        print("\nstep time on 2 ranks, paired ratio ours / torch's (median, 95% interval)")
        summary["ratios"] = {}
        for ours, theirs in TIMED.items():
            ratio = paired_ratio(times[ours], times[theirs])
            low, high = paired_ratio_interval(times[ours], times[theirs])
            verdict = "ties" if ratio <= SAME_SPEED_AS_TORCH else "trails"
            print(
                f"  {ours:<6} vs {theirs:<12} {ratio:5.2f}x  [{low:.2f}, {high:.2f}]  "
                f"{verdict} torch's (a tie: a median <= {SAME_SPEED_AS_TORCH})"
            )
            summary["ratios"][ours] = {"against": theirs, "ratio": ratio, "interval": [low, high]}
        summary["seconds"] = times
    return summary


PREFETCH_BATCH = 2048  # at width 256, a unit's forward takes ~3.5 ms here: one gather's time


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m miniddp.bench sharding",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    positive = whole_number(at_least=1)
    parser.add_argument("--width", type=positive, default=256, help="Linear width (default 256)")
    parser.add_argument("--depth", type=positive, default=4, help="Linear layers (default 4)")
    parser.add_argument("--batch", type=positive, default=32, help="samples per rank (default 32)")
    add_iters_and_json(parser, 20, "timed steps (0 skips)", least=0)
    add_link_option(parser, "the prefetch section", "no prefetch section")
    parser.add_argument(
        "--prefetch-iters",
        type=whole_number(at_least=1),
        default=20,
        help="paired steps of the prefetch section (default 20)",
    )
    parser.add_argument(
        "--prefetch-batch",
        type=positive,
        default=PREFETCH_BATCH,
        help=f"samples per rank in the prefetch section (default {PREFETCH_BATCH}: a unit's "
        "forward about as long as its gather over alpha=200us,bandwidth=300mbit)",
    )
    args = parser.parse_args(argv)
    link_or_environment(parser, args)
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    env = init_distributed()
    torch.set_num_threads(1)  # one intra-op thread per rank: the ranks share the cores
    rows = []
    for world in [w for w in (1, 2, 4) if w <= env.world_size]:
        group = dist.new_group(list(range(world)))  # every rank takes part in creating it
        if env.rank < world:
            rows += [{**measure(stage, args, group), "rank": env.rank} for stage in STAGES]
    gathered: list[list[dict]] = [[] for _ in range(env.world_size)]
    dist.all_gather_object(gathered, rows)
    timing_group = dist.new_group([0, 1]) if env.world_size >= 2 else None
    times = (
        time_designs(args, timing_group) if timing_group and env.rank < 2 and args.iters else None
    )
    prefetch = None
    if timing_group and args.link:
        with link_groups():  # every rank makes the group; ranks 0 and 1 time over it
            linked = dist.new_group([0, 1])
            if env.rank < 2:
                prefetch = time_prefetch(lambda: build_model(args.width, args.depth), args, linked)
    if env.is_main:
        order = lambda r: (r["world_size"], STAGES.index(r["stage"]), r["rank"])  # noqa: E731
        everyone = sorted((r for rows in gathered for r in rows), key=order)
        summary = report(everyone, times)
        if prefetch:
            units, shard = args.depth, shard_bytes_per_unit(build_model(args.width, 1), 2)
            summary["prefetch"] = report_prefetch(prefetch, args.link, units, shard, 2)
        if args.json:
            with open(args.json, "w") as file:
                json.dump(summary, file, indent=2)
            print(f"wrote {args.json}")
    dist.barrier()
    cleanup()
