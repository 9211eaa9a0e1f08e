"""Chapter 05: rung 5 of the ladder, accumulation with no_sync(), and the pitfall that undoes it.

    torchrun --nproc_per_node=2 tutorials/05_no_sync.py [--micro-steps 4] [--bucket-cap-mb 0.004]
                                                        [--diff]

Chapter 00 added up k micro-batches in `.grad` before one optimizer step. Under DDP every backward
ends with an all-reduce, so k micro-steps would pay k rounds of communication when only the final
sum is needed. `no_sync()` skips the first k-1:

    for j, (inputs, targets) in enumerate(micro_batches):
        with ddp.no_sync() if j < k - 1 else nullcontext():
            loss = loss_fn(ddp(inputs), targets) / k    # forward AND backward inside
            loss.backward()
    optimizer.step()

Rung 5 of the ladder, NoSyncDDP (miniddp/steps/no_sync.py), is rung 4 plus exactly this. The
chapter names what it adds (`--diff` prints it: `python -m miniddp.steps diff --code 4 5`), counts
the collectives, checks the result against one process training on the global batch and against
torch's DDP bit for bit, then shows the pitfall: the forward outside `no_sync()`, only backward
inside. Its picture, docs/figures/05_no_sync.png, is one such step on a time axis.
"""

from __future__ import annotations

import argparse
import textwrap
from contextlib import nullcontext

import torch
import torch.distributed as dist
from common import (
    add_diff_option,
    end_chapter,
    fmt_bytes,
    make_dataset,
    make_model,
    parameter_checksum,
    say,
    say_all_ranks,
    say_rung_diff,
    section,
)
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from miniddp.job.env import init_distributed
from miniddp.steps import NoSyncDDP

MICRO_BATCH = 4  # samples per rank per micro-step
OPTIMIZER_STEPS = 3
LEARNING_RATE = 0.1
# float64 rounding is ~1e-16 per operation; a real mistake (a missing / k) would show at ~1e-1.
TOLERANCE = 1e-12

# Where the first k-1 micro-steps run: (forward inside no_sync, backward inside no_sync).
# The last micro-step always runs outside. Two separate `with` blocks let us move each half.
PATTERNS = {
    "without no_sync": (False, False),
    "no_sync": (True, True),
    "pitfall": (False, True),
    "forward only inside": (True, False),
}


def accumulate(
    ddp: nn.Module, micro_batches, pattern: str, divide: bool = True
) -> tuple[list[int], torch.Tensor]:
    """From zeroed gradients, run k micro-steps into .grad; return the all-reduces each
    micro-step launched and the accumulated gradient, flattened."""
    ddp.module.zero_grad(set_to_none=True)  # what optimizer.zero_grad() does
    forward_inside, backward_inside = PATTERNS[pattern]
    k = len(micro_batches)
    counts = []
    for j, (inputs, targets) in enumerate(micro_batches):
        before = ddp.all_reduce_count
        with ddp.no_sync() if forward_inside and j < k - 1 else nullcontext():
            loss = nn.functional.mse_loss(ddp(inputs), targets)
        with ddp.no_sync() if backward_inside and j < k - 1 else nullcontext():
            (loss / k if divide else loss).backward()
        counts.append(ddp.all_reduce_count - before)
    return counts, torch.cat([p.grad.flatten() for p in ddp.module.parameters()])


def torch_ddp_counting(model: nn.Module, bucket_cap_mb: float) -> DistributedDataParallel:
    """torch's DDP has no all-reduce counter: count in a communication hook that does the
    usual all-reduce (divide by W, then SUM)."""
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    ddp.all_reduce_count = 0

    def counting_allreduce(process_group, bucket):
        ddp.all_reduce_count += 1
        return allreduce_hook(process_group, bucket)

    ddp.register_comm_hook(None, counting_allreduce)
    return ddp


def warm_up(ddp: nn.Module, micro_batches) -> None:
    """Two plain steps, gradients discarded: the first records the gradient order, the second's
    forward rebuilds the buckets (chapter 03e). The layout is fixed from then on."""
    for _ in range(2):
        accumulate(ddp, micro_batches[:1], "without no_sync")


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 05: no_sync and accumulation.")
    parser.add_argument("--micro-steps", type=int, default=4, help="k, micro-steps per step")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.004, help="bucket cap in MiB")
    add_diff_option(parser)
    args = parser.parse_args()
    env = init_distributed()
    k, world_size = args.micro_steps, env.world_size
    data = make_dataset(n=OPTIMIZER_STEPS * k * world_size * MICRO_BATCH)
    # [step, micro-step, rank, sample, feature]: rank r's j-th micro-batch of step s is
    # x[s, j, r]; the global batch of micro-step j is x[s, j] flattened over the ranks.
    x, y = (t.view(OPTIMIZER_STEPS, k, world_size, MICRO_BATCH, -1) for t in data.tensors)
    mine = [[(x[s, j, env.rank], y[s, j, env.rank]) for j in range(k)] for s in range(x.shape[0])]
    say(f"Chapter 05: no_sync on {world_size} ranks, {k} micro-steps of {MICRO_BATCH} samples")

    section("0. What rung 5 adds to rung 4")
    say_rung_diff(4, 5, show=args.diff)
    say(
        textwrap.dedent("""\
        One decision, taken at the end of every forward: inside no_sync() the forward leaves
        the Phase LOCAL, and every hook of its backward returns at once, so autograd's own
        accumulation into .grad is all that happens. The first forward outside sets it ARMED;
        its backward's first gradient starts REDUCING, and the backward copies the whole
        accumulated .grad into the buckets and all-reduces them, exactly as rung 4 did with one
        micro-step's gradient. Buffers follow the same decision: they are refreshed from rank 0
        only before a forward that follows a synced one. Rung 4's flag "reducing or not"
        becomes the Phase; its Bucket and BucketLayout are untouched. MiniDDP's no_sync() and
        Phase are this rung's.""")
    )

    model = make_model(seed=0)  # float64: differences below are rounding, not noise
    ddp = NoSyncDDP(model, bucket_cap_mb=args.bucket_cap_mb)
    warm_up(ddp, mine[0])
    buckets = len(ddp.buckets)
    synced_bytes = sum(b.flat.nbytes for b in ddp.buckets)
    say(f"After warm-up: {buckets} buckets, {fmt_bytes(synced_bytes)} all-reduced per synced step.")

    section("1. Accumulating without no_sync: every backward all-reduces")
    every, synced_every_time = accumulate(ddp, mine[0], "without no_sync")
    say(
        f"all-reduces per micro-step: {every}, total {sum(every)} = {k} x {buckets} buckets, "
        f"{fmt_bytes(k * synced_bytes)}"
    )

    section("2. With no_sync: one synced step's worth")
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    per_step = []
    for step in range(OPTIMIZER_STEPS):  # the loop from the top of this file, written out
        optimizer.zero_grad()
        counts = []
        for j, (inputs, targets) in enumerate(mine[step]):
            before = ddp.all_reduce_count
            with ddp.no_sync() if j < k - 1 else nullcontext():
                loss = nn.functional.mse_loss(ddp(inputs), targets) / k
                loss.backward()
            counts.append(ddp.all_reduce_count - before)
        per_step.append(counts)
        if step == 0:
            grads = torch.cat([p.grad.flatten() for p in model.parameters()])
            gap_every = (grads - synced_every_time).abs().max().item()
        optimizer.step()
    quiet = per_step[0]
    for step, counts in enumerate(per_step):
        say(f"step {step}: all-reduces per micro-step {counts}")
    saved_bytes = fmt_bytes((k - 1) * synced_bytes)
    every_bytes = fmt_bytes(k * synced_bytes)  # what all-reducing every micro-step costs
    say(
        textwrap.dedent(f"""\
        Saved per optimizer step: {sum(every) - sum(quiet)} of {sum(every)} collectives,
        {saved_bytes} of {every_bytes} of gradients all-reduced
        (a ring all-reduce of n bytes sends 2(W-1)/W n from each rank: chapter 01).
        Same gradient as section 1: max |difference| {gap_every:.1e}; .grad summed the k
        micro-batches locally, and the last backward averaged that sum over the ranks.
        Each loss is divided by k = {k} because DDP never rescales for accumulation: it divides by W
        (the ranks) and knows nothing about micro-steps.""")
    )

    section("3. Same as one process on the global batch, and as torch's DDP")
    single = make_model(seed=0)
    single_optimizer = torch.optim.SGD(single.parameters(), lr=LEARNING_RATE)
    for step in range(OPTIMIZER_STEPS):
        single_optimizer.zero_grad()
        for j in range(k):
            inputs, targets = x[step, j].flatten(0, 1), y[step, j].flatten(0, 1)
            (nn.functional.mse_loss(single(inputs), targets) / k).backward()
        single_optimizer.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    expected = torch.cat([p.detach().flatten() for p in single.parameters()])
    max_error = (flat - expected).abs().max()
    dist.all_reduce(max_error, op=dist.ReduceOp.MAX)
    say(
        textwrap.dedent(f"""\
        After {OPTIMIZER_STEPS} steps, largest parameter difference from one process with
        {world_size * MICRO_BATCH}-sample micro-batches:
        {max_error.item():.1e} (tolerance {TOLERANCE:.0e}).""")
    )
    why = textwrap.dedent("""\
        each rank sums its own samples and gloo adds the partial sums, while one process
        sums all samples at once; float addition is not associative""")
    say(f"Not zero: {why}." if max_error.item() > 0 else f"Zero this time, by luck: {why}.")
    highest, lowest = flat.clone(), flat.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    replicas_equal = torch.equal(highest, lowest)
    say_all_ranks(f"checksum after training: {parameter_checksum(model):+.15f}")
    say(f"Replicas bit-for-bit equal on all ranks (elementwise MAX == MIN): {replicas_equal}")
    reference = make_model(seed=0)
    torch_plain = DistributedDataParallel(reference, bucket_cap_mb=args.bucket_cap_mb)
    for _ in range(2):  # the same warm-up: the order recorded, then the buckets rebuilt
        reference.zero_grad(set_to_none=True)
        nn.functional.mse_loss(torch_plain(mine[0][0][0]), mine[0][0][1]).backward()
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=LEARNING_RATE)
    for step in range(OPTIMIZER_STEPS):  # the same loop, through torch's DDP
        torch_optimizer.zero_grad()
        for j, (inputs, targets) in enumerate(mine[step]):
            with torch_plain.no_sync() if j < k - 1 else nullcontext():
                (nn.functional.mse_loss(torch_plain(inputs), targets) / k).backward()
        torch_optimizer.step()
    torch_flat = torch.cat([p.detach().flatten() for p in reference.parameters()])
    same_as_torch = torch.tensor(float(torch.equal(flat, torch_flat)))
    dist.all_reduce(same_as_torch, op=dist.ReduceOp.MIN)
    say(
        f"Parameters bit for bit torch's DDP's after the same loop, on every rank: "
        f"{bool(same_as_torch.item())}"
    )

    section("4. Forgetting / k")
    _, divided = accumulate(ddp, mine[0], "no_sync")
    _, undivided = accumulate(ddp, mine[0], "no_sync", divide=False)
    ratio = undivided / divided
    say(
        textwrap.dedent(f"""\
        undivided / divided gradient, per entry: min {ratio.min():.12f}, max {ratio.max():.12f}
        With SGD the step would be {k} times longer, as if the learning rate were {k}x; Adam hardly
        notices the scale, and the error moves to eps, weight decay and clipping (chapter 00).""")
    )

    section("5. The pitfall: forward outside no_sync, only backward inside")
    results = {}
    for pattern in ("pitfall", "forward only inside"):
        counts, grads = accumulate(ddp, mine[0], pattern)
        gap = (grads - divided).abs().max().item()
        results[pattern] = counts
        say(f"{pattern:<20} all-reduces per micro-step {counts}, gradient vs no_sync {gap:.1e}")
    torch_ddp = torch_ddp_counting(make_model(seed=0), args.bucket_cap_mb)
    warm_up(torch_ddp, mine[0])
    for pattern in ("no_sync", "pitfall"):
        results[f"torch {pattern}"], _ = accumulate(torch_ddp, mine[0], pattern)
        say(f"torch's DDP, {pattern:<8} all-reduces per micro-step {results[f'torch {pattern}']}")
    say(
        textwrap.dedent(f"""\
        Whether a backward synchronizes is decided by its forward: outside no_sync() the forward
        arms the reducer, and the hooks that backward fires only read that decision. So the pitfall
        all-reduces on every micro-step: {k} x {buckets} = {sum(results["pitfall"])} collectives and
        {every_bytes} instead of {fmt_bytes(synced_bytes)}, in rung 5 and torch alike. Nothing
        fails and the gradient is still right, so the waste shows only in the count, the bytes and
        the time. The reverse, forward inside and backward outside, does skip: only the forward's
        place matters.""")
    )

    section("Final check")
    assert every == [buckets] * k, every
    assert all(counts == [0] * (k - 1) + [buckets] for counts in per_step), per_step
    assert gap_every <= TOLERANCE, gap_every
    assert max_error.item() <= TOLERANCE, max_error
    assert replicas_equal, "replicas drifted apart"
    assert same_as_torch.item() == 1, "not torch's DDP's parameters bit for bit"
    assert torch.allclose(ratio, torch.full_like(ratio, k), rtol=TOLERANCE, atol=0), ratio
    assert results["pitfall"] == [buckets] * k == results["torch pitfall"], results
    assert results["forward only inside"] == quiet == results["torch no_sync"], results
    dist.barrier()  # every rank has passed its own checks
    say(
        f"Verified on {world_size} ranks: with no_sync, {sum(quiet)} all-reduces per step "
        f"instead of {sum(every)}; parameters match one process within {TOLERANCE:.0e} and "
        f"torch's DDP bit for bit; replicas identical; forward outside no_sync still costs "
        f"{k} x {buckets} all-reduces."
    )
    say(
        "The picture: docs/figures/05_no_sync.png, one such step on 2 ranks, timed "
        "(python -m miniddp.figures --out docs/figures --only 05 draws it again)."
    )
    end_chapter()


if __name__ == "__main__":
    main()
