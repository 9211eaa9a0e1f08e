"""`python -m miniddp.bench diloco`: bytes and simulated time to reach a fixed validation loss,
DDP against DiLoCo at each H, over a simulated slow link.

    python -m miniddp.bench diloco [--link alpha=50ms,bandwidth=100mbit] [--h 10,30,100]
                                   [--steps 300] [--target LOSS] [--iters 3] [--json PATH]

Four ranks, each a replica of a small GPT (miniddp/models/gpt.py), learn a text drawn from a
fixed random Markov chain over 32 symbols: its entropy per symbol is known exactly, so the best
possible validation loss is known, and the default target sits a quarter of the way from it up
to log 32 (a uniform guess). Each replica draws its own windows.

    ddp        MiniDDP, AdamW: an all-reduce of every gradient every step
    H=...      miniddp.local_sgd.DiLoCo: AdamW inside, Nesterov SGD (lr 0.7, momentum 0.9) over
               the average pseudo-gradient every H steps

Rank 0 evaluates every 5 steps. The time is simulated, not slept: steps x the compute a step
took here (the median over every run: only the link differs), plus for each sync the link's
alpha + 2(W-1)/W n / bandwidth (miniddp/observe/link.py; one alpha a sync, the tensors' all-
reduces leave together). Bytes are what each replica sends, by the same formula. Each iteration
runs every way once, in an order rotated each iteration, on its own data; the ratios against
DDP are medians of per-iteration ratios with 95% intervals (miniddp/instruments/bench/paired.py).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.distributed as dist

from miniddp import MiniDDP
from miniddp.instruments.bench.options import (
    add_iters_and_json,
    add_link_option,
    link_or_environment,
    whole_number,
)
from miniddp.instruments.bench.paired import paired_ratio, paired_ratio_interval, rotated
from miniddp.job.env import cleanup, init_distributed
from miniddp.local_sgd import DiLoCo
from miniddp.models.gpt import GPT, GPTConfig, next_character_loss
from miniddp.observe.link import Link, wire_bytes

SYMBOLS, CONTEXT, BATCH, EVAL_EVERY = 32, 32, 16, 5
DEFAULT_LINK = "alpha=50ms,bandwidth=100mbit"


def markov_chain(seed: int) -> tuple[torch.Tensor, float]:
    """Transition probabilities (each row a few likely successors) and the chain's entropy per
    symbol in nats, under its stationary distribution: the lowest loss any model can reach."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.rand(SYMBOLS, SYMBOLS, generator=g, dtype=torch.double).pow(8)  # peaked
    rows = rows / rows.sum(1, keepdim=True)
    stationary = torch.linalg.matrix_power(rows, 256)[0]
    entropy = -(stationary[:, None] * rows * rows.log()).sum().item()
    return rows, entropy


def text(rows: torch.Tensor, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(length, dtype=torch.long)
    out[0] = 0
    for i in range(1, length):
        out[i] = torch.multinomial(rows[out[i - 1]], 1, generator=g)
    return out


def windows(tokens: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(tokens) - CONTEXT - 1, (count,), generator=g)
    return torch.stack([tokens[s : s + CONTEXT + 1] for s in starts.tolist()])


def train(way: str, train_text: torch.Tensor, validation: torch.Tensor, steps: int, seed: int):
    """One run; rank 0's (step, compute seconds so far, validation loss) every EVAL_EVERY."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(SYMBOLS, CONTEXT, 48, 2, 4, 0.0))
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    forward, run = model, None
    if way == "ddp":
        forward = MiniDDP(model)
    else:
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        run = DiLoCo(model, inner, outer, int(way.removeprefix("H=")))
        run.__enter__()
    points, computing, rank = [], 0.0, dist.get_rank()
    for step in range(1, steps + 1):
        started = time.perf_counter()
        batch = windows(train_text, BATCH, seed * 1_000_003 + rank * 10_007 + step)
        inner.zero_grad()
        next_character_loss(forward, batch).backward()
        inner.step()
        computing += time.perf_counter() - started
        if step % EVAL_EVERY == 0 and rank == 0:
            with torch.no_grad():
                points.append((step, computing, next_character_loss(model, validation).item()))
    if run is not None:
        run.__exit__(None, None, None)
    return points


def to_target(way: str, points: list, target: float, compute: float, link: Link, payload: int):
    """(steps, bytes sent per replica, simulated seconds) when rank 0's loss first reached the
    target; None if it never did."""
    world = dist.get_world_size()
    every = 1 if way == "ddp" else int(way.removeprefix("H="))
    for step, _, loss in points:
        if loss <= target:
            syncs = step // every
            sent = syncs * wire_bytes("all_reduce", payload, world)
            return (
                step,
                sent,
                step * compute + syncs * link.seconds(wire_bytes("all_reduce", payload, world)),
            )
    return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m miniddp.bench diloco", description=__doc__)
    parser.add_argument("--h", type=_hs, default=[10, 30, 100], help="DiLoCo's H values")
    parser.add_argument("--steps", type=whole_number(at_least=EVAL_EVERY), default=300)
    parser.add_argument("--target", type=float, help="validation loss to reach (nats)")
    add_link_option(parser, "the syncs", f"{DEFAULT_LINK}")
    add_iters_and_json(parser, 3, "paired iterations, each every way once")
    args = parser.parse_args(argv)
    link_or_environment(parser, args)
    args.link = args.link or Link.parse(DEFAULT_LINK)
    return args


def _hs(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of H: {text!r}") from None
    if any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"every H must be at least 1, got {text!r}")
    return values


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    env = init_distributed()
    torch.set_num_threads(1)
    rows, entropy = markov_chain(0)
    target = args.target or entropy + 0.25 * (math.log(SYMBOLS) - entropy)
    train_text, validation_text = text(rows, 50_000, 1), text(rows, 10_000, 2)
    validation = windows(validation_text, 256, 3)
    ways = ["ddp"] + [f"H={h}" for h in args.h]
    curves: dict[str, list] = {way: [] for way in ways}
    for iteration in range(args.iters):
        for way in rotated(ways, iteration):
            curves[way].append(train(way, train_text, validation, args.steps, iteration))
            dist.barrier()
    if env.is_main:
        report(args, ways, curves, target, entropy)
    dist.barrier()
    cleanup()


def report(args, ways: list[str], curves: dict, target: float, entropy: float) -> None:
    compute = statistics.median(run[-1][1] / run[-1][0] for way in ways for run in curves[way])
    payload = sum(p.numel() * 4 for p in GPT(GPTConfig(SYMBOLS, CONTEXT, 48, 2, 4)).parameters())
    print(
        f"{dist.get_world_size()} replicas, {payload // 4:,} parameters, link {args.link}; "
        f"compute {compute * 1e3:.0f} ms a step\ntarget loss {target:.3f} (the chain's entropy "
        f"{entropy:.3f}, log {SYMBOLS} = {math.log(SYMBOLS):.3f}); {args.iters} paired "
        "iterations, medians"
    )
    print(f"{'':<8} {'steps':>6} {'MiB/replica':>12} {'sim. s':>8} {'time / DDP':>22}")
    reached = {
        w: [to_target(w, c, target, compute, args.link, payload) for c in curves[w]] for w in ways
    }
    results = {}
    for way in ways:
        hits = [r for r in reached[way] if r is not None]
        if len(hits) < len(reached[way]):
            print(f"{way:<8} did not reach the target in {args.steps} steps in some iteration")
            continue
        steps, sent, seconds = (statistics.median(x) for x in zip(*hits))
        ours = [r[2] for r in hits]
        theirs = [r[2] for r in reached["ddp"] if r is not None]
        ratio, (low, high) = paired_ratio(ours, theirs), paired_ratio_interval(ours, theirs)
        results[way] = {
            "steps": steps,
            "bytes": sent,
            "seconds": seconds,
            "ratio": ratio,
            "interval": [low, high],
        }
        interval = f"{ratio:.2f} [{low:.2f}, {high:.2f}]"
        print(f"{way:<8} {steps:>6.0f} {sent / 2**20:>12.2f} {seconds:>8.1f} {interval:>22}")
    if args.json:
        with open(args.json, "w") as file:
            given = {**vars(args), "link": str(args.link)}
            json.dump({"args": given, "target": target, "results": results}, file)
        print(f"wrote {args.json}")
