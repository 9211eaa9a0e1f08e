"""Chapter 05b: rungs 6 and 7, then MiniDDP: unused parameters, comm hooks, gradients that live
in their buckets, and what production adds; MiniDDP's buckets over chapter 01's ring.

    torchrun --nproc_per_node=2 tutorials/05b_miniddp.py [--bucket-cap-mb 0.004] [--diff]

Rung 5 (chapter 05) averages gradients exactly as torch's DistributedDataParallel does, no_sync
included, as long as every parameter gets a gradient and every bucket goes out as gloo's
all-reduce. The last two rungs lift those limits, one idea each, and MiniDDP
(miniddp/data_parallel/ddp.py) is the top rung with what production needs around it. This chapter:

1. names the code rung 6 adds (`--diff` prints it: `python -m miniddp.steps diff --code 5 6`)
   and runs it on a model with a branch one rank skips and a layer no rank uses, against
   torch's DDP;
2. names the code rung 7 adds (`diff --code 6 7`), shows a `.grad` that is its bucket's slice
   (gradient_as_bucket_view), then swaps gloo's all-reduce for the send/recv ring of chapter 01
   with a comm hook and counts each bucket's messages against 2(W-1)/W n;
3. sums up `diff 7 8`, what MiniDDP adds to rung 7 (compared definition by definition, as
   MiniDDP lives in several files): checks and errors, Join, static_graph;
4. checks the claims: rung 6's gradients, None included, are torch's bit for bit; rung 7's are
   with its buckets as `.grad`; over the ring, one process's and (W = 2) torch's bits.
"""

from __future__ import annotations

import argparse
import textwrap

import torch
import torch.distributed as dist
from common import (
    LADDER_TOLERANCE,
    add_diff_option,
    check_claims,
    end_chapter,
    ladder_model,
    say,
    say_all_ranks,
    say_claims,
    say_rung_diff,
    say_rung_layout,
    section,
    step_batches,
    train_steps,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp.collectives import Message, record_messages
from miniddp.data_parallel.default_hooks import all_reduce_hook
from miniddp.job.env import init_distributed
from miniddp.steps import CommHookDDP, UnusedParametersDDP
from miniddp.steps.__main__ import diff

STEPS = 3  # one bucket, the rebuild, then a step with the rebuilt buckets
BATCH = 16  # samples per rank per step


class WithBranches(nn.Module):
    """The ladder's model, plus a branch only odd ranks take and a layer no rank uses."""

    def __init__(self) -> None:
        super().__init__()
        self.body = ladder_model()
        torch.manual_seed(1)
        self.branch = nn.Linear(1, 1)  # used on odd ranks only
        self.spare = nn.Linear(1, 1)  # used nowhere: a head kept for later, say

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return y + self.branch(y) if dist.get_rank() % 2 == 1 else y


def train_with_branches(ddp_class: type, batches: list) -> list[list[torch.Tensor | None]]:
    """Each step's `.grad` of every parameter (None where there is none), SGD with momentum:
    a zero gradient instead of None would move a parameter through its momentum."""
    net = WithBranches()
    ddp = ddp_class(net, find_unused_parameters=True)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for inputs, targets in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in net.parameters()])
        optimizer.step()
    return grads


def same_on_every_rank(flag: bool) -> bool:
    """Whether `flag` holds on every rank (a collective: every rank must call it)."""
    agreed = torch.tensor(float(flag))
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return bool(agreed.item())


def ring_bytes(nbytes: int, numel: int, world_size: int, rank: int) -> int:
    """What the ring makes `rank` send for a tensor of `numel` elements (`nbytes` bytes): every
    chunk but two, its own and its right neighbour's, each way; about 2(W-1)/W n."""
    chunks = [len(c) * nbytes // numel for c in torch.arange(numel).tensor_split(world_size)]
    return 2 * nbytes - chunks[rank] - chunks[(rank + 1) % world_size]


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 05b: rungs 6, 7 and MiniDDP.")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.004, help="bucket cap in MiB")
    add_diff_option(parser)
    args = parser.parse_args()
    env = init_distributed()
    world_size, rank = env.world_size, env.rank
    batches = step_batches(STEPS, BATCH, world_size, rank)
    say(f"Chapter 05b: rungs 6, 7 and MiniDDP on {world_size} ranks, backend {env.backend}")

    section("1. What rung 6 adds to rung 5: unused parameters")
    say_rung_diff(5, 6, show=args.diff)
    say(
        textwrap.dedent("""\
        A bucket launches once all its gradients are in, so a parameter that gets none would
        hold its bucket forever; rung 5 fills the hole with zeros and refuses. With
        find_unused_parameters=True the forward walks its own graph back from the output and
        the first hook of the backward marks what the walk never reached as ready at once.
        One more small all-reduce, of which parameters each rank used, decides what .grad
        becomes: the average for a parameter some rank used, nothing for one no rank used.""")
    )
    ours = train_with_branches(UnusedParametersDDP, batches)
    theirs = train_with_branches(DistributedDataParallel, batches)
    names = [name for name, _ in WithBranches().named_parameters()]
    say(f"\nWithBranches under rung 6 and torch's DDP, {STEPS} steps; the last step's .grad:")
    for name, a, b in zip(names[-4:], ours[-1][-4:], theirs[-1][-4:]):
        shown = "None" if a is None else f"{a.flatten()[0].item():+.6f}"
        if b is None:
            theirs_shown = "None"
        else:
            same = a is not None and torch.equal(a, b)
            theirs_shown = "the same bits" if same else f"{b.flatten()[0].item():+.6f}, differs"
        say(f"  {name:<14} rung 6 {shown:>10}   torch's {theirs_shown}")
    pairs = [(a, b) for mine, other in zip(ours, theirs) for a, b in zip(mine, other)]
    unused_like_torch = same_on_every_rank(
        all((a is None) == (b is None) and (a is None or torch.equal(a, b)) for a, b in pairs)
    )
    say(
        textwrap.dedent(f"""\
        branch.*: used on the odd ranks only, averaged over all {world_size} ranks with zeros
        from the even ones, on every rank. spare.*: used nowhere, so .grad stays None (zeros
        would let momentum keep moving it). Every .grad, None included, bit for
        bit torch's DDP's on every rank: {unused_like_torch}.""")
    )

    section("2. What rung 7 adds to rung 6: comm hooks, gradients as bucket views")
    say_rung_diff(6, 7, show=args.diff)
    viewed = CommHookDDP(
        ladder_model(), bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=True
    )
    torch_viewed = DistributedDataParallel(
        ladder_model(), bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=True
    )
    as_views, torch_as_views = train_steps(viewed, batches), train_steps(torch_viewed, batches)
    bucket = viewed.buckets[0]
    first, first_name = bucket.params[0], viewed.param_names[bucket.param_indices[0]]
    inside = first.grad.data_ptr() == bucket.views[0].data_ptr()
    view_pairs = [
        (a, b) for mine, other in zip(as_views, torch_as_views) for a, b in zip(mine, other)
    ]
    views_like_torch = same_on_every_rank(all(torch.equal(a, b) for a, b in view_pairs))
    say(
        textwrap.dedent(f"""\
        With gradient_as_bucket_view=True, after {STEPS} steps: the .grad of
        {first_name} starts where its slice of bucket 0 starts: {inside}.
        Backward accumulates into the bucket, the copy in becomes a division in place, and
        there is no copy back out. Gradients bit for bit torch's DDP's with the same option:
        {views_like_torch}.""")
    )

    ring = all_reduce_hook("ring")
    say(
        textwrap.dedent("""
        A comm hook decides what happens to a full bucket: it gets the bucket, not yet divided
        by W, and returns a future of the averaged tensor. all_reduce_hook("ring") runs the
        send/recv ring that chapter 01 built and watched
        (miniddp/data_parallel/default_hooks.py).""")
    )
    ddp = CommHookDDP(ladder_model(), bucket_cap_mb=args.bucket_cap_mb)
    messages: dict[int, list[Message]] = {}  # each bucket's messages in its latest all-reduce

    def watched_ring(state, bucket):
        """The same hook, recording what this rank sends while this bucket is reduced."""
        with record_messages() as log:
            future = ring(state, bucket)
        messages[bucket.index()] = log  # filled in as the ring runs; complete after backward
        return future

    ddp.register_comm_hook(None, watched_ring)
    gradients = train_steps(ddp, batches)
    say(f"ddp.register_comm_hook(None, watched_ring), then {STEPS} steps; the last one's buckets:")
    say_rung_layout(ddp)
    say(f"\nWhat rank {rank} sent for each bucket, against chapter 01's formula:")
    say(f"{'bucket':>6}  {'n bytes':>8}  {'messages':>8}  {'bytes sent':>10}  {'2(W-1)/W n':>10}")
    ring_as_promised = True
    for bucket in ddp.buckets:
        sent = messages[bucket.index]
        sent_bytes = sum(m.nbytes for m in sent)
        nbytes = bucket.flat.nbytes
        ideal = 2 * (world_size - 1) * nbytes / world_size
        exact = ring_bytes(nbytes, bucket.flat.numel(), world_size, rank)
        ring_as_promised &= len(sent) == 2 * (world_size - 1) and sent_bytes == exact
        say(f"{bucket.index:>6}  {nbytes:>8,}  {len(sent):>8}  {sent_bytes:>10,}  {ideal:>10,.0f}")
    say(
        textwrap.dedent(f"""\
        Each bucket is one ring all-reduce: 2(W-1) = {2 * (world_size - 1)} steps, one message per
        rank per step, each a chunk of about n/W bytes. (Where W does not divide the bucket,
        chunks differ by an element, and each rank's bytes with them.) Bucket 0's messages,
        every rank's, step by step:""")
    )
    for sent in messages[ddp.buckets[0].index]:
        say_all_ranks(f"step {sent.step}: {sent.src} -> {sent.dst}, {sent.what}, {sent.nbytes} B")

    section("3. What MiniDDP adds to rung 7: what production needs")
    changes = [line for line in diff(7, 8).splitlines() if line[:1] in "+-"]
    changes = [line for line in changes if line[:4] not in ("+++ ", "--- ")]
    added = sum(line.startswith("+") for line in changes)
    say(
        f"`python -m miniddp.steps diff 7 8`: rung 7 -> MiniDDP, {added} lines added, "
        f"{len(changes) - added} removed."
    )
    say(
        textwrap.dedent("""\
        The algorithm is rung 7's, written the same way: the same layout, scaling, launch order,
        rebuild, no_sync, unused parameters, hooks and bucket views, so MiniDDP is bitwise torch's
        DDP wherever rung 7 is. Each line the diff adds is something a real job needs:

          - every rank checks at construction that all ranks hold the same model and settings,
            and names what differs, before a step can train on mismatched replicas;
          - one wait seam: a rank that died or stalled is named in the error, not left to a bare
            timeout (miniddp/job/faults.py, chapter 06);
          - uneven inputs under Join (chapter 10), and static_graph for reentrant checkpointing,
            with a clear error for a second backward;
          - a process group of its own, and the layout printed and saved for checkpoints;
          - two speed tricks (miniddp/data_parallel/bucket.py) that batch small gradients'
            copies, with the same bits.

        MiniDDP lives in several files, so the diff pairs each of rung 7's definitions with
        MiniDDP's of the same name, wherever it lives (Bucket with bucket.py's, CommHookDDP with
        MiniDDP); `--code` shows the hunks.""")
    )

    section("4. Check the claims")
    one_process = train_steps(ladder_model(), step_batches(STEPS, BATCH, world_size, None))
    torch_ddp = train_steps(DistributedDataParallel(ladder_model()), batches)
    one_process_gap, torch_equal, torch_gap = say_claims(
        "Rung 7 over the ring", gradients, one_process, torch_ddp
    )
    say(
        textwrap.dedent(f"""\
        The hook scales by 1/W before the ring sums, as gloo's path does. With 2 ranks each
        chunk's sum is one addition, a + b = b + a: gloo's bits exactly. With more ranks the
        ring adds the ranks' values in its own order, gloo in another, and the last bits may
        differ within the tolerance (this run: W = {world_size}).""")
    )

    assert unused_like_torch, "rung 6's gradients are not torch's (find_unused_parameters)"
    assert views_like_torch, "rung 7's gradients are not torch's (gradient_as_bucket_view)"
    assert same_on_every_rank(inside), ".grad is not a view of its bucket"
    assert same_on_every_rank(ring_as_promised), "a bucket's ring sent other messages"
    assert ddp.all_reduce_count == 1 + (STEPS - 1) * len(ddp.buckets), ddp.all_reduce_count
    exact = check_claims(one_process_gap, torch_equal, torch_gap, world_size, LADDER_TOLERANCE)
    dist.barrier()  # every rank has passed its own checks
    say(
        f"Verified on {world_size} ranks: rung 6's gradients, None included, and rung 7's as "
        f"bucket views are torch's DDP's bit for bit; over chapter 01's ring, rung 7's "
        f"{len(ddp.buckets)} buckets sent {2 * (world_size - 1)} messages each, the bytes of "
        f"its formula, and its gradients are one process's within {LADDER_TOLERANCE:.0e} and "
        f"{exact} torch's DDP."
    )
    end_chapter()


if __name__ == "__main__":
    main()
