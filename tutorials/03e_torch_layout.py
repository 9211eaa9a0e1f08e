"""Chapter 03e: rung 4 of the ladder, torch's layout: one bucket at first, then buckets in the
order gradients really came.

    torchrun --nproc_per_node=2 tutorials/03e_torch_layout.py [--bucket-cap-mb 0.5] [--diff]
    ./launch.sh tutorials/03e_torch_layout.py     (launch.sh runs chapter 03 by default)

Rung 3 (chapter 03) laid its buckets out once, at construction, on a guess: gradients arrive in
reverse registration order. TorchLayoutDDP (rung 4, miniddp/steps/torch_layout.py) does what
torch's DistributedDataParallel does instead, and this chapter follows one model through its
first two steps, numbered from 0 as the timeline numbers them:

1. at construction, one bucket holds everything;
2. step 0 (torch's iteration 0) records the order in which gradients become ready;
3. before step 1's forward, the buckets are rebuilt from rank 0's order, the first one small;
4. in step 1, buckets launch while backward is still running;
5. torch's DDP on the same model and data: the same layout and bit-identical gradients, at any
   number of ranks.
"""

from __future__ import annotations

import argparse
import textwrap

import torch
import torch.distributed as dist
from common import (
    add_diff_option,
    compare_gradients,
    end_chapter,
    fmt_bytes,
    make_model,
    rung_layout,
    say,
    say_all_ranks,
    say_rung_diff,
    say_rung_layout,
    say_timeline,
    section,
    step_batches,
    train_steps,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp.job.env import init_distributed
from miniddp.observe.events import NO_OBSERVER, Recorder
from miniddp.steps import TorchLayoutDDP

LEARNING_RATE = 0.1
STEPS = 2  # the first with one bucket, the second after the rebuild
BATCH = 16  # samples per rank per step


def build_model() -> nn.Module:
    """Five Linear layers, 8 -> 384 -> 384 -> 384 -> 384 -> 1, in float32: 1.7 MiB of gradients,
    enough for torch's default caps (a 1 MiB first bucket, then 25 MiB) to make two buckets."""
    return make_model(seed=0, in_features=8, hidden=384, depth=5, dtype=torch.float32)


def run_torch_ddp(batches, bucket_cap_mb: float | None) -> tuple[list, list[list[str]]]:
    """The same steps through torch's own DDP; return each step's gradients and its layout."""
    model = build_model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    gradients = train_steps(ddp, batches, LEARNING_RATE)
    name_of = {id(p): n for n, p in model.named_parameters()}
    # _get_zeros_like_grad_buckets() is private, meant for torch's own tests: fine for peeking
    # at the layout here, not something to build on.
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    return gradients, [[name_of[id(p)] for p in bucket.parameters()] for bucket in buckets]


def step(model: TorchLayoutDDP, optimizer, output: torch.Tensor, targets) -> list[torch.Tensor]:
    """Finish a step whose forward already ran: backward, then SGD. Returns the gradients."""
    optimizer.zero_grad()
    nn.functional.mse_loss(output, targets).backward()
    gradients = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    return gradients


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 03e: rung 4, torch's bucket layout.")
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="bucket size cap in MiB for every bucket (default: torch's, 1 MiB first, then 25)",
    )
    add_diff_option(parser)
    args = parser.parse_args()
    env = init_distributed()
    world_size = env.world_size
    batches = step_batches(STEPS, BATCH, world_size, env.rank)
    say(f"Chapter 03e: torch's layout on {world_size} ranks, backend {env.backend}, {env.device}")

    section("1. What rung 4 adds to rung 3")
    say_rung_diff(3, 4, show=args.diff)

    section("2. At construction: one bucket for everything")
    model = TorchLayoutDDP(build_model(), bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    first_cap, cap = model._layout.first_cap, model._layout.cap
    total = sum(p.nbytes for p in model.params)
    say(
        f"Model: 5 Linear layers, {fmt_bytes(total)} of float32 gradients; caps: "
        f"{fmt_bytes(first_cap)} for the first bucket, {fmt_bytes(cap)} for the others."
    )
    say_rung_layout(model)
    say(
        textwrap.dedent("""\
        Rung 3 guessed the order gradients would come in. Torch does not guess, for
        correctness more than speed: where backward issues other collectives too and some
        rank leaves a parameter unused, a bucket launched in a guessed order could meet the
        wrong collective on another rank, one rank's bucket summed with another's broadcast.
        So torch sends everything as one bucket after the first backward, watches the order
        gradients really arrive in, and rebuilds once. Step 0 pays for it: no overlap at all.
        (With find_unused_parameters=True it keeps the guess instead: rung 6,
        miniddp/steps/unused.py.)""")
    )

    section("3. Step 0: gradients arrive last layer first")
    recorder = model.observer = Recorder()
    inputs, targets = batches[0]
    all_gradients = [step(model, optimizer, model(inputs), targets)]
    hooks = [event.name for event in recorder.events if event.kind == "hook"]
    say_all_ranks("hook order:", ", ".join(hooks))
    say(
        textwrap.dedent("""\
        Backward runs the layers in reverse, so 8.* is ready first and 0.* last. The one bucket
        was full only after the last hook, so its all-reduce left as backward ended: no overlap.
        TorchLayoutDDP noted the order.""")
    )

    section("4. Before the second forward: rebuild from the observed order")
    inputs, targets = batches[1]
    say(f"has_rebuilt_buckets before step 1's forward: {model.has_rebuilt_buckets}")
    output = model(inputs)  # the rebuild is the first thing this forward does
    say(f"has_rebuilt_buckets after it: {model.has_rebuilt_buckets}")
    say_rung_layout(model)
    say(
        textwrap.dedent(f"""\
        Bucket 0 now holds the gradients that were ready first, so its all-reduce can start
        earliest, and it is capped small ({fmt_bytes(first_cap)}), so it fills soon after
        backward begins; the others take up to {fmt_bytes(cap)}. A bucket closes with the tensor
        that takes it to its cap or beyond (a tensor is never split); the last holds what is left.
        (An explicit bucket_cap_mb caps every bucket, the first included, as in torch.) Every
        rank uses rank 0's observed order, broadcast once: the layouts must match exactly.""")
    )

    section("5. Step 1: buckets launch while backward is still computing")
    all_gradients.append(step(model, optimizer, output, targets))
    model.observer = NO_OBSERVER
    counts = say_timeline("TorchLayoutDDP", recorder.events, drawn=(0, 1))
    say(
        textwrap.dedent("""\
        Step 0's one bucket (0 in the communication lane) can only start once the last gradient
        is in, as backward ends. Step 1's buckets start in index order, bucket 0 while backward
        still computes the earlier layers. How much of the sum finishes before backward ends
        depends on the machine: on a shared CPU gloo's threads compete with backward; on GPUs
        NCCL's transfers run beside the backward kernels.""")
    )

    section("6. Checked against torch's DistributedDataParallel")
    torch_gradients, torch_layout = run_torch_ddp(batches, args.bucket_cap_mb)
    layout = rung_layout(model)
    for index, (ours, theirs) in enumerate(zip(layout, torch_layout, strict=True)):
        say(f"bucket {index}: TorchLayoutDDP {ours}\n          torch          {theirs}")
    identical, gap = compare_gradients(all_gradients, torch_gradients)
    say(
        f"Gradients of both steps bit-identical to torch's on every rank: {identical} "
        f"(max |difference| {gap:.1e})"
    )
    say(
        textwrap.dedent(f"""\
        Equal bits need the same recipe: each rank multiplies by 1/W while copying into the
        bucket, then gloo SUMs. With 3 or more ranks gloo's bits also depend on each gradient's
        offset in its bucket, so the layout must match too (this run: W = {world_size}).""")
    )

    section("Final check")
    assert layout == torch_layout, (layout, torch_layout)
    assert identical, f"gradients differ from torch's DDP by {gap}"
    buckets = len(layout)
    assert counts == [(1, 0), (buckets, buckets - 1)], counts
    dist.barrier()  # every rank has passed its own checks
    say(
        f"Verified on {world_size} ranks: one bucket in step 0, then {buckets} rebuilt from the "
        f"gradient-ready order, the same layout as torch's DDP, bit-identical gradients; "
        f"{buckets - 1} of {buckets} all-reduces launched before backward's last gradient."
    )
    end_chapter()


if __name__ == "__main__":
    main()
