"""Chapter 02: data parallelism by hand, in its simplest correct form: rung 1 of the ladder.

    torchrun --nproc_per_node=2 tutorials/02_naive_ddp.py
    ./launch.sh tutorials/02_naive_ddp.py        (the same, with defaults filled in)

Every rank holds a full copy of the model and trains on its own shard of each batch. Two rules
keep the copies identical, and `miniddp.steps.NaiveDDP`, the first rung of the ladder of DDPs
that chapters 02b-05b climb, implements both:

1. Start equal: broadcast every parameter and buffer from rank 0.
2. Step equal: after backward, replace each gradient by its average over the ranks. Every rank
   then applies the same update to the same weights.

The chapter then checks the claims that matter: this is the same training as one process taking
the whole global batch, and, with 2 ranks, bit for bit what torch's DistributedDataParallel does.
"""

from __future__ import annotations

import inspect
import textwrap
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from common import (
    end_chapter,
    fmt_bytes,
    make_dataset,
    make_model,
    parameter_checksum,
    say,
    say_all_ranks,
    section,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from miniddp.data_parallel.sampler import DistributedSampler
from miniddp.job.env import init_distributed
from miniddp.steps import NaiveDDP
from miniddp.steps.__main__ import label

MICRO_BATCH = 4  # samples per forward/backward on one rank
ACCUMULATION_STEPS = 2  # micro-steps per optimizer step
OPTIMIZER_STEPS = 4
LEARNING_RATE = 0.1
DATA_SEED = 0
SHUFFLE_SEED = 0
# float64 round-off is ~1e-16 per operation; four steps of a tiny MLP stay far below this.
TOLERANCE = 1e-10


def micro_batches_of(dataset: TensorDataset, rank: int, world_size: int) -> DataLoader:
    """Rank `rank`'s micro-batches; any process can compute any rank's, no communication."""
    sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=SHUFFLE_SEED)
    sampler.set_epoch(0)
    return DataLoader(dataset, batch_size=MICRO_BATCH, sampler=sampler, drop_last=True)


def train_reference(dataset: TensorDataset, world_size: int) -> nn.Module:
    """One process, same global batches, same accumulation: micro-step j uses the j-th
    micro-batch of every rank at once, so each forward sees MICRO_BATCH * world_size samples."""
    model = make_model(seed=0)  # rank 0's seed: NaiveDDP broadcast rank 0's weights
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    per_rank = [iter(micro_batches_of(dataset, r, world_size)) for r in range(world_size)]
    for _ in range(OPTIMIZER_STEPS):
        optimizer.zero_grad()
        for _ in range(ACCUMULATION_STEPS):
            batches = [next(batches_of_rank) for batches_of_rank in per_rank]
            inputs = torch.cat([inputs for inputs, _ in batches])
            targets = torch.cat([targets for _, targets in batches])
            loss = nn.functional.mse_loss(model(inputs), targets) / ACCUMULATION_STEPS
            loss.backward()
        optimizer.step()
    return model


def train_torch_ddp(dataset: TensorDataset, rank: int, world_size: int) -> nn.Module:
    """The same steps through torch's DDP; `no_sync()` keeps it from averaging every micro-step
    (chapter 05), so it too averages once per optimizer step, what has accumulated in `.grad`."""
    model = make_model(seed=rank)  # torch's DDP broadcasts rank 0's weights too
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    batches = iter(micro_batches_of(dataset, rank, world_size))
    for _ in range(OPTIMIZER_STEPS):
        optimizer.zero_grad()
        for micro_step in range(ACCUMULATION_STEPS):
            inputs, targets = next(batches)
            last = micro_step == ACCUMULATION_STEPS - 1
            with nullcontext() if last else ddp.no_sync():
                loss = nn.functional.mse_loss(ddp(inputs), targets) / ACCUMULATION_STEPS
                loss.backward()
        optimizer.step()
    return model


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def main() -> None:
    env = init_distributed()
    world_size = env.world_size
    global_batch = MICRO_BATCH * ACCUMULATION_STEPS * world_size
    # Exactly OPTIMIZER_STEPS global batches: no padding, every shard the same size.
    dataset = make_dataset(n=global_batch * OPTIMIZER_STEPS, seed=DATA_SEED)

    say(f"Chapter 02: naive DDP on {world_size} ranks, backend {env.backend}, {env.device}")
    say(f"NaiveDDP is rung 1 of the ladder of DDPs, in {label(1)}.")

    section("1. Start equal: broadcast from rank 0")
    say(
        textwrap.dedent("""\
        Each rank seeds its model with its own rank, so the replicas start different, as they
        would if a script seeded by rank (say, for data augmentation) before building the model.""")
    )
    model = make_model(seed=env.rank)
    say_all_ranks(f"checksum before broadcast: {parameter_checksum(model):+.12f}")
    ddp = NaiveDDP(model)
    tensors = list(model.parameters())
    buffers = list(model.buffers())
    say(f"NaiveDDP(model) broadcast {len(tensors)} parameters and {len(buffers)} buffers.")
    say_all_ranks(f"checksum after broadcast:  {parameter_checksum(model):+.12f}")

    section("2. Each rank its own shard")
    micro_batches = micro_batches_of(dataset, env.rank, world_size)
    my_indices = list(micro_batches.sampler)
    say_all_ranks(f"{len(my_indices)} of {len(dataset)} samples, first: {my_indices[:8]}")
    every_rank_indices = [None] * world_size
    dist.all_gather_object(every_rank_indices, my_indices)
    union = set().union(*every_rank_indices)
    assert sum(map(len, every_rank_indices)) == len(union) == len(dataset), "shards overlap"
    say(f"The shards are disjoint and together cover all {len(dataset)} samples.")

    section("3. Step equal: accumulate locally, then all-reduce every gradient")
    say(
        textwrap.dedent(f"""\
        Each optimizer step, every rank runs {ACCUMULATION_STEPS} micro-steps of {MICRO_BATCH}
        samples and divides each loss by {ACCUMULATION_STEPS}, so the gradients that add up in
        .grad are the mean over its micro-batches. Only then does NaiveDDP average them over the
        ranks, in the one method that is all of rung 1's idea: one round of communication per
        optimizer step.
        """)
    )
    say(textwrap.dedent(inspect.getsource(NaiveDDP.finish_gradient_synchronization)))
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    batches = iter(micro_batches)
    compute_seconds = sync_seconds = 0.0
    for step in range(OPTIMIZER_STEPS):
        optimizer.zero_grad()
        samples_here, shard_loss = 0, 0.0
        started = time.perf_counter()
        for _ in range(ACCUMULATION_STEPS):
            inputs, targets = next(batches)
            loss = nn.functional.mse_loss(ddp(inputs), targets) / ACCUMULATION_STEPS
            loss.backward()
            samples_here += len(inputs)
            shard_loss += loss.item()
        backward_done = time.perf_counter()
        ddp.finish_gradient_synchronization()
        compute_seconds += backward_done - started
        sync_seconds += time.perf_counter() - backward_done
        optimizer.step()

        samples_everywhere = torch.tensor(samples_here)
        dist.all_reduce(samples_everywhere)
        assert samples_everywhere.item() == global_batch, samples_everywhere
        say(
            f"step {step}: loss {shard_loss:.4f} on rank 0's shard, "
            f"{samples_everywhere.item()} samples consumed over all ranks"
        )
    say(
        f"Global batch = {MICRO_BATCH} (micro-batch) x {ACCUMULATION_STEPS} (accumulation) x "
        f"{world_size} (ranks) = {global_batch}, as counted."
    )
    calls_per_step = ddp.all_reduce_count // OPTIMIZER_STEPS
    sizes = ", ".join(fmt_bytes(p.nbytes) for p in tensors)
    say(
        f"Per step: {calls_per_step} all-reduces, one per parameter tensor, "
        f"{fmt_bytes(sum(p.nbytes for p in tensors))} in all; sizes {sizes}"
    )

    section("4. Check the claims")
    mine = flat(model)
    max_error = (mine - flat(train_reference(dataset, world_size))).abs().max()
    dist.all_reduce(max_error, op=dist.ReduceOp.MAX)
    say(
        f"Largest difference from single-process training on the same {global_batch}-sample "
        f"batches: {max_error.item():.1e} (tolerance {TOLERANCE:.0e})."
    )
    why = textwrap.dedent("""\
        floating-point addition is not associative (each rank sums its shard's gradients and
        the all-reduce adds the partial sums; the reference sums all samples at once)""")
    say(f"Not zero because {why}." if max_error.item() > 0 else f"Zero by luck, not right: {why}.")
    assert max_error.item() <= TOLERANCE
    highest, lowest = mine.clone(), mine.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    say_all_ranks(f"checksum after training:   {parameter_checksum(model):+.12f}")
    assert torch.equal(highest, lowest), "replicas drifted apart"
    say("Every parameter is bit-for-bit equal on all ranks (elementwise MAX == MIN).")

    torch_gap = (mine - flat(train_torch_ddp(dataset, env.rank, world_size))).abs().max()
    dist.all_reduce(torch_gap, op=dist.ReduceOp.MAX)
    say(
        textwrap.dedent(f"""\
        Against torch's DistributedDataParallel on the same shards: largest difference
        {torch_gap.item():.1e}. Both multiply each gradient by the float 1/W, then all-reduce
        with SUM. With 2 ranks that sum is a + b = b + a, exactly, however the gradients are
        packed, so the bits must agree;
        with more ranks gloo's order of additions depends on where each gradient sits in torch's
        buckets (rung 4, chapter 03e, copies that layout), so only the tolerance holds.""")
    )
    assert torch_gap.item() <= TOLERANCE
    if world_size == 2:
        assert torch_gap.item() == 0, "not bitwise torch's DDP at W = 2"

    section("5. What is slow here")
    say(
        textwrap.dedent(f"""\
        Measured on rank 0, over {OPTIMIZER_STEPS} steps: {compute_seconds * 1e3:.1f} ms
        forward+backward, {sync_seconds * 1e3:.1f} ms in all-reduce (waiting for slower ranks
        included).
        - {calls_per_step} blocking collectives per step, one per tensor: each pays the fixed
          cost of a network round trip, however small the tensor.
        - Nothing overlaps: communication starts only after the whole backward is done, and each
          all-reduce waits for the one before it, while the CPU or GPU sits idle.
        Chapter 02b climbs one rung: each gradient's all-reduce starts, without blocking, as soon
        as backward has produced it, so communication hides behind the rest of backward.""")
    )
    say(
        "The picture: docs/figures/02_data_parallel.png (replicas, the batch in shards, one "
        "all-reduce)"
    )
    dist.barrier()  # every rank has passed its own checks
    exact = "bit for bit" if world_size == 2 else f"within {TOLERANCE:.0e} of"
    say(
        f"Verified on {world_size} ranks: NaiveDDP trains as one process on the global batch of "
        f"{global_batch} (within {TOLERANCE:.0e}), {exact} torch's DDP, replicas identical."
    )
    end_chapter()


if __name__ == "__main__":
    main()
