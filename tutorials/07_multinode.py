"""Chapter 07: several machines. Who is who, and what the link between them costs.

    ./launch.sh --emulate-nodes 2 tutorials/07_multinode.py                      two "nodes" here
    ./launch.sh --emulate-nodes 2 --link-rate 100mbit tutorials/07_multinode.py  on a slow link
    torchrun --nproc_per_node=2 tutorials/07_multinode.py --link alpha=200us,bandwidth=100mbit
                                                  a simulated slow link: no root needed
    torchrun --nproc_per_node=2 tutorials/07_multinode.py                        one node
    NNODES=2 NODE_RANK=0 MASTER_ADDR=<node 0> ./launch.sh tutorials/07_multinode.py   real machines
                                                                  (then NODE_RANK=1 on node 1)

Nothing in MiniDDP changes between one machine and many: a rank is a rank, and gloo (or NCCL)
connects every pair of ranks wherever they run. Two things do change. torchrun gives each
process more names, one per level (job, node, process on the node). And part of the traffic
now crosses a link between machines, slower than anything inside one: that is where bucketing
and overlap earn their keep. This chapter:

1. prints every process's names and the address it talks from, and explains them;
2. trains a few steps across the nodes and checks that all replicas stay identical;
3. times a step for several bucket sizes, and shows with the timeline how much of the
   communication hides behind backward.

`./launch.sh --emulate-nodes 2` runs two torchrun agents, one per "node", that meet through c10d
rendezvous like on a cluster; as root each node gets a network namespace of its own, joined by
a virtual cable (a veth pair), which `--link-rate` slows down.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from common import (
    add_link_option,
    fmt_bytes,
    make_dataset,
    make_model,
    say,
    say_all_ranks,
    say_prose,
    section,
)
from torch import nn
from torch.utils.data import DataLoader

from miniddp import MiniDDP
from miniddp.data_parallel.sampler import DistributedSampler
from miniddp.instruments.link_group import simulated_link
from miniddp.instruments.timeline_views import ascii_timeline
from miniddp.job.env import DistEnv, cleanup, init_distributed
from miniddp.observe.timeline import recording, split_steps, summarize

TRAIN_STEPS = 4
LEARNING_RATE = 0.1
# Bucket caps to compare, in MiB: one bucket for everything (nothing can overlap), torch's
# default (1 MiB first, then 25 MiB), and smaller ones. At the default width each hidden layer's
# weight is 64 KiB, so 1/16 MiB gives one bucket per layer: a tensor is never split.
BUCKET_CAPS: dict[str, float | None] = {
    "one bucket": 1000.0,
    "torch default": None,
    "1/8 MiB": 1 / 8,
    "1/16 MiB": 1 / 16,
}
WARMUP_STEPS = 2  # step 1 runs with one bucket; the buckets are rebuilt before step 2
TIMED_STEPS = 5


def address_towards(host: str, port: int) -> str:
    """The local address this process uses to reach `host`: a UDP socket "connected" there makes
    the kernel choose the route and source address. Nothing is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def whereabouts(env: DistEnv) -> dict[str, object]:
    """What torchrun told this process about its place in the job, and where it talks from."""
    return {
        "RANK": env.rank,
        "LOCAL_RANK": env.local_rank,
        "GROUP_RANK": env.node_rank,
        "WORLD_SIZE": env.world_size,
        "LOCAL_WORLD_SIZE": env.local_world_size,
        "address": address_towards(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
        "interface": os.environ.get("GLOO_SOCKET_IFNAME", "(hostname's)"),
    }


def replica_digest(model: nn.Module) -> str:
    """A fingerprint of every parameter's exact bits: equal digests mean identical replicas."""
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(bytes(param.detach().cpu().contiguous().view(torch.uint8).flatten()))
    return digest.hexdigest()[:16]


def replicas_identical(model: nn.Module) -> bool:
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, replica_digest(model))
    return len(set(digests)) == 1


def show_who_is_who(env: DistEnv) -> list[dict[str, object]]:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, whereabouts(env))
    columns = list(everyone[0])
    widths = [max(len(c), *(len(str(row[c])) for row in everyone)) for c in columns]
    say("  ".join(f"{c:>{w}}" for c, w in zip(columns, widths)))
    for row in everyone:
        say("  ".join(f"{str(row[c]):>{w}}" for c, w in zip(columns, widths)))
    return everyone


def explain_names(everyone: list[dict[str, object]]) -> None:
    nodes = sorted({row["GROUP_RANK"] for row in everyone})
    per_node = everyone[0]["LOCAL_WORLD_SIZE"]
    say(
        f"RANK             the process's number in the whole job, 0..{len(everyone) - 1}. Data "
        "sharding uses it\n                 (DistributedSampler), and rank 0 alone prints.\n"
        f"LOCAL_RANK       its number on its node, 0..{per_node - 1}: it picks the GPU, "
        "cuda:LOCAL_RANK. Every node\n                 has a LOCAL_RANK 0.\n"
        f"GROUP_RANK       which node, 0..{len(nodes) - 1}: the node rank (--node_rank, or "
        "the order the rendezvous\n                 gave).\n"
        f"WORLD_SIZE       processes in the job: {len(nodes)} node(s) x {per_node} = "
        f"{len(everyone)}. Gradients are averaged over all.\n"
        f"LOCAL_WORLD_SIZE processes on this node, {per_node}: they share its memory, cores "
        "and network card.\n"
        "With the same number of processes on every node, "
        "RANK = GROUP_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK."
    )
    addresses = {row["GROUP_RANK"]: row["address"] for row in everyone}
    if len(nodes) == 1:
        say(
            "\nAll of these processes are on one node (GROUP_RANK 0 everywhere), so RANK equals "
            "LOCAL_RANK and\nno byte leaves the machine. To see two nodes on this machine, each "
            "with its own address:\n"
            "    ./launch.sh --emulate-nodes 2 tutorials/07_multinode.py\n"
            "and to feel a slow link between them, add --link-rate 100mbit."
        )
    elif len(set(addresses.values())) == 1:
        say()
        say_prose(f"""\
            The nodes share one address, {addresses[0]}: this is the loopback emulation (no
            network namespaces here), so traffic between nodes is as fast as inside one.""")
    else:
        say()
        say_prose(f"""\
            Each node talks from its own address. Processes on one node reach each other inside
            it; the pairs split across nodes cross the link between them, and gloo connects
            every pair (a full mesh), so here {_cross_pairs(everyone)} of the
            {_pairs(len(everyone))} pairs cross that link.""")


def _pairs(n: int) -> int:
    return n * (n - 1) // 2


def _cross_pairs(everyone: list[dict[str, object]]) -> int:
    per_node: dict[object, int] = {}
    for row in everyone:
        per_node[row["GROUP_RANK"]] = per_node.get(row["GROUP_RANK"], 0) + 1
    return _pairs(len(everyone)) - sum(_pairs(n) for n in per_node.values())


def train_briefly(env: DistEnv) -> MiniDDP:
    """A few steps of ordinary data-parallel training, each rank on its own shard."""
    dataset = make_dataset(n=64 * env.world_size, dtype=torch.float32)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)
    model = MiniDDP(make_model(seed=0, dtype=torch.float32))
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    for step, (inputs, targets) in zip(range(TRAIN_STEPS), loader):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses = [None] * dist.get_world_size()
        dist.all_gather_object(losses, loss.item())
        say(f"step {step + 1}: loss on each rank's shard {', '.join(f'{x:.4f}' for x in losses)}")
    return model


@dataclass
class Timed:
    """One bucket cap's model and rank 0's view of its timed steps."""

    model: MiniDDP
    optimizer: torch.optim.Optimizer
    events: list = field(default_factory=list)

    @property
    def steps(self) -> list:
        return split_steps(self.events)

    @property
    def summaries(self) -> list:
        return [summarize(step) for step in self.steps]


def time_bucket_caps(env: DistEnv, hidden: int, batch: int) -> dict[str, Timed]:
    """Train one model per bucket cap on the same data, recording the steps after warm-up.

    The models take turns step by step, so a burst of noise from whatever else runs on this
    machine hits them all alike instead of spoiling one.
    """
    runs = {}
    for label, cap in BUCKET_CAPS.items():
        net = make_model(seed=1, in_features=hidden, hidden=hidden, depth=6, dtype=torch.float32)
        model = MiniDDP(net, bucket_cap_mb=cap)
        runs[label] = Timed(model, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE))
    for step in range(WARMUP_STEPS + TIMED_STEPS):
        # Random data is enough to time a step; each rank draws its own.
        generator = torch.Generator().manual_seed(1000 * step + env.rank)
        x = torch.randn(batch, hidden, generator=generator)
        y = torch.randn(batch, 1, generator=generator)
        for run in runs.values():
            run.optimizer.zero_grad()
            if step < WARMUP_STEPS:
                nn.functional.mse_loss(run.model(x), y).backward()
            else:
                with recording(run.model, profiler_spans=False) as recorded:
                    nn.functional.mse_loss(run.model(x), y).backward()
                run.events += recorded
            run.optimizer.step()
    return runs


def show_bucket_caps(results: dict[str, Timed]) -> None:
    say(f"Milliseconds, rank 0, median of {TIMED_STEPS} steps:")
    header = f"{'bucket cap':<14} {'buckets':>7} {'step':>9} {'backward':>9} {'comm':>9}"
    say(f"{header} {'hidden':>9} {'exposed':>9}")
    fields = ("step_s", "backward_s", "comm_s", "overlapped_s", "exposed_s")
    for label, run in results.items():
        times = " ".join(f"{median_ms(run.summaries, field):9.1f}" for field in fields)
        say(f"{label:<14} {len(run.model.buckets):>7} {times}")
    say(
        "step: forward start to gradients averaged. comm: time with an all-reduce in flight. "
        "hidden: of that,\nwhile backward was still computing. exposed: after backward had "
        "ended, when nothing is left to\nhide it behind and the step just waits. On a shared "
        "CPU the numbers move by several ms from\nrun to run; the models take turns, step by "
        "step, so that noise hits them all alike."
    )
    for label in (next(iter(results)), list(results)[-1]):
        run = results[label]
        say(f"\nRank 0's last timed step, {label} ({len(run.model.buckets)} buckets):")
        say(ascii_timeline(run.steps[-1:]))


def median_ms(summaries, field: str) -> float:
    return statistics.median(getattr(summary, field) for summary in summaries) * 1e3


def explain_bucket_caps(results: dict[str, Timed], link_rate: str) -> None:
    one = results["one bucket"].summaries
    small = results[list(results)[-1]].summaries
    backward = median_ms(one, "backward_s")
    comm = median_ms(one, "comm_s")
    change = median_ms(small, "step_s") - median_ms(one, "step_s")
    say()
    if not link_rate:
        say_prose(f"""\
            Nothing slows this link: the one bucket's all-reduce took {comm:.0f} ms against
            backward's {backward:.0f} ms, and the step changed by {change:+.0f} ms from one
            bucket to the smallest cap, which is noise as much as anything. There is little to
            hide here; the story of hiding needs a link that costs something (run with
            --link-rate or --link, below).""")
        return
    say_prose(f"""\
        With one bucket the whole all-reduce starts after backward: on this {link_rate} link it
        takes {comm:.0f} ms, backward {backward:.0f} ms, and the step pays both. Smaller buckets
        start sending while backward still computes the earlier layers, so part of the
        communication hides behind it (here the step changed by {change:+.0f} ms from one bucket
        to the smallest cap). Overlap can hide at most backward's own duration: when communication
        takes longer, the rest stays exposed whatever the bucket size, and very small buckets
        add a fixed cost per message on top (chapter 04 measures that trade-off on one
        machine).""")
    if len(results["torch default"].model.buckets) == 1:
        say(
            "torch's default caps the first bucket at 1 MiB and every later one at 25 MiB: this "
            "whole model fits\nin the first, so it gets one bucket too. Real models are far "
            "bigger than 1 MiB."
        )
    if link_rate:
        say(
            "On a slow link the cure is sending less: more samples per step (fewer steps per "
            "epoch),\naccumulating micro-batches under no_sync() (chapter 05), or compressing "
            "gradients with a comm hook."
        )
    else:
        say(
            "Nothing slows this link down, so communication is cheap. To feel a slow "
            "interconnect, run\n    ./launch.sh --emulate-nodes 2 --link-rate 100mbit "
            "tutorials/07_multinode.py\nor, without root, over a simulated link "
            "(miniddp/observe/link.py):"
            "\n    torchrun --nproc_per_node=2 tutorials/07_multinode.py "
            "--link alpha=200us,bandwidth=100mbit"
        )


def launched_during_backward(steps) -> bool:
    """Did some bucket start its all-reduce before backward ended? (Not a timing claim: a bucket
    launches from a gradient hook, so with several buckets the first always does.)"""
    return any(
        bucket.start < step.span("backward").end for step in steps for bucket in step.buckets
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 07: several nodes.")
    # Defaults chosen so that on a 100mbit link backward and communication take similar times,
    # where overlap matters most: a wider model sends more, a bigger batch computes longer.
    parser.add_argument("--hidden", type=int, default=128, help="width of the timed model")
    parser.add_argument("--batch", type=int, default=4096, help="samples per rank per timed step")
    add_link_option(parser)
    args = parser.parse_args()
    env = init_distributed()
    link_rate = os.environ.get("MINIDDP_LINK_RATE", "")
    if args.link is not None:  # no root needed: every collective waits as this link would
        link_rate = f"simulated {args.link}"
    say(f"Chapter 07: {env.world_size} ranks, backend {env.backend}, {env.device}")

    section("1. Who is who")
    everyone = show_who_is_who(env)
    say(
        "address: where this process talks from, towards MASTER_ADDR. interface: the one gloo "
        "was told to\nuse (GLOO_SOCKET_IFNAME); without it, gloo takes the address the "
        "hostname resolves to.\n"
    )
    explain_names(everyone)

    section("2. Training across the nodes")
    model = train_briefly(env)
    say_all_ranks(f"parameters' sha256: {replica_digest(model)}")
    trained_identical = replicas_identical(model)
    say(
        "Each rank trained on its own shard, yet every replica holds the same bits: each "
        "step averaged\nthe gradients over all ranks on all nodes before the update."
    )

    section("3. Bucket size and overlap on the link between nodes")
    with simulated_link(args.link):
        results = time_bucket_caps(env, args.hidden, args.batch)
    timed_model = results["one bucket"].model
    nbytes = sum(p.numel() * p.element_size() for p in timed_model.parameters())
    say_prose(f"""\
        A 6-layer MLP {args.hidden} wide: {fmt_bytes(nbytes)} of float32 gradients per step,
        {args.batch} samples per rank.""")
    say(
        f"The link: capped at {link_rate}."
        if link_rate
        else "The link: as fast as this machine moves bytes."
    )
    show_bucket_caps(results)
    explain_bucket_caps(results, link_rate)

    section("Final check")
    rows_ok = all(
        row["RANK"] == row["GROUP_RANK"] * row["LOCAL_WORLD_SIZE"] + row["LOCAL_RANK"]
        for row in everyone
    )
    assert rows_ok, "RANK != GROUP_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK"
    assert trained_identical, "the replicas differ after training"
    timed_identical = all(replicas_identical(run.model) for run in results.values())
    assert timed_identical, "the replicas differ after the timed steps"
    smallest = results[list(results)[-1]]
    assert len(smallest.model.buckets) > 1 and launched_during_backward(smallest.steps)
    dist.barrier()
    nodes = len({row["GROUP_RANK"] for row in everyone})
    say_prose(f"""\
        Verified on {env.world_size} ranks over {nodes} node(s): the ranks' names agree, every
        replica is identical after training ({len(BUCKET_CAPS) + 1} models), and with small
        buckets all-reduces start while backward runs.""")
    cleanup()


if __name__ == "__main__":
    main()
