"""What every chapter shares: a toy dataset, a toy model, and printing that stays readable.

Chapters import it with `from common import ...`; that works because torchrun runs a script with
the script's own folder first on sys.path.
"""

from __future__ import annotations

import argparse
import os
from itertools import pairwise
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from miniddp.link import ENVIRONMENT_VARIABLE, Link


def make_dataset(
    n: int = 64, in_features: int = 8, seed: int = 0, dtype: torch.dtype = torch.float64
) -> TensorDataset:
    """A noisy linear regression problem, `n` (input, target) pairs.

    Its own seeded generator makes it identical on every rank without any communication.
    """
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(n, in_features, generator=generator, dtype=dtype)
    true_weights = torch.randn(in_features, 1, generator=generator, dtype=dtype)
    noise = 0.1 * torch.randn(n, 1, generator=generator, dtype=dtype)
    return TensorDataset(inputs, inputs @ true_weights + noise)


def make_model(
    seed: int = 0,
    in_features: int = 8,
    hidden: int = 32,
    depth: int = 3,
    dtype: torch.dtype = torch.float64,
) -> nn.Sequential:
    """A small MLP of `depth` Linear layers whose initial weights depend only on `seed`.

    The global RNG is forked, so building a model does not change what later random calls return.
    """
    widths = [in_features] + [hidden] * (depth - 1) + [1]
    layers: list[nn.Module] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for fan_in, fan_out in pairwise(widths):
            layers += [nn.Linear(fan_in, fan_out, dtype=dtype), nn.Tanh()]
    return nn.Sequential(*layers[:-1])  # no activation after the output layer


def parameter_checksum(model: nn.Module) -> float:
    """One number per replica: equal replicas give equal checksums."""
    with torch.no_grad():
        return sum(p.double().sum().item() for p in model.parameters())


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def say(*args) -> None:
    """print() on rank 0 only, so a message appears once rather than once per rank."""
    if _rank() == 0:
        print(*args, flush=True)


def say_all_ranks(*args) -> None:
    """Print one line per rank, prefixed and in rank order. Every rank must call it.

    Ranks printing on their own interleave at random, so rank 0 gathers the lines and prints.
    """
    line = " ".join(str(arg) for arg in args)
    if not dist.is_initialized():
        print(f"[rank 0] {line}", flush=True)
        return
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    for each_rank, each_line in enumerate(lines):
        say(f"[rank {each_rank}] {each_line}")


def section(title: str) -> None:
    say(f"\n{title}\n{'-' * len(title)}")


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    units = ["B", "KiB", "MiB", "GiB"]
    power = 0
    while n >= 1024 and power < len(units) - 1:
        n /= 1024
        power += 1
    return f"{n:.0f} B" if power == 0 else f"{n:.1f} {units[power]}"


def add_link_option(parser: argparse.ArgumentParser, default_link: str = "none") -> None:
    """--link: a simulated network (miniddp/link.py) for every collective, or 'none'."""
    parser.add_argument(
        "--link",
        type=Link.parse,
        default=Link.parse(os.environ.get(ENVIRONMENT_VARIABLE, default_link)),
        help=f"simulated link, e.g. alpha=200us,bandwidth=1gbit; 'none' for the bare machine "
        f"(default: ${ENVIRONMENT_VARIABLE}, else {default_link})",
    )


def add_plot_option(parser: argparse.ArgumentParser) -> None:
    """--plot DIR: save this run's figures there as PNGs (miniddp/figures/draw.py)."""
    parser.add_argument("--plot", type=Path, metavar="DIR", help="save this run's figures here")
