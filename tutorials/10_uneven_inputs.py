"""Chapter 10: uneven inputs and a block run twice, working instead of refused.

    torchrun --nproc_per_node=2 tutorials/10_uneven_inputs.py

Two of the most common ways real DDP training breaks, and torch's one-line answer to each:

- Uneven inputs. Ranks get different numbers of batches (a filtered dataset, a last partial
  shard). The rank that runs out stops issuing all-reduces and the others wait for it forever.
  `with model.join():` (torch's Join) keeps the finished rank answering with zeros.
- Reentrant activation checkpointing of a block run twice. Each parameter of the block gets its
  gradient in two inner backward passes, so "ready" fires twice. `static_graph=True` counts the
  hooks in the first iteration and waits for that many ever after.

Each fix is checked bit for bit against torch's DistributedDataParallel doing the same.
"""

from __future__ import annotations

import textwrap
from datetime import timedelta

import torch
import torch.distributed as dist
from common import (
    end_chapter,
    make_dataset,
    make_model,
    parameter_checksum,
    say,
    say_all_ranks,
    section,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from miniddp import MiniDDP
from miniddp.job.env import init_distributed
from miniddp.job.faults import CollectiveFailed

SHORT_TIMEOUT = timedelta(seconds=3)  # how long the demonstration waits for a silent rank
BATCH = 4
LEARNING_RATE = 0.05


class BlockRunTwice(nn.Module):
    """The same block applied twice, each time under reentrant checkpointing (a weight-shared
    recurrent step, or a layer reused to save parameters)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(8, 16, dtype=torch.float64)
        self.block = nn.Sequential(nn.Linear(16, 16, dtype=torch.float64), nn.Tanh())
        self.head = nn.Linear(16, 1, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.stem(x)
        for _ in range(2):
            hidden = checkpoint(self.block, hidden, use_reentrant=True)
        return self.head(hidden)


def my_batches(rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` batches of this rank's own data (a shard of one dataset)."""
    inputs, targets = make_dataset(n=64).tensors
    mine = range(rank * 16, rank * 16 + BATCH * count, BATCH)
    return [(inputs[i : i + BATCH], targets[i : i + BATCH]) for i in mine]


def train(model: nn.Module, batches: list) -> list[float]:
    """The plain loop: forward, backward, step, for as many batches as this rank has."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for inputs, targets in batches:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def same_bits(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def main() -> None:
    env = init_distributed()
    rank, world = env.rank, env.world_size
    steps = [2 + r for r in range(world)]  # rank r has 2 + r batches: the last rank has most
    batches = my_batches(rank, steps[rank])

    section("1. Uneven inputs, a plain loop")
    say(
        textwrap.dedent(f"""\
        Rank r has 2 + r batches: {steps}. In step 3 every rank but rank 0 all-reduces its
        gradients, and rank 0, done with its loop, never joins in. Nothing fails at once:
        a silent peer only shows when the process group's timeout runs out (torch's default for
        gloo is 30 minutes; init_distributed, which made this chapter's group, sets 5, and a
        script sets its own with init_distributed(timeout=...)). To keep this chapter short,
        that first run goes through a separate group whose timeout is {SHORT_TIMEOUT.seconds} s,
        so the default group stays usable afterwards. MiniDDP's wait then says who is missing.""")
    )
    short_fuse = dist.new_group(timeout=SHORT_TIMEOUT)
    failure = None
    try:
        train(MiniDDP(make_model(), process_group=short_fuse), batches)
        outcome = f"ran its {steps[rank]} batches and went on to other work"
    except CollectiveFailed as error:
        failure = error
        outcome = f"CollectiveFailed after {SHORT_TIMEOUT.seconds} s:\n{error}"
    say_all_ranks(outcome)

    section("2. The same loop inside model.join()")
    say(
        textwrap.dedent("""\
        A rank whose loop ends waits in Join's exit. For every step the others still take, it
        answers each of their collectives with one of its own: an all-reduce of zeros per bucket,
        so the sum is the sum over the ranks still training, divided by the initial world size
        (a finished rank counts as one whose gradient is zero). Buffers come from the highest
        rank still training, and at the end everyone copies the last rank's model.""")
    )
    results = {}
    for wrapper in (MiniDDP, DistributedDataParallel):
        model = wrapper(make_model())
        with model.join():
            losses = train(model, batches)
        results[wrapper.__name__] = (model.module, losses)
    ours, theirs = results["MiniDDP"], results["DistributedDataParallel"]
    join_like_torch = same_bits(ours[0], theirs[0]) and ours[1] == theirs[1]
    say_all_ranks(
        f"{len(ours[1])} steps, then shadowed until all joined; "
        f"checksum {parameter_checksum(ours[0]):+.15f}; bitwise torch's Join: {join_like_torch}"
    )
    checksums = [0.0] * world
    dist.all_gather_object(checksums, parameter_checksum(ours[0]))

    section("3. A block run twice under reentrant checkpointing")
    twice_batches = my_batches(rank, 4)
    try:
        train(MiniDDP(BlockRunTwice()), twice_batches)
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    say(f"Without static_graph, on every rank:\n{refused}")
    say(
        textwrap.dedent("""\
        checkpoint(use_reentrant=True) runs the block's backward as an inner backward pass, once
        per use, and each one accumulates into .grad and fires the parameter's hook: "ready"
        twice, the first time with half a gradient. torch's DDP fails here too ("Expected to mark
        a variable ready only once"). If the graph is the same every iteration, static_graph=True
        fixes it: the first backward only counts each parameter's hooks (2 for the block, 1 for
        the rest) and all-reduces everything at its end; from then on a parameter is ready after
        as many hooks as that, and the second backward's order rebuilds the buckets.""")
    )
    twice = {}
    for wrapper in (MiniDDP, DistributedDataParallel):
        model = wrapper(BlockRunTwice(), static_graph=True)
        twice[wrapper.__name__] = (model.module, train(model, twice_batches))
    ours_twice, theirs_twice = twice["MiniDDP"], twice["DistributedDataParallel"]
    static_like_torch = same_bits(ours_twice[0], theirs_twice[0])
    static_like_torch = static_like_torch and ours_twice[1] == theirs_twice[1]
    say_all_ranks(f"static_graph=True: 4 steps, bitwise torch's static_graph: {static_like_torch}")

    section("Final check")
    # Rank 0 has the fewest batches: it went on, and every other rank waited for it in vain.
    assert (failure is None) == (rank == 0), f"rank {rank}: {failure}"
    assert failure is None or failure.missing_ranks == [0], failure.missing_ranks
    assert join_like_torch, "Join: MiniDDP differs from torch's DDP"
    assert len(set(checksums)) == 1, f"replicas differ after Join: {checksums}"
    assert "got its gradient twice" in refused and "static_graph=True" in refused, refused
    assert static_like_torch, "static_graph: MiniDDP differs from torch's DDP"
    say(
        f"Verified on {world} ranks: uneven inputs without Join stop with CollectiveFailed "
        "naming the rank that ran out; with model.join(), and a block run twice with "
        "static_graph=True, MiniDDP trains bit for bit like torch's DDP."
    )
    end_chapter()


if __name__ == "__main__":
    main()
