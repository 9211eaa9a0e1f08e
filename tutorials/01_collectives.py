"""Chapter 01: the collectives DDP relies on, built from nothing but send and receive.

    torchrun --nproc_per_node=4 tutorials/01_collectives.py [--numel 8] [--sizes 4K,256K,4M,16M]
    torchrun --nproc_per_node=2 tutorials/01_collectives.py

DDP needs two collectives: a *broadcast* (rank 0's weights to everyone, at construction) and an
*all-reduce* (every rank's gradients summed, every step). torch.distributed hands them to gloo or
NCCL; `miniddp/collectives/` builds them, with the same arguments, from point-to-point messages
(`dist.isend` / `dist.irecv`) so that each step can be watched. The chapter, in order:

1. broadcast: the root sends to everyone (W-1 steps), or everyone who has it sends (a tree);
2. reduce: the same two shapes, run backwards, adding as the data arrives;
3. all-reduce: a tree reduce then a tree broadcast, recursive doubling, or a ring (reduce-scatter,
   then all-gather);
4. steps and bytes of each, counted message by message: why the ring is bandwidth-optimal;
5. async: a handle returned at once, collectives finishing in the order they were issued;
6. the alpha-beta cost model, fitted on this machine, and a small measured sweep against gloo.

Every result is checked against torch.distributed's own collective.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import textwrap
from collections.abc import Callable

import torch
import torch.distributed as dist
from common import (
    add_plot_option,
    end_chapter,
    fmt_bytes,
    say,
    say_prose,
    section,
)

from miniddp import collectives
from miniddp.collectives import Message
from miniddp.instruments.bench.collectives import parse_size, time_size
from miniddp.instruments.figures import draw
from miniddp.job.env import init_distributed

SWEEP_ROUNDS = 5  # interleaved rounds per size: enough for a first look, not a benchmark
COUNTING_NUMEL = 2**18  # about 1 MiB of float32 for the byte counts


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def gather_messages(log: list[Message]) -> list[Message]:
    """Every rank's log of the messages it sent, merged, in step order. Every rank must call."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, log)
    return sorted(itertools.chain(*everyone), key=lambda m: (m.step, m.src))


def show_steps(messages: list[Message]) -> None:
    """One line a step; a kind every message of the step shares, "(partial)", said once."""
    for step, in_step in itertools.groupby(messages, key=lambda m: m.step):
        in_step = list(in_step)
        kinds = {m.what.partition(" (")[2] for m in in_step}
        shared = kinds.pop() if len(kinds) == 1 else ""  # "partial)": the ")" comes along
        whats = [m.what.partition(" (")[0] if shared else m.what for m in in_step]
        line = ", ".join(f"{m.src}->{m.dst} {what}" for m, what in zip(in_step, whats))
        line = f"step {step}: {line}" + (f" ({shared}" if shared else "")
        say(textwrap.fill(line, 96, initial_indent="    ", subsequent_indent=" " * 12))


WATCHED: dict[str, list[Message]] = {}  # every watched collective's messages, in order


def watch(collective: Callable[..., None], *args, algorithm: str, **kwargs) -> list[Message]:
    """Run one collective while logging its messages, then print them step by step."""
    with collectives.record_messages() as log:
        collective(*args, algorithm=algorithm, **kwargs)
    messages = gather_messages(log)
    WATCHED[f"{collective.__name__}, {algorithm}"] = messages  # for --plot
    steps = max((m.step for m in messages), default=0)
    say(f"  {algorithm}: {plural(steps, 'step')}, {plural(len(messages), 'message')}")
    show_steps(messages)
    return messages


def same_as_torch(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """True on every rank only if it holds on every rank."""
    agree = torch.tensor([int(torch.equal(ours, theirs))])
    dist.all_reduce(agree, op=dist.ReduceOp.MIN)
    return bool(agree.item())


def section_broadcast(rank: int, numel: int, world_size: int) -> bool:
    section("1. Broadcast: one rank's tensor to every rank")
    source = torch.arange(1, numel + 1)
    say(f"Rank 0 holds {source.tolist()}; the others hold zeros. After the broadcast, all hold it.")
    verified = True
    for algorithm in collectives.BROADCAST_ALGORITHMS:
        tensor = source.clone() if rank == 0 else torch.zeros(numel, dtype=torch.int64)
        watch(collectives.broadcast, tensor, src=0, algorithm=algorithm)
        verified &= same_as_torch(tensor, source)
    say(
        textwrap.dedent("""\
        Naive: the root sends W-1 times in a row while everyone else waits. Tree: whoever has the
        tensor sends it on, so the number of holders doubles each step: 1, 2, 4, ... ranks,
        ceil(log2 W) steps. Same bytes per receiver, fewer steps: that is all a tree buys.""")
    )
    if world_size < 4:
        say(
            f"With {world_size} ranks the tree has no second level and looks like naive: run "
            "this chapter on 4\n(torchrun --nproc_per_node=4, or NPROC=4 ./launch.sh) to see "
            "it branch."
        )
    return verified


def section_reduce(rank: int, numel: int, world_size: int) -> bool:
    section("2. Reduce: every rank's tensor, summed, on one rank")
    mine = torch.arange(numel) + 100 * (rank + 1)
    say(f"Rank r holds [0, 1, ..., {numel - 1}] + 100 (r + 1): rank 0 holds {mine.tolist()}")
    expected = mine.clone()
    dist.reduce(expected, dst=0)
    verified = True
    for algorithm in collectives.REDUCE_ALGORITHMS:
        tensor = mine.clone()
        watch(collectives.reduce, tensor, dst=0, algorithm=algorithm)
        if rank == 0:
            say(f"    rank 0 now holds {tensor.tolist()}")
        verified &= same_as_torch(tensor, expected if rank == 0 else mine)
    say(
        textwrap.dedent("""\
        The tree is the broadcast tree run backwards: at each step the upper half of the ranks
        still holding a partial sum send it to the lower half, which add it to theirs. Only the
        root's tensor changes: the others keep their input (gloo's own reduce uses them as
        scratch space).""")
    )
    return verified


def section_all_reduce(rank: int, numel: int, world_size: int) -> bool:
    section("3. All-reduce: the sum on every rank")
    mine = torch.arange(numel) + 100 * (rank + 1)
    expected = mine.clone()
    dist.all_reduce(expected)
    say(f"From section 2's tensors, all ranks should end with {expected.tolist()}")
    verified = True
    for algorithm in ("reduce_broadcast", "recursive_doubling", "ring"):
        tensor = mine.clone()
        watch(collectives.all_reduce, tensor, algorithm=algorithm)
        verified &= same_as_torch(tensor, expected)
    say(
        textwrap.dedent("""\
        reduce_broadcast is section 2's tree, then section 1's: 2 ceil(log2 W) steps. Recursive
        doubling does it in half: at step k every rank swaps its partial sum with the rank whose
        number differs in bit k, and both add (ranks beyond a power of two first hand theirs over,
        and get the result back at the end). Both move the whole tensor at every step: fine for a
        few bytes, wasteful for many.
        The ring cuts the tensor into W chunks and passes them round 0 -> 1 -> ... -> W-1 -> 0. In
        the first W-1 steps (reduce-scatter) each chunk travels round once, each rank adding its
        own values, and ends complete on one rank: chunk r on rank r. In the last W-1 steps
        (all-gather) the complete chunks travel round once more, overwriting. Every rank sends
        one chunk per step, all at once.""")
    )
    say("\nThe same ring as two separate collectives, to see the halfway point:")
    chunk = torch.zeros(numel // world_size, dtype=torch.int64)
    if numel % world_size == 0:
        collectives.reduce_scatter_tensor(chunk, mine)
        chunks = [None] * world_size
        dist.all_gather_object(chunks, chunk.tolist())
        listed = " ".join(str(c) for c in chunks)
        say(textwrap.fill(f"reduce_scatter leaves chunk r on rank r: {listed}", 96))
        gathered = torch.zeros(numel, dtype=torch.int64)
        collectives.all_gather_into_tensor(gathered, chunk)
        verified &= same_as_torch(gathered, expected)
        say(f"after all_gather every rank holds {gathered.tolist()} (checked)")
    else:
        say(f"(skipped: {numel} elements do not split into {world_size} equal chunks)")
    return verified


def section_counting(world_size: int) -> tuple[bool, dict]:
    section("4. Steps and bytes, counted")
    numel = -(-COUNTING_NUMEL // world_size) * world_size  # W equal ring chunks, at any W
    nbytes = numel * 4
    say_prose(f"""\
        Each algorithm once more on a {fmt_bytes(nbytes)} float32 tensor, W = {world_size}, with
        `collectives.traffic` counting every byte each rank sends. 'steps carry' is what
        `collectives.schedule` says the steps move one after another (the critical path: what
        the cost model charges beta for).""")
    say(
        f"\n  {'collective':<11} {'algorithm':<18} {'steps':>5} {'busiest rank sends':>19} "
        f"{'all ranks send':>15} {'steps carry':>12}"
    )
    cases = [
        ("broadcast", "naive", lambda t, a: collectives.broadcast(t, 0, algorithm=a)),
        ("broadcast", "tree", lambda t, a: collectives.broadcast(t, 0, algorithm=a)),
        ("reduce", "naive", lambda t, a: collectives.reduce(t, 0, algorithm=a)),
        ("reduce", "tree", lambda t, a: collectives.reduce(t, 0, algorithm=a)),
        ("all_reduce", "reduce_broadcast", lambda t, a: collectives.all_reduce(t, algorithm=a)),
        ("all_reduce", "recursive_doubling", lambda t, a: collectives.all_reduce(t, algorithm=a)),
        ("all_reduce", "ring", lambda t, a: collectives.all_reduce(t, algorithm=a)),
    ]
    consistent, busiest = True, {}
    for collective, algorithm, run in cases:
        tensor = torch.ones(numel)
        collectives.traffic.reset()
        with collectives.record_messages() as log:
            run(tensor, algorithm)
        sent = [None] * world_size
        dist.all_gather_object(sent, collectives.traffic.bytes_sent)
        steps = max((m.step for m in gather_messages(log)), default=0)
        model_steps, model_bytes = collectives.schedule(collective, algorithm, nbytes, world_size)
        consistent &= steps == model_steps
        busiest[(collective, algorithm)] = max(sent)
        say(
            f"  {collective:<11} {algorithm:<18} {steps:>5} {fmt_bytes(max(sent)):>19} "
            f"{fmt_bytes(sum(sent)):>15} {fmt_bytes(model_bytes):>12}"
        )
    ring = busiest[("all_reduce", "ring")]
    lower_bound = 2 * (world_size - 1) * nbytes // world_size
    tree = busiest[("all_reduce", "reduce_broadcast")]
    doubling = busiest[("all_reduce", "recursive_doubling")]
    say()
    say_prose(f"""\
        The ring's busiest rank sends {fmt_bytes(ring)} = 2(W-1)/W x {fmt_bytes(nbytes)}: the least
        any all-reduce can send per rank when only the ranks add (Patarasuk and Yuan, 2009). Why,
        one element at a time: join two ranks by an edge whenever one sends the other a value of
        that element. A rank can hold the full sum only once its piece of the graph reaches all W
        ranks, W-1 messages; the W-1 others, still lacking the sum then, each need one more. So
        an element costs 2(W-1) messages, n elements 2(W-1) n, and some rank sends at least a
        W-th: 2(W-1)/W n, which does not grow with W: why gloo and NCCL use rings for large
        tensors (switches that add, such as SHARP, break the premise). reduce_broadcast's
        busiest rank sends {fmt_bytes(tree)}, recursive doubling's {fmt_bytes(doubling)}: log2 W
        whole tensors. At W = 2 all three send n, and the ring's only edge is that each rank adds
        up half the tensor.""")
    consistent &= ring == lower_bound
    return consistent, busiest


def section_async(rank: int) -> bool:
    section("5. Async: keep computing while the messages travel")
    tensors = [torch.full((1000,), float(rank + i)) for i in range(4)]
    finished: list[int] = []
    works = [collectives.all_reduce(t, algorithm="ring", async_op=True) for t in tensors]
    noted = [
        work.get_future().then(lambda _, i=i: finished.append(i)) for i, work in enumerate(works)
    ]
    busy = torch.randn(200, 200) @ torch.randn(200, 200)  # the caller's own work, meanwhile
    for work in reversed(works):  # wait in any order: they still finish in issue order
        work.wait()
    torch.futures.wait_all(noted)
    orders = [None] * dist.get_world_size()
    dist.all_gather_object(orders, finished)
    every = "" if all(order == finished for order in orders) else f" (by rank: {orders})"
    say(
        f"Each rank: 4 all-reduces issued, a {len(busy)}x{len(busy)} matmul done meanwhile, "
        f"finished in order {finished}{every}"
    )
    say(
        textwrap.dedent("""\
        `async_op=True` queues the collective on one communication thread per process and returns
        a Work (wait(), get_future()) at once, like torch.distributed; NCCL does it with a CUDA
        stream. In order matters: messages carry no collective id, so the k-th collective's
        messages find its receives only because every rank runs them in the same order.""")
    )
    world_size = dist.get_world_size()
    sums = [sum(range(world_size)) + world_size * i for i in range(4)]  # rank + i, over ranks
    right = all(torch.equal(t, torch.full((1000,), float(s))) for t, s in zip(tensors, sums))
    return finished == [0, 1, 2, 3] and right


# Our all-reduces, by the short names the tables use.
ALL_REDUCES = {"tree": "reduce_broadcast", "doubling": "recursive_doubling", "ring": "ring"}
ALL_REDUCES_BY_NAME = {algorithm: short for short, algorithm in ALL_REDUCES.items()}


def time_interleaved(nbytes: int, rounds: int) -> dict[str, list[float]]:
    """The bench's rounds (each runs gloo, ours and auto in a rotating order; the slowest
    rank's seconds), sorted, under the chapter's short names."""
    times = time_size(nbytes, rounds)
    return {ALL_REDUCES_BY_NAME.get(name, name): sorted(t) for name, t in times.items()}


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f}us"


def section_cost_model(world_size: int, sizes: list[int]) -> collectives.CostModel:
    section("6. The alpha-beta cost model, and a measured sweep")
    model = collectives.fit_cost_model()
    gigabytes_per_second = 1 / model.beta / 1e9 if model.beta else float("inf")
    say_prose(f"""\
        A message of n bytes takes about alpha + n * beta. Ranks 0 and 1 just timed ping-pongs
        of 8 B to 4 MiB (the quickest of 30 each): alpha = {model.alpha * 1e6:.0f} us per message,
        1/beta = {gigabytes_per_second:.2f} GB/s.
        An algorithm of S steps that carry B bytes in all takes S alpha + B beta
        (tree = reduce_broadcast, doubling = recursive_doubling):""")
    say(f"\n  {'size':>9}  {'W':>3}  {'tree':>9}  {'doubling':>9}  {'ring':>9}  fastest")
    for nbytes, w in itertools.product((4096, 2**20, 64 * 2**20), sorted({world_size, 64})):
        predicted = {
            short: model.predict("all_reduce", algorithm, nbytes, w)
            for short, algorithm in ALL_REDUCES.items()
        }
        times = "  ".join(f"{us(t):>9}" for t in predicted.values())
        say(f"  {fmt_bytes(nbytes):>9}  {w:>3}  {times}  {min(predicted, key=predicted.get)}")
    say_prose(f"""\
        Latency favours doubling (log2 W steps), bandwidth the ring (2(W-1)/W of the tensor per
        rank). Now measured: {SWEEP_ROUNDS} rounds per size, each running all five in a rotating
        order; medians of the slowest rank's time, the model's prediction below, auto's pick in
        brackets.""")
    names = ["gloo", *ALL_REDUCES, "auto"]
    say(f"\n  {'size':>9}  {'':8}  " + "  ".join(f"{name:>9}" for name in names))
    sweep = {}
    for nbytes in sizes:
        rounds = sweep[nbytes] = time_interleaved(nbytes, SWEEP_ROUNDS)
        measured = {name: statistics.median(times) for name, times in rounds.items()}
        say(
            f"  {fmt_bytes(nbytes):>9}  measured  "
            + "  ".join(f"{us(measured[name]):>9}" for name in names)
            + f"  ({collectives.choose_all_reduce_algorithm(nbytes, world_size)})"
        )
        predicted = [
            us(model.predict("all_reduce", algorithm, nbytes, world_size))
            for algorithm in ALL_REDUCES.values()
        ]
        say(f"  {'':9}  {'model':8}  {'':9}  " + "  ".join(f"{p:>9}" for p in predicted))
    explain_the_gaps(model, world_size, sweep)
    return model


def explain_the_gaps(
    model: collectives.CostModel, world_size: int, sweep: dict[int, dict[str, list[float]]]
) -> None:
    """Why the sweep is slower than the model at small sizes, and why auto's picks are neither
    the model's nor this sweep's, with this run's numbers."""

    def predicted(algorithm: str, nbytes: int) -> float:
        return model.predict("all_reduce", ALL_REDUCES[algorithm], nbytes, world_size)

    smallest, largest = min(sweep), max(sweep)
    gloo = sweep[smallest]["gloo"]
    worst = {n: max(predicted(a, n) for a in ALL_REDUCES) for n in (smallest, largest)}
    ratio_small = statistics.median(gloo) / worst[smallest]
    ratio_large = statistics.median(sweep[largest]["gloo"]) / worst[largest]
    say()
    say_prose(f"""\
        Why the sweep is far above the model at small sizes (gloo {ratio_small:.1f}x the model at
        {fmt_bytes(smallest)}, {ratio_large:.1f}x at {fmt_bytes(largest)}): costs fixed per step
        that it leaves out (the barrier releasing ranks apart, gloo's threads waking, our Python
        posting each message), and noise: the median of {SWEEP_ROUNDS} rounds with
        {os.getloadavg()[0]:.1f} runnable processes for {os.cpu_count()} cores (gloo's quickest
        round {us(gloo[0])}, its slowest {us(gloo[-1])}), against the quickest of 30 ping-pongs.""")
    picks = {
        n: ALL_REDUCES_BY_NAME[collectives.choose_all_reduce_algorithm(n, world_size)]
        for n in sweep
    }
    with_model = sum(
        picks[n] == min(ALL_REDUCES, key=lambda a, n=n: predicted(a, n)) for n in sweep
    )
    with_sweep = sum(
        picks[n] == min(ALL_REDUCES, key=lambda a, n=n: statistics.median(sweep[n][a]))
        for n in sweep
    )
    say_prose(f"""\
        `auto` agreed with the model at {with_model} of {len(sweep)} sizes and with this sweep
        at {with_sweep}: it follows AUTO_CHOICES (miniddp/collectives/cost_model.py), crossovers
        measured over many rounds on an idle machine with `python -m miniddp.bench collectives`.
        A few rounds on a busy machine cannot rank algorithms this close: measure yours so.""")


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 01: collectives from send/recv.")
    parser.add_argument("--numel", type=int, default=8, help="elements in the step-by-step demos")
    parser.add_argument(
        "--sizes", default="4K,256K,4M,16M", help="all-reduce sizes for the measured sweep"
    )
    add_plot_option(parser)
    args = parser.parse_args()
    env = init_distributed()
    rank, world_size = env.rank, env.world_size
    say(f"Chapter 01: collectives from send/recv on {world_size} ranks, backend {env.backend}")
    say("In the step listings 'a->b' means rank a sends to rank b; a step's messages go at once.")

    checks = {
        "broadcast": section_broadcast(rank, args.numel, world_size),
        "reduce": section_reduce(rank, args.numel, world_size),
        "all_reduce": section_all_reduce(rank, args.numel, world_size),
    }
    checks["counted steps and bytes"], busiest = section_counting(world_size)
    checks["async in issue order"] = section_async(rank)
    model = section_cost_model(world_size, [parse_size(s) for s in args.sizes.split(",")])

    if args.plot and rank == 0:
        drawn = draw.messages(WATCHED, world_size, args.plot / "01_messages.png")
        say(f"\nEvery watched collective, drawn: {drawn}")

    section("Final check")
    failed = [name for name, passed in checks.items() if not passed]
    assert not failed, f"these claims failed: {', '.join(failed)}"
    ring = busiest[("all_reduce", "ring")]
    assert all(ring <= sent for key, sent in busiest.items() if key[0] == "all_reduce")
    assert model.alpha > 0 and model.beta > 0, model
    dist.barrier()
    say_prose(f"""\
        Verified on {world_size} ranks: every algorithm equals torch.distributed's result, the
        counted steps match the schedule, the ring sends the fewest bytes per rank, and async
        collectives finish in issue order.""")
    end_chapter()


if __name__ == "__main__":
    main()
