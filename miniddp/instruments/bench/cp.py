"""`python -m miniddp.bench cp`: ring attention's step (forward + backward) against one process
doing the whole sequence, and against torch's private ring, on the same shapes.

    python -m miniddp.bench cp [--lengths 2048,4096,8192] [--heads 4] [--head-dim 32]
                               [--no-causal] [--iters 5]

Three variants per sequence length S, each a forward and a backward of attention over all S
positions, float32, on the CPU's flash kernel (the one both rings call):

    one     F.scaled_dot_product_attention on the whole [B, H, S, D], on every rank at once (so
            the cores are loaded as in the others: each rank is its own "one process")
    ours    miniddp.context_parallel.ring_attention on this rank's S/W positions
    torch   torch's _templated_ring_attention and its backward template on the same parts, as
            its context_parallel dispatches them (private API: torch 2.13's names)

Causal by default, load-balanced (head-tail chunks) in both rings. Timed interleaved (the order
rotated each iteration, a barrier before each step), the slowest rank's seconds per step; ratios
are medians of per-iteration ratios with 95% intervals (miniddp/instruments/bench/paired.py).

Memory is what a step holds from forward to backward (autograd's saved tensors, each storage
once, for `one` and `ours`; the tensors torch's backward template is handed, for `torch`):
flash keeps q, k, v, out and lse, 4·B·H·S·D·4 + B·H·S·4 bytes on one process, and 1/W of that
on each of W ranks. A step's transient peak (the K/V blocks in flight, the kernels' scratch) is
not in it: CPU tensors have no allocator statistics to read it from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from miniddp.context_parallel import count_blocks, ring_attention, shard_sequence
from miniddp.instruments.bench.options import add_iters_and_json, whole_number
from miniddp.instruments.bench.paired import paired_ratio, paired_ratio_interval, rotated
from miniddp.job.env import cleanup, init_distributed

aten = torch.ops.aten
WARMUP = 1
VARIANTS = ("one", "ours", "torch")


def lengths(text: str) -> list[int]:
    """--lengths: comma-separated whole numbers, each at least 2 (split into 2W chunks later)."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of lengths: {text!r}"
        ) from None
    if any(value < 2 for value in values):
        raise argparse.ArgumentTypeError(f"every length must be at least 2, got {text!r}")
    return values


def held_bytes(step: Callable[[], None]) -> int:
    """The bytes autograd keeps from forward to backward in `step` (each storage once)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values())


class Case:
    """One sequence length: the whole q, k, v and output gradient, and this rank's parts."""

    def __init__(self, args: argparse.Namespace, length: int) -> None:
        g = torch.Generator().manual_seed(length)
        shape = (args.batch, args.heads, length, args.head_dim)
        self.causal, self.balanced = args.causal, args.causal  # balance only what a mask skews
        self.whole = [torch.randn(shape, generator=g) for _ in range(4)]
        self.parts = [shard_sequence(t, 2, load_balance=self.balanced) for t in self.whole]

    def one(self) -> torch.Tensor:
        q, k, v = (t.detach().requires_grad_() for t in self.whole[:3])
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        out.backward(self.whole[3])
        return shard_sequence(out.detach(), 2, load_balance=self.balanced)

    def ours(self) -> torch.Tensor:
        q, k, v = (t.detach().requires_grad_() for t in self.parts[:3])
        out = ring_attention(q, k, v, is_causal=self.causal, load_balance=self.balanced)
        out.backward(self.parts[3])
        return out.detach()

    def torch(self, held: list[int] | None = None) -> torch.Tensor:
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp

        q, k, v, grad = self.parts
        group = dist.group.WORLD
        with mock.patch.object(cp._cp_options, "enable_load_balance", self.balanced):
            out, lse = cp._templated_ring_attention(  # 2: the sequence dim of [B, H, S, D]
                group,
                2,
                aten._scaled_dot_product_flash_attention_for_cpu,
                q,
                k,
                v,
                is_causal=self.causal,
                dropout_p=0.0,
            )[:2]
            if held is not None:  # what its backward is given: the forward's whole legacy
                held.append(sum(t.untyped_storage().nbytes() for t in (q, k, v, out, lse)))
            cp._templated_ring_attention_backward(
                group,
                2,
                aten._scaled_dot_product_flash_attention_for_cpu_backward,
                grad,
                "grad_out",
                q,
                k,
                v,
                out,
                lse,
                self.causal,
                dropout_p=0.0,
            )
        return out


def measure(args: argparse.Namespace, length: int) -> dict:
    """Seconds per step of each variant (the slowest rank's), bytes held, blocks computed, and
    how far each ring's output is from one process's."""
    case = Case(args, length)
    steps = {name: getattr(case, name) for name in VARIANTS}
    reference = case.one()
    apart = {name: float((steps[name]() - reference).abs().max()) for name in ("ours", "torch")}
    torch_held: list[int] = []
    case.torch(torch_held)
    held = {"one": held_bytes(case.one), "ours": held_bytes(case.ours), "torch": torch_held[0]}
    with count_blocks() as recorded:
        case.ours()
    for _ in range(WARMUP):
        for step in steps.values():
            step()
    seconds = torch.zeros(len(VARIANTS), args.iters, dtype=torch.float64)
    for iteration in range(args.iters):
        for name in rotated(list(VARIANTS), iteration):
            dist.barrier()
            start = time.perf_counter()
            steps[name]()
            seconds[VARIANTS.index(name), iteration] = time.perf_counter() - start
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    blocks = [None] * dist.get_world_size()
    dist.all_gather_object(blocks, recorded[0].blocks)
    return {
        "length": length,
        "times": {name: seconds[i].tolist() for i, name in enumerate(VARIANTS)},
        "held_bytes": held,
        "blocks_per_rank": blocks,
        "largest_difference_to_one": apart,
    }


def summarise(result: dict) -> dict:
    times = result["times"]
    pairs = {"ours / one": ("ours", "one"), "ours / torch": ("ours", "torch")}
    ratios = {}
    for label, (a, b) in pairs.items():
        low, high = paired_ratio_interval(times[a], times[b])
        ratios[label] = {"ratio": paired_ratio(times[a], times[b]), "interval": [low, high]}
    result["ratios"] = ratios
    result["median_ms"] = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return result


def report(result: dict) -> None:
    ms, held = result["median_ms"], result["held_bytes"]
    print(f"  S = {result['length']}: blocks computed per rank {result['blocks_per_rank']}")
    for name in VARIANTS:
        gap = result["largest_difference_to_one"].get(name)
        apart = "" if gap is None else f", output within {gap:.1e} of one's"
        print(f"    {name:<6} {ms[name]:9.1f} ms  held {held[name] / 2**20:7.2f} MiB{apart}")
    for label, ratio in result["ratios"].items():
        low, high = ratio["interval"]
        print(f"    {label:<13} time {ratio['ratio']:.2f}x  [{low:.2f}, {high:.2f}]")
    memory = held["ours"] / held["one"], held["ours"] / held["torch"]
    print(f"    held: ours / one {memory[0]:.2f}x, ours / torch {memory[1]:.2f}x")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m miniddp.bench cp", description=__doc__)
    parser.add_argument("--lengths", type=lengths, default=[2048, 4096, 8192])
    parser.add_argument("--heads", type=whole_number(at_least=1), default=4)
    parser.add_argument("--head-dim", type=whole_number(at_least=1), default=32)
    parser.add_argument("--batch", type=whole_number(at_least=1), default=1)
    parser.add_argument("--no-causal", dest="causal", action="store_false", help="no mask")
    add_iters_and_json(parser, 5)
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    env = init_distributed()
    torch.set_num_threads(1)  # the ranks share the cores
    results = [summarise(measure(args, length)) for length in args.lengths]
    if env.is_main:
        mask = "causal, load-balanced" if args.causal else "no mask"
        print(
            f"attention forward + backward, B = {args.batch}, H = {args.heads}, "
            f"D = {args.head_dim}, float32, {mask}, W = {env.world_size}\n"
            f"{args.iters} interleaved steps; medians, ratios with their 95% intervals"
        )
        for result in results:
            report(result)
        if args.json:
            with open(args.json, "w") as file:
                json.dump({"args": vars(args), "results": results}, file, indent=2)
            print(f"wrote {args.json}")
    dist.barrier()
    cleanup()
