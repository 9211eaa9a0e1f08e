"""Chapter 03: buckets, and how DDP hides communication behind the backward pass.

    torchrun --nproc_per_node=2 tutorials/03_bucketing.py [--bucket-cap-mb 0.004] [--batch 16]
    ./launch.sh                                   (runs this chapter by default)

Chapter 02 sent one blocking all-reduce per parameter, after backward. MiniDDP, like torch's
DistributedDataParallel, packs gradients into a few flat *buckets* and starts each bucket's
all-reduce, without waiting for it, as soon as the bucket's last gradient exists, while backward
computes the rest. This chapter follows one model through its first two steps:

1. at construction, one bucket holds everything;
2. step 1 records the order in which gradients become ready;
3. before step 2's forward, the buckets are rebuilt from that order, with the size cap;
4. in step 2, buckets launch while backward is still running;
5. torch's DDP on the same model and data: the same layout and bit-identical gradients.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from common import fmt_bytes, make_dataset, make_model, say, say_all_ranks, section
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp import MiniDDP
from miniddp.env import cleanup, init_distributed

LEARNING_RATE = 0.1
STEPS = 2  # the first with one bucket, the second after the rebuild


def build_model() -> nn.Module:
    """Five Linear layers, 8 -> 32 -> 32 -> 32 -> 32 -> 1, in float32: 3,489 parameters."""
    return make_model(seed=0, in_features=8, hidden=32, depth=5, dtype=torch.float32)


def run_torch_ddp(batches, bucket_cap_mb: float) -> tuple[list[list[torch.Tensor]], list]:
    """The same steps through torch's own DDP; return each step's gradients and its layout."""
    model = build_model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    grads = []
    for inputs, targets in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(inputs), targets).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    name_of = {id(p): n for n, p in model.named_parameters()}
    # _get_zeros_like_grad_buckets() is private, meant for torch's own tests: fine for peeking
    # at the layout here, not something to build on.
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    return grads, [[name_of[id(p)] for p in bucket.parameters()] for bucket in buckets]


def finish_step(
    ddp: MiniDDP, optimizer: torch.optim.Optimizer, output: torch.Tensor, targets: torch.Tensor
):
    """Backward with events recorded, then the optimizer step. Returns the events after
    backward began as (ms since then, kind, name), the all-reduces launched, the gradients."""
    before = ddp.all_reduce_count
    ddp.record_events(True)
    start = time.perf_counter()
    nn.functional.mse_loss(output, targets).backward()
    events = sorted((e.time, e.kind, e.name) for e in ddp.events if e.time >= start)
    ddp.record_events(False)
    grads = [p.grad.clone() for p in ddp.module.parameters()]
    optimizer.step()
    timeline = [((t - start) * 1e3, kind, name) for t, kind, name in events]
    return timeline, ddp.all_reduce_count - before, grads


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 03: gradient buckets.")
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=0.004,
        help="bucket size cap in MiB (default 0.004, about 4 KiB)",
    )
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    args = parser.parse_args()
    env = init_distributed()
    world_size = env.world_size
    cap_bytes = int(args.bucket_cap_mb * 2**20)
    dataset = make_dataset(n=args.batch * world_size * STEPS, dtype=torch.float32)
    # [step, rank, sample, feature]: each rank takes its own slice of every step's global batch.
    x, y = (t.view(STEPS, world_size, args.batch, -1)[:, env.rank] for t in dataset.tensors)
    batches = list(zip(x, y))
    say(f"Chapter 03: bucketing on {world_size} ranks, backend {env.backend}, {env.device}")

    section("1. At construction: one bucket for everything")
    model = build_model()
    ddp = MiniDDP(model, bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    say(
        f"Model: 5 Linear layers, {fmt_bytes(total)} of float32 gradients; bucket cap "
        f"{args.bucket_cap_mb} MiB = {cap_bytes:,} bytes."
    )
    say(ddp.describe_buckets())
    say(
        "Registration order (0.weight first) says little about when gradients are ready: "
        "forward may use\nmodules in any order. So torch does not trust it: step 1 sends "
        "everything as one bucket, after\nthe whole backward, and watches."
    )
    initial_buckets = len(ddp.buckets)

    section("2. Step 1: gradients arrive last layer first")
    optimizer.zero_grad()
    inputs, targets = batches[0]
    events, count, grads = finish_step(ddp, optimizer, ddp(inputs), targets)
    hooks = [name for _, kind, name in events if kind == "hook"]
    say_all_ranks("hook order:", ", ".join(hooks))
    say(
        f"Backward runs the layers in reverse, so 8.* is ready first and 0.* last; {count} "
        "all-reduce was\nlaunched, after the last hook: no overlap yet. MiniDDP noted the order."
    )
    counts, all_grads = [count], [grads]

    section("3. Before the second forward: rebuild from the observed order")
    optimizer.zero_grad()
    inputs, targets = batches[1]
    say(f"has_rebuilt_buckets before step 2's forward: {ddp.has_rebuilt_buckets}")
    output = ddp(inputs)  # the rebuild is the first thing this forward does
    say(f"has_rebuilt_buckets after it: {ddp.has_rebuilt_buckets}")
    say(ddp.describe_buckets())
    say(
        "Bucket 0 now holds the gradients that were ready first, so its all-reduce can start "
        f"earliest.\nA bucket closes with the tensor that takes it to {cap_bytes:,} bytes or more "
        "(a tensor is never split);\nthe last holds what is left. Every rank uses rank 0's "
        "observed order: layouts must match exactly."
    )

    section("4. Step 2: buckets launch while backward is still computing")
    events, count, grads = finish_step(ddp, optimizer, output, targets)
    counts.append(count)
    all_grads.append(grads)
    last_hook = max(ms for ms, kind, _ in events if kind == "hook")
    early = [name for ms, kind, name in events if kind == "launch" and ms < last_hook]
    say(f"Rank 0's timeline, ms since loss.backward() was called:\n{'ms':>8}  {'event':<8}  what")
    for ms, kind, name in events:
        note = "  <- backward still running" if kind == "launch" and name in early else ""
        say(f"{ms:8.3f}  {kind:<8}  {name}{note}")
    summed = [name for ms, kind, name in events if kind == "reduced" and ms < last_hook]
    say_all_ranks(
        f"{len(early)} of {count} buckets launched and {len(summed)} summed before the last hook "
        f"(at {last_hook:.2f} ms); all done at {events[-1][0]:.2f} ms"
    )
    say(
        "A launch is dist.all_reduce(bucket, async_op=True): it returns a handle at once and "
        "gloo's\nthreads do the sending while autograd computes earlier layers. Only the callback "
        "queued\nfor the end of backward waits, bucket by bucket, copying each bucket's averages "
        "into .grad\nwhile the later buckets are still on the wire. How many sums finish "
        "before the last hook\ndepends on the machine: this toy's backward lasts about a "
        "millisecond, and on a CPU the\ngloo threads that add the numbers share the cores with "
        "backward. On GPUs, NCCL's transfers run\nbeside the backward kernels, and a long "
        "backward hides most of them. ('reduced' is stamped from\ngloo's thread once it gets "
        "Python's lock, so it can lag a little; two buckets in flight can\nfinish out of "
        "order.)\n"
        "Buckets launch strictly in index order: a ready bucket waits for all earlier ones. "
        "Collectives\nare matched by their order on every rank, so if one rank launched bucket 1 "
        "first while\nanother launched bucket 0, the sums would mix different buckets or hang."
    )

    section("5. Checked against torch's DistributedDataParallel")
    torch_grads, torch_layout = run_torch_ddp(batches, args.bucket_cap_mb)
    layout = [list(b.param_names) for b in ddp.buckets]
    for index, (ours, theirs) in enumerate(zip(layout, torch_layout, strict=True)):
        say(f"bucket {index}: MiniDDP {ours}\n          torch   {theirs}")
    pairs = [(a, b) for ours, theirs in zip(all_grads, torch_grads) for a, b in zip(ours, theirs)]
    identical = all(torch.equal(a, b) for a, b in pairs)
    gap = max((a - b).abs().max().item() for a, b in pairs)
    say_all_ranks(
        f"gradients of both steps bit-identical to torch's: {identical} "
        f"(max |difference| {gap:.1e})"
    )
    say(
        "Equal bits need the same recipe: each rank multiplies by 1/W while copying into the "
        "bucket, then\ngloo SUMs. With 3 or more ranks gloo's bits also depend on each gradient's "
        f"offset in its\nbucket, so the layout must match too (this run: W = {world_size})."
    )

    section("Bucket size: latency versus overlap")
    sizes = ", ".join(f"bucket {b.index}: {fmt_bytes(b.nbytes)}" for b in ddp.buckets)
    say(
        f"Per step: {counts[1]} all-reduces ({sizes}).\n"
        "- Smaller buckets: more messages, each paying the fixed cost of a round trip, but the "
        "first can\n  start early and most communication hides behind backward.\n"
        "- Bigger buckets: few messages, but the last gradient of a bucket comes late; one "
        "bucket for\n  everything (step 1) overlaps nothing.\n"
        "torch's default, 25 MiB with a 1 MiB first bucket, is a compromise for real models; "
        "chapter 04\nmeasures the trade-off."
    )

    section("Final check")
    assert layout == torch_layout, (layout, torch_layout)
    assert identical, f"gradients differ from torch's DDP by {gap}"
    # With a cap so large that one bucket holds everything, nothing can launch early.
    assert early or len(layout) == 1, "no bucket launched before the last gradient was ready"
    assert counts == [initial_buckets, len(ddp.buckets)] == [1, len(torch_layout)], counts
    dist.barrier()  # every rank has passed its own checks
    say(
        f"Verified on {world_size} ranks: {len(layout)} buckets rebuilt from the "
        f"gradient-ready order, the same layout as torch's DDP, bit-identical gradients, "
        f"{len(early)} launches before backward finished, one all-reduce per bucket per step."
    )
    cleanup()


if __name__ == "__main__":
    main()
