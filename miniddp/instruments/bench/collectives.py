"""`python -m miniddp.bench collectives`: our send/recv all-reduces against gloo's, with the
alpha-beta cost model's prediction beside each measured time (float32 SUM).

For each size, every implementation runs once per round, in a rotated order, with a barrier
before each call so every rank starts together; a call's time is the slowest rank's. Each round
gives one time per implementation, so "vs gloo" is the median over rounds of (ours / gloo's from
the same round): interleaved pairs, measured under the same background load.

algbw and busbw follow nccl-tests: algbw = bytes / time, busbw = algbw * 2(W-1)/W, the rate each
rank's link would need for the bandwidth-optimal algorithm to take that time.

The last lines say which of ours was fastest at each size, and what `auto` picked: the figures
to copy into `collectives.AUTO_CHOICES` for this machine and world size.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from miniddp import collectives
from miniddp.collectives import KiB, MiB
from miniddp.instruments.bench.options import add_iters_and_json
from miniddp.job.env import cleanup, init_distributed

DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
IMPLEMENTATIONS = ("gloo", "reduce_broadcast", "recursive_doubling", "ring", "auto")
OURS = IMPLEMENTATIONS[1:-1]
# Large sizes get fewer rounds (at least 8), so the default run stays well within two minutes.
ROUNDS_BUDGET_BYTES = 512 * MiB
MIN_ROUNDS = 8


def parse_size(text: str) -> int:
    """'4K' -> 4096, '64M' -> 67108864, '1000' -> 1000 (bytes)."""
    units = {"K": KiB, "M": MiB, "G": 1024 * MiB}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def fmt_size(nbytes: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def all_reduce_with(implementation: str) -> Callable[[torch.Tensor], None]:
    if implementation == "gloo":
        return lambda tensor: dist.all_reduce(tensor)
    return lambda tensor: collectives.all_reduce(tensor, algorithm=implementation)


def time_size(nbytes: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each implementation, one per round, the slowest rank's."""
    source = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    tensor = torch.empty_like(source)
    calls = {name: all_reduce_with(name) for name in IMPLEMENTATIONS}
    times = torch.zeros(len(IMPLEMENTATIONS), rounds, dtype=torch.float64)
    for name in IMPLEMENTATIONS:  # warm up: connections, scratch buffers, caches
        tensor.copy_(source)
        calls[name](tensor)
    for round_index in range(rounds):
        shift = round_index % len(IMPLEMENTATIONS)
        for index in [*range(shift, len(IMPLEMENTATIONS)), *range(shift)]:
            tensor.copy_(source)  # SUM would otherwise grow the values without bound
            dist.barrier()
            start = time.perf_counter()
            calls[IMPLEMENTATIONS[index]](tensor)
            times[index, round_index] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {name: times[i].tolist() for i, name in enumerate(IMPLEMENTATIONS)}


def summarize(
    nbytes: int, times: dict[str, list[float]], model: collectives.CostModel, world_size: int
) -> list[dict]:
    rows = []
    for name, seconds in times.items():
        median = statistics.median(seconds)
        algbw = nbytes / median / 1e9
        if name == "gloo":
            algorithm = "ring"  # gloo's CPU all_reduce runs a ring (gloo::allreduce's default)
        elif name == "auto":
            algorithm = collectives.choose_all_reduce_algorithm(nbytes, world_size)
        else:
            algorithm = name
        ratios = [ours / theirs for ours, theirs in zip(seconds, times["gloo"])]
        rows.append(
            {
                "bytes": nbytes,
                "implementation": name,
                "algorithm": algorithm,
                "median_s": median,
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * 2 * (world_size - 1) / world_size,
                "vs_gloo": statistics.median(ratios),
                "predicted_s": model.predict("all_reduce", algorithm, nbytes, world_size),
                "rounds": len(seconds),
            }
        )
    return rows


def print_header() -> None:
    print(
        f"\n{'size':>8}  {'implementation':<26} {'time':>10} {'algbw':>7} {'busbw':>7} "
        f"{'vs gloo':>8} {'model':>10}\n{' ' * 48}{'GB/s':>7} {'GB/s':>7} {'median':>8}",
        flush=True,
    )


def print_rows(rows: list[dict]) -> None:
    for row in rows:
        name = row["implementation"]
        if name == "auto":
            name = f"auto ({row['algorithm']})"
        print(
            f"{fmt_size(row['bytes']):>8}  {name:<26} {row['median_s'] * 1e6:8.0f}us "
            f"{row['algbw_GBps']:7.2f} {row['busbw_GBps']:7.2f} {row['vs_gloo']:7.2f}x "
            f"{row['predicted_s'] * 1e6:8.0f}us"
        )
    print(flush=True)


def fastest_of_ours(rows: list[dict]) -> list[tuple[int, str]]:
    """(size, our fastest algorithm there): what AUTO_CHOICES should say for this world size."""
    fastest: dict[int, tuple[float, str]] = {}
    for row in rows:
        if row["implementation"] in OURS:
            candidate = (row["median_s"], row["implementation"])
            fastest[row["bytes"]] = min(fastest.get(row["bytes"], candidate), candidate)
    return [(size, name) for size, (_, name) in sorted(fastest.items())]


def parse_sizes(text: str) -> list[int]:
    """--sizes: bytes of float32 tensors, so each a positive multiple of 4."""
    sizes = []
    for part in text.split(","):
        try:
            size = parse_size(part)
        except (ValueError, OverflowError):  # not a number; "infK"
            size = None
        if size is None or size <= 0 or size % 4:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r} is not a size in bytes > 0 and a multiple of 4 (float32); "
                f"give sizes like {DEFAULT_SIZES}"
            )
        sizes.append(size)
    return sizes


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m miniddp.bench collectives",
        description="All-reduce: gloo against MiniDDP's send/recv algorithms, interleaved.",
    )
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=DEFAULT_SIZES,
        help=f"comma-separated sizes (default {DEFAULT_SIZES})",
    )
    add_iters_and_json(parser, 100, "rounds per size (sizes above 4 MiB get fewer, at least 8)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    env = init_distributed()
    world_size = env.world_size
    sizes = args.sizes
    if world_size < 2:
        raise SystemExit("run with at least 2 ranks: there is nothing to communicate with one")

    model = collectives.fit_cost_model()
    say = print if env.is_main else (lambda *_, **__: None)
    say(
        f"all_reduce, float32 SUM, {world_size} ranks, backend {env.backend}, "
        f"{torch.get_num_threads()} compute thread(s) per rank\n"
        f"cost model fitted on this machine: alpha = {model.alpha * 1e6:.1f} us per message, "
        f"1/beta = {1 / model.beta / 1e9 if model.beta else float('inf'):.2f} GB/s",
        flush=True,
    )
    if env.is_main:
        print_header()
    rows: list[dict] = []
    for nbytes in sizes:
        rounds = min(args.iters, max(MIN_ROUNDS, ROUNDS_BUDGET_BYTES // max(nbytes, 1)))
        size_rows = summarize(nbytes, time_size(nbytes, rounds), model, world_size)
        rows += size_rows
        if env.is_main:
            print_rows(size_rows)
    if env.is_main:
        fastest = ", ".join(f"{fmt_size(size)}: {name}" for size, name in fastest_of_ours(rows))
        say(f"fastest of ours, by size: {fastest}")
        picks = [
            f"{fmt_size(r['bytes'])}: {r['algorithm']}"
            for r in rows
            if r["implementation"] == "auto"
        ]
        say(f"auto picks, by size: {', '.join(picks)}")
        if args.json:
            report = {
                "world_size": world_size,
                "backend": env.backend,
                "machine": platform.platform(),
                "alpha_s": model.alpha,
                "beta_s_per_byte": model.beta,
                "rows": rows,
            }
            with open(args.json, "w") as file:
                json.dump(report, file, indent=2)
            say(f"wrote {args.json}")
    cleanup()
