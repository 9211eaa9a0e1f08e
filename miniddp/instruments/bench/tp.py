"""`python -m miniddp.bench tp`: a training step of MiniDDP's tensor parallelism against torch's
DTensor-based one, on the same transformer block, the same plan and the same batch.

    python -m miniddp.bench tp [--width 256] [--heads 8] [--batch 8] [--length 64] [--iters 30]

Both split the block the same way (q, k, v and the MLP's first layer colwise, the output
projections rowwise) and send the same all-reduces; what differs is the machinery around them.
torch's parameters are DTensors: every op on them goes through DTensor's Python dispatch (a
sharding propagation, a cache lookup, redistributions), where ours are plain tensors and call the
collective directly from two autograd functions. So the ratio measures that dispatch, and the
GPU run says whether it is hidden behind the kernels.

Timed: forward, backward and an SGD step, interleaved (the order rotated each iteration, a
barrier before each step), the slowest rank's time per step; reported as the median of the
per-iteration ratios ours / torch's with its 95% interval (miniddp/instruments/bench/paired.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from miniddp.instruments.bench.options import add_iters_and_json, whole_number
from miniddp.instruments.bench.paired import paired_ratio, paired_ratio_interval, rotated
from miniddp.job.env import cleanup, init_distributed
from miniddp.tensor_parallel import ColwiseParallel, TransformerBlock, parallelize_module, plan_for

WARMUP = 3  # DTensor caches each op's sharding decision on first sight


def build(args: argparse.Namespace, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return TransformerBlock(args.width, args.heads, fused_qkv=args.fused_qkv).to(device)


def ours(args: argparse.Namespace, device: torch.device) -> nn.Module:
    block = build(args, device)
    return parallelize_module(block, None, plan_for(block))


def torch_tp(args: argparse.Namespace, device: torch.device) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import parallel as torch_parallel

    block = build(args, device)
    plan = {
        name: torch_parallel.ColwiseParallel()
        if isinstance(style, ColwiseParallel)
        else torch_parallel.RowwiseParallel()
        for name, style in plan_for(block).items()
    }
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    return torch_parallel.parallelize_module(block, mesh, plan)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch) -> torch.Tensor:
    x, y = batch
    output = model(x)
    F.mse_loss(output, y).backward()
    optimizer.step()
    optimizer.zero_grad()
    if x.is_cuda:
        torch.cuda.synchronize()  # the step ends when the GPU is done, not when it was told
    return output


def time_both(args: argparse.Namespace, device: torch.device) -> tuple[dict, float]:
    """Each design's seconds per step (the slowest rank's), and how far apart their outputs
    are after the warm-up steps (the same maths: within rounding, else the timing is moot)."""
    models = {"ours": ours(args, device), "torch": torch_tp(args, device)}
    optimizers = {n: torch.optim.SGD(m.parameters(), lr=1e-3) for n, m in models.items()}
    g = torch.Generator().manual_seed(1)
    shape = (args.batch, args.length, args.width)
    batch = tuple(torch.randn(shape, generator=g).to(device) for _ in range(2))
    outputs = {}
    for name in models:
        for _ in range(WARMUP):
            outputs[name] = train_step(models[name], optimizers[name], batch).detach()
    apart = float((outputs["ours"] - outputs["torch"]).abs().max())
    names = list(models)
    seconds = torch.zeros(len(names), args.iters, dtype=torch.float64)
    for iteration in range(args.iters):
        for name in rotated(names, iteration):
            dist.barrier()
            start = time.perf_counter()
            train_step(models[name], optimizers[name], batch)
            seconds[names.index(name), iteration] = time.perf_counter() - start
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    return {name: seconds[i].tolist() for i, name in enumerate(names)}, apart


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m miniddp.bench tp", description=__doc__)
    parser.add_argument("--width", type=whole_number(at_least=1), default=256)
    parser.add_argument("--heads", type=whole_number(at_least=1), default=8)
    parser.add_argument("--batch", type=whole_number(at_least=1), default=8)
    parser.add_argument("--length", type=whole_number(at_least=1), default=64)
    parser.add_argument(
        "--separate-qkv", dest="fused_qkv", action="store_false", help="q, k, v apart"
    )
    add_iters_and_json(parser, 30)
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    env = init_distributed()
    if env.device.type == "cpu":
        torch.set_num_threads(1)  # the ranks share the cores
    times, apart = time_both(args, env.device)
    if env.is_main:
        ratio = paired_ratio(times["ours"], times["torch"])
        low, high = paired_ratio_interval(times["ours"], times["torch"])
        median_ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(
            f"tensor-parallel training step, TransformerBlock(H={args.width}, "
            f"heads={args.heads}), batch {args.batch} x {args.length}, W = {env.world_size}, "
            f"{env.device.type}, {args.iters} interleaved steps"
        )
        for name, ms in median_ms.items():
            print(f"  {name:<6} median {ms:8.2f} ms")
        print(
            f"  outputs after {WARMUP} steps differ by {apart:.1e} "
            "(rounding: ours adds a rowwise bias once, torch's b/W on each rank)"
        )
        print(f"  ours / torch's: {ratio:.2f}x  [{low:.2f}, {high:.2f}] (median, 95% interval)")
        if args.json:
            summary = {
                "args": vars(args),
                "world_size": env.world_size,
                "times": times,
                "ratio": ratio,
                "interval": [low, high],
                "median_ms": median_ms,
                "largest_output_difference": apart,
            }
            with open(args.json, "w") as file:
                json.dump(summary, file, indent=2)
            print(f"wrote {args.json}")
    dist.barrier()
    cleanup()
