"""Chapter 03: rung 3 of the ladder, buckets: gradients travel together in a few flat tensors,
launched in a fixed order.

    torchrun --nproc_per_node=2 tutorials/03_bucketing.py [--bucket-cap-mb 0.004] [--diff]

Rung 2 (chapter 02b) sent one all-reduce per gradient tensor the moment it was ready. Two things
are wrong with that. Every message pays a fixed cost (a round trip, a kernel launch), so P small
tensors cost P of them: a model with hundreds of biases and norms pays hundreds. And each rank
launches in the order its own backward produced gradients, an order nothing forces to agree
across ranks. BucketedDDP (rung 3, miniddp/steps/buckets.py) packs the gradients into a few flat
buckets of about `bucket_cap_mb` MiB and launches each bucket, whole, in a fixed order. This
chapter:

1. walks what rung 3 adds to rung 2 in three parts: the flat buffer, the assignment rule, the
   fixed launch order (`--diff` prints each part's code; `python -m miniddp.steps diff --code 2
   3` the diff itself);
2. prints the layout: which gradients share a bucket, and why there;
3. runs both rungs and draws their timelines: all-reduces per step drop from P to the number of
   buckets, and all but the last bucket still leave while backward runs;
4. checks rung 3's claim: one process's gradients, and with 2 ranks torch's DDP's bits.
"""

from __future__ import annotations

import argparse
import inspect
import textwrap

import torch.distributed as dist
from common import (
    LADDER_TOLERANCE,
    add_diff_option,
    check_claims,
    end_chapter,
    ladder_model,
    say,
    say_claims,
    say_rung_diff,
    say_rung_layout,
    say_timeline,
    section,
    step_batches,
    train_steps,
    where,
)
from torch.nn.parallel import DistributedDataParallel

from miniddp.job.env import init_distributed
from miniddp.observe.events import NO_OBSERVER, Recorder
from miniddp.steps import BucketedDDP, OverlapDDP
from miniddp.steps.buckets import Bucket, assign_buckets

STEPS = 3
# The diff from rung 2 is the largest on the ladder; it is three ideas, read one at a time.
PARTS = [
    (
        "The flat buffer",
        (Bucket,),
        """\
        A hook no longer sends its gradient: it copies it, scaled by 1/W, into its slice of a
        bucket's one flat tensor, so that one all-reduce averages every gradient in it. The
        Bucket owns its life in a backward: add, is_full, launch, wait, write_back, reset.""",
    ),
    (
        "The assignment rule",
        (assign_buckets,),
        """\
        Which gradients share a bucket is decided once, at construction: walk the parameters
        in reverse registration order (backward usually readies the last layer first) and
        close a bucket once it holds the cap. Section 2 prints the layout it gives.""",
    ),
    (
        "The fixed launch order",
        (BucketedDDP._mark_ready, BucketedDDP._launch_full_buckets),
        """\
        A full bucket launches only when every bucket before it has: bucket 2 waits for
        bucket 1 even if it filled first. So every rank issues the same all-reduces in the
        same order, whatever order its own gradients came in. At the end of backward each
        bucket is waited for and its slices copied back into .grad. The wrapper's methods
        have MiniDDP's names: from here up, every rung, and MiniDDP, adds its idea to this
        same code.""",
    ),
]
BATCH = 16  # samples per rank per step
TRAVELS = {OverlapDDP: "gradient", BucketedDDP: "bucket"}  # what one all-reduce carries


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 03: rung 3, gradient buckets.")
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=0.004,
        help="bucket size cap in MiB (default 0.004, about 4 KiB: this toy's 13.6 KiB in 4)",
    )
    add_diff_option(parser)
    args = parser.parse_args()
    env = init_distributed()
    world_size = env.world_size
    batches = step_batches(STEPS, BATCH, world_size, env.rank)
    say(f"Chapter 03: buckets on {world_size} ranks, backend {env.backend}, {env.device}")

    section("1. What rung 3 adds to rung 2, in three parts")
    say_rung_diff(2, 3)
    for title, definitions, prose in PARTS:
        say(f"\n{title} ({where(*definitions)}).")
        say(textwrap.dedent(prose).strip())
        if args.diff:
            for definition in definitions:
                say(textwrap.indent(textwrap.dedent(inspect.getsource(definition)), "    "))

    section("2. The layout")
    bucketed = BucketedDDP(ladder_model(), bucket_cap_mb=args.bucket_cap_mb)
    cap_bytes = int(args.bucket_cap_mb * 2**20)
    say(f"BucketedDDP(model, bucket_cap_mb={args.bucket_cap_mb}): a cap of {cap_bytes:,} bytes.")
    say_rung_layout(bucketed)
    say(
        textwrap.dedent(f"""\
        Built once, at construction, walking the parameters in reverse registration order:
        backward usually produces the last layer's gradients first, so bucket 0 is meant to fill
        first. A parameter is added, then its bucket closes if it holds {cap_bytes:,} bytes or
        more: a bucket can overshoot by one tensor, and a tensor is never split. The last
        bucket holds what is left.""")
    )

    section("3. The timeline: rung 2, then rung 3")
    counts, gradients = {}, {}
    for rung, model in ((OverlapDDP, OverlapDDP(ladder_model())), (BucketedDDP, bucketed)):
        recorder = model.observer = Recorder()
        gradients[rung] = train_steps(model, batches)
        model.observer = NO_OBSERVER
        counts[rung] = say_timeline(rung.__name__, recorder.events, travels=TRAVELS[rung])
        say()
    parameters, buckets = len(bucketed.params), len(bucketed.buckets)
    say(
        textwrap.dedent(f"""\
        {parameters} all-reduces per step become {buckets}, one per bucket: {parameters - buckets}
        fewer fixed costs per step. Buckets 0 to {buckets - 2} leave while backward still
        computes; the last holds the first layer, whose gradients come last. The price of
        bigger messages: a bucket waits for its slowest gradient, so its sum starts later than a
        lone gradient's would. Chapter 04 measures the trade-off between latency and overlap.

        The layout is a guess: reverse registration order is when gradients usually arrive, not
        when they do. A model that registers a layer it runs first last, or a branch that runs
        late, leaves a bucket waiting for one late gradient. And with 3 or more ranks gloo's
        bits depend on where each gradient sits in its bucket, so only torch's own layout gives
        torch's bits. Rung 4 (chapter 03e) stops guessing.""")
    )

    section("4. Check the claim")
    one_process = train_steps(ladder_model(), step_batches(STEPS, BATCH, world_size, None))
    torch_ddp = train_steps(DistributedDataParallel(ladder_model()), batches)
    one_process_gap, torch_equal, torch_gap = say_claims(
        "BucketedDDP", gradients[BucketedDDP], one_process, torch_ddp
    )
    say(f"(With W = 2 any layout gives torch's bits: a + b = b + a. This run: W = {world_size}.)")

    assert all(c == (parameters, parameters - 1) for c in counts[OverlapDDP]), counts[OverlapDDP]
    assert all(c == (buckets, buckets - 1) for c in counts[BucketedDDP]), counts[BucketedDDP]
    exact = check_claims(one_process_gap, torch_equal, torch_gap, world_size, LADDER_TOLERANCE)
    dist.barrier()  # every rank has passed its own checks
    say(
        f"Verified on {world_size} ranks: BucketedDDP sends {buckets} all-reduces per step "
        f"instead of {parameters}, {buckets - 1} of them launched before backward's last "
        f"gradient; its gradients are one process's within {LADDER_TOLERANCE:.0e} and {exact} "
        "torch's DDP."
    )
    end_chapter()


if __name__ == "__main__":
    main()
