"""Chapter 02b: rung 2 of the ladder, overlap: each gradient's all-reduce starts the moment
backward has produced it.

    torchrun --nproc_per_node=2 tutorials/02b_overlap.py [--diff]

Chapter 02's NaiveDDP (rung 1) waited for the whole backward, then sent one blocking all-reduce
per gradient. Yet backward makes the gradients one at a time, last layer first, and the network
has nothing to do until the last one exists. OverlapDDP (rung 2, miniddp/steps/overlap.py) puts
a hook on every parameter that launches that gradient's all-reduce without waiting for it, so
the sums travel while backward computes the earlier layers. This chapter:

1. names the code rung 2 changes in rung 1's file (`--diff` prints it: `python -m miniddp.steps
   diff --code 1 2`);
2. runs both rungs on the same model and data and draws their timelines: as many all-reduces
   as before, one per gradient, but now all but the last launched while backward still runs;
3. checks rung 2's claim: the gradients of one process on the global batch, and with 2 ranks
   bit for bit those of torch's DistributedDataParallel.
"""

from __future__ import annotations

import argparse
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
    say_timeline,
    section,
    step_batches,
    train_steps,
)
from torch.nn.parallel import DistributedDataParallel

from miniddp.job.env import init_distributed
from miniddp.observe.events import NO_OBSERVER, Recorder
from miniddp.steps import NaiveDDP, OverlapDDP

STEPS = 3
BATCH = 16  # samples per rank per step
TRAVELS = {NaiveDDP: "gradient", OverlapDDP: "gradient"}  # what one all-reduce carries


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 02b: rung 2, overlap.")
    add_diff_option(parser)
    args = parser.parse_args()
    env = init_distributed()
    world_size = env.world_size
    batches = step_batches(STEPS, BATCH, world_size, env.rank)
    say(f"Chapter 02b: overlap on {world_size} ranks, backend {env.backend}, {env.device}")

    section("1. What rung 2 adds to rung 1")
    say_rung_diff(1, 2, show=args.diff)
    say(
        textwrap.dedent("""\
        The all-reduce moves from the end (finish_gradient_synchronization) into a hook that
        autograd calls as soon as each gradient is accumulated into .grad, with async_op=True: it
        returns a handle at once and gloo's threads do the sending. A callback queued on the
        autograd engine (torch.autograd.Variable._execution_engine.queue_callback(fn): fn runs
        once, when this backward is over) waits for every handle, so .grad is averaged when
        loss.backward() returns, as with torch's DDP.""")
    )

    section("2. The timeline: rung 1, then rung 2")
    counts, gradients = {}, {}
    for rung in (NaiveDDP, OverlapDDP):
        model = rung(ladder_model())
        recorder = model.observer = Recorder()  # notes every step's moments, with their times
        gradients[rung] = train_steps(model, batches)
        model.observer = NO_OBSERVER
        counts[rung] = say_timeline(rung.__name__, recorder.events, travels=TRAVELS[rung])
        say()
    parameters = len(model.params)
    say(
        textwrap.dedent(f"""\
        Both rungs send {parameters} all-reduces per step, one per gradient tensor. NaiveDDP
        launches none of them until backward has ended: the lanes take turns, compute then
        communication. OverlapDDP launches each from its gradient's hook, so all but the last
        leave while backward still computes earlier layers; the last gradient is the first
        layer's, and backward has nothing left to hide its sum behind.

        How much of the communication really hides depends on the machine: this toy's backward
        lasts about a millisecond, and on a CPU gloo's threads share the cores with backward.
        What the timeline does show is the order of launches: gradient-ready order, last layer
        first (the communication lane counts down). Each rank launches in the order its own
        backward produces gradients, and collectives are matched by their order, the k-th
        all-reduce of one rank with the k-th of every other. That is the same order on every
        rank only because every rank runs the same graph: a parameter used on one rank only would
        pair one rank's weight with another rank's bias. Rung 3 (chapter 03) fixes the order.""")
    )

    section("3. Check the claim")
    one_process = train_steps(ladder_model(), step_batches(STEPS, BATCH, world_size, None))
    torch_ddp = train_steps(DistributedDataParallel(ladder_model()), batches)
    one_process_gap, torch_equal, torch_gap = say_claims(
        "OverlapDDP", gradients[OverlapDDP], one_process, torch_ddp
    )
    say(
        textwrap.dedent(f"""\
        Each rank multiplies its gradient by the float 1/W and the all-reduce sums, as torch does.
        With 2 ranks a + b = b + a, so that is torch's bits whatever the packing; with more
        ranks gloo's order of additions depends on each gradient's place in torch's buckets,
        which only rung 4 (chapter 03e) copies (this run: W = {world_size}).""")
    )

    assert all(c == (parameters, 0) for c in counts[NaiveDDP]), counts[NaiveDDP]
    assert all(c == (parameters, parameters - 1) for c in counts[OverlapDDP]), counts[OverlapDDP]
    exact = check_claims(one_process_gap, torch_equal, torch_gap, world_size, LADDER_TOLERANCE)
    dist.barrier()  # every rank has passed its own checks
    say(
        f"Verified on {world_size} ranks: OverlapDDP sends {parameters} all-reduces per step like "
        f"NaiveDDP, {parameters - 1} of them launched before backward's last gradient (NaiveDDP: "
        f"0); its gradients are one process's within {LADDER_TOLERANCE:.0e} and {exact} "
        "torch's DDP."
    )
    end_chapter()


if __name__ == "__main__":
    main()
