"""What every chapter shares: a toy dataset, a toy model, and printing that stays readable.

Chapters import it with `from common import ...`; that works because torchrun runs a script with
the script's own folder first on sys.path.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import textwrap
from itertools import groupby, pairwise
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from miniddp.instruments.timeline_views import LINE, ascii_timeline
from miniddp.job.env import cleanup
from miniddp.observe.events import Event
from miniddp.observe.link import ENVIRONMENT_VARIABLE, Link
from miniddp.observe.timeline import StepTimeline, gather, split_steps
from miniddp.steps.__main__ import diff, idea, label

REPO = Path(__file__).resolve().parents[1]


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
    """print() on rank 0 only, so a message appears once rather than once per rank; a line
    longer than LINE characters is wrapped there, under its own indent, so that no chapter's
    output needs a wide terminal."""
    if _rank() == 0:
        lines = " ".join(map(str, args)).split("\n")
        print("\n".join(map(_fit, lines)), flush=True)


def _fit(line: str) -> str:
    if len(line) <= LINE:
        return line
    indent = " " * (len(line) - len(line.lstrip()))
    return textwrap.fill(line, LINE, subsequent_indent=indent + "  ", break_on_hyphens=False)


def say_prose(text: str, width: int = 96) -> None:
    """Say a dedented block with its prose refilled to `width`, after interpolation: an
    f-string's numbers have any width, so lines filled by hand around them come out ragged.
    Paragraphs are separated by blank lines; lines indented past the block's margin (a table,
    a quoted error, a command) are kept as they are, between the refilled runs of prose."""
    paragraphs = []
    for paragraph in textwrap.dedent(text).strip("\n").split("\n\n"):
        runs = groupby(paragraph.splitlines(), key=lambda line: line.startswith(" "))
        kept = [
            "\n".join(lines) if indented else textwrap.fill(" ".join(lines), width)
            for indented, lines in runs
        ]
        paragraphs.append("\n".join(kept))
    say("\n\n".join(paragraphs))


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
    """--link: a simulated network (miniddp/observe/link.py) for every collective, or 'none'."""
    parser.add_argument(
        "--link",
        type=Link.parse,
        default=os.environ.get(ENVIRONMENT_VARIABLE, default_link),  # parsed like the flag
        help=f"simulated link, e.g. alpha=200us,bandwidth=1gbit; 'none' for the bare machine "
        f"(default: ${ENVIRONMENT_VARIABLE}, else {default_link})",
    )


def add_plot_option(parser: argparse.ArgumentParser) -> None:
    """--plot DIR: save this run's figures there as PNGs (miniddp/instruments/figures/draw.py)."""
    parser.add_argument("--plot", type=Path, metavar="DIR", help="save this run's figures here")


def add_diff_option(parser: argparse.ArgumentParser) -> None:
    """--diff: print the code the rung changes; by default the chapter only points at it, so
    that its results come first."""
    parser.add_argument(
        "--diff", action="store_true", help="print the code this rung changes in the one below"
    )


def say_rung_diff(before: int, after: int, show: bool = False) -> None:
    """What rung `after` adds to rung `before`: its idea in one line and the commands that show
    its diff; with `show` (the chapter's --diff), the code hunks themselves
    (`python -m miniddp.steps diff --code before after`)."""
    say(textwrap.fill(f"Rung {after}, {label(after)}: {idea(after).split(': ', 1)[-1]}", 100))
    code, whole = (f"python -m miniddp.steps diff {o}{before} {after}" for o in ("--code ", ""))
    if not show:
        say(f"The code it adds to rung {before}: `{code}` (or this chapter's --diff).")
        say(f"The whole diff, its docstring's story included: `{whole}`.")
        return
    say(f"\n$ {code}\n{diff(before, after, code_only=True)}")
    say(f"(only the hunks that change code: `{whole}` prints the whole diff)")


def where(*definitions: Any) -> str:
    """Where each class or function is defined, as a reader would open it: "path:line name"."""
    found = []
    for definition in definitions:
        path = Path(inspect.getsourcefile(definition)).resolve().relative_to(REPO)
        line = inspect.getsourcelines(definition)[1]
        found.append(f"{path}:{line} {definition.__qualname__}")
    return ", ".join(found)


def ladder_model() -> nn.Sequential:
    """The model chapters 02b-05b climb the ladder with: five Linear layers, 8 -> 32 -> 32 -> 32
    -> 32 -> 1, in float32 like most training: 10 gradient tensors, 3,489 numbers, 13.6 KiB."""
    return make_model(seed=0, in_features=8, hidden=32, depth=5, dtype=torch.float32)


def step_batches(
    steps: int, batch: int, world_size: int, rank: int | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches of `batch` samples per rank, float32: rank `rank`'s slice of each,
    or with `rank=None` the whole global batch, for one process to train on alone."""
    dataset = make_dataset(n=steps * world_size * batch, dtype=torch.float32)
    inputs, targets = (t.view(steps, world_size, batch, -1) for t in dataset.tensors)
    if rank is None:
        return list(zip(inputs.flatten(1, 2), targets.flatten(1, 2)))
    return list(zip(inputs[:, rank], targets[:, rank]))


def train_steps(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], learning_rate: float = 0.1
) -> list[list[torch.Tensor]]:
    """One SGD step on the mean squared error per batch; returns each step's gradients.

    `model` is a plain module, torch's DDP, MiniDDP or a rung of the ladder; the rungs want
    `finish_gradient_synchronization()` after each backward (rung 1 averages there; the others
    have already finished and return at once). The mean over a rank's batch, averaged over equal
    batches on W ranks, is the mean over the global batch: what one process computes.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    gradients = []
    for inputs, targets in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        if hasattr(model, "finish_gradient_synchronization"):
            model.finish_gradient_synchronization()
        gradients.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return gradients


def compare_gradients(
    ours: list[list[torch.Tensor]], theirs: list[list[torch.Tensor]]
) -> tuple[bool, float]:
    """Whether two runs' gradients are bit for bit equal on every rank, and their largest
    difference on any rank (a collective: every rank must call it)."""
    pairs = [(a, b) for mine, other in zip(ours, theirs, strict=True) for a, b in zip(mine, other)]
    equal = torch.tensor(float(all(torch.equal(a, b) for a, b in pairs)))
    gap = torch.tensor(max((a.double() - b.double()).abs().max().item() for a, b in pairs))
    if dist.is_initialized():
        dist.all_reduce(equal, op=dist.ReduceOp.MIN)
        dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return bool(equal.item()), gap.item()


def say_claims(
    name: str,
    gradients: list[list[torch.Tensor]],
    one_process: list[list[torch.Tensor]],
    torch_ddp: list[list[torch.Tensor]],
) -> tuple[float, bool, float]:
    """Compare a run's gradients, step by step, with one process on the global batch and with
    torch's DDP; say and return (gap to one process, bitwise torch's, gap to torch's)."""
    _, one_process_gap = compare_gradients(gradients, one_process)
    torch_equal, torch_gap = compare_gradients(gradients, torch_ddp)
    steps = len(gradients)
    say(f"{name}, {steps} steps: largest gradient difference to one process: {one_process_gap:.1e}")
    say(
        f"{name}, {steps} steps: bit for bit torch's DDP: {torch_equal} "
        f"(largest difference {torch_gap:.1e})"
    )
    return one_process_gap, torch_equal, torch_gap


# How close a rung's gradients must come to one process's, and to torch's DDP beyond W = 2:
# float32 rounding is ~1e-7 relative, and three steps of the ladder's tiny MLP stay far below.
LADDER_TOLERANCE = 1e-5


def check_claims(
    one_process_gap: float, torch_equal: bool, torch_gap: float, world_size: int, tolerance: float
) -> str:
    """The claim every rung makes: one process's gradients up to rounding, and torch's DDP's
    bit for bit at W = 2 (a + b = b + a), within rounding beyond. Returns how exact it was."""
    assert one_process_gap <= tolerance, one_process_gap
    assert torch_gap <= tolerance, torch_gap
    if world_size == 2:
        assert torch_equal, "not bitwise torch's DDP at W = 2"
    return "bit for bit" if world_size == 2 else f"within {tolerance:.0e} of"


def launch_counts(step: StepTimeline) -> tuple[int, int]:
    """(all-reduces launched in this step, how many of them while backward still had gradients
    to compute). "Still" means before the last gradient's hook; rung 1 has no hooks, and every
    launch of it comes after backward has ended."""
    hooks = [mark.time for mark in step.marks if mark.kind == "hook"]
    backward = step.span("backward")
    last_gradient = max(hooks) if hooks else backward.end if backward else step.end
    launches = [span.start for span in step.buckets]
    return len(launches), sum(launched < last_gradient for launched in launches)


def say_timeline(
    name: str, events: list[Event], drawn: tuple[int, ...] = (-1,), travels: str = "bucket"
) -> list[tuple[int, int]]:
    """Draw the steps numbered `drawn` (default: the last) of what a model's `Recorder` noted
    (its `events`) on every rank, and say every step's `launch_counts`; returns them, for this
    rank. Every rank must call it. `travels`: what one all-reduce carries, for the legend (a
    "gradient" for rungs 1 and 2)."""
    steps = split_steps(events, _rank())
    for number in drawn:
        step = steps[number]
        say(f"{name}, step {step.step} on every rank, ms since the first rank's forward began:")
        say(ascii_timeline(gather([step]), travels=travels))
    counts = [launch_counts(step) for step in steps]
    for step, (launched, early) in zip(steps, counts):
        say(
            f"{name} step {step.step}: {launched} all-reduce{'s' * (launched != 1)}, {early} "
            "launched before backward's last gradient was ready"
        )
    return counts


def rung_layout(model: nn.Module) -> list[list[str]]:
    """A bucketed rung's layout: each bucket's parameter names, in launch order."""
    indices = [bucket.param_indices for bucket in model.buckets]
    return [[model.param_names[i] for i in bucket] for bucket in indices]


def say_rung_layout(model: nn.Module) -> None:
    say(f"{'bucket':>6}  {'bytes':>10}  parameters")
    for bucket, names in zip(model.buckets, rung_layout(model)):
        say(f"{bucket.index:>6}  {bucket.flat.nbytes:>10,}  {', '.join(names)}")


def end_chapter() -> None:
    """Leave the process group, then end this process at once.

    Most chapters compare with torch's own DDP, and its reducer keeps gloo's process group alive
    past `destroy_process_group()`: tearing that down with the interpreter aborted about one
    run in 30 here ("terminate called without an active exception", SIGABRT, after the chapter
    had verified everything). `os._exit` skips that teardown; output is flushed first. Not for
    chapter 07: there rank 0's process hosts the store the other node's torchrun still needs
    once its workers have ended.
    """
    cleanup()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
