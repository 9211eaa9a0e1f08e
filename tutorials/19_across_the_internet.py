"""Chapter 19: across the internet. Replicas that sync every H steps instead of every step:
DiLoCo, its streaming form, and a replica that dies while the others train on.

    NPROC=4 ./launch.sh tutorials/19_across_the_internet.py [--steps 300] [--plot DIR]

Every chapter so far all-reduced the gradients after every step, so the link between replicas
set the pace. Inside one machine or one datacenter that is fine. Between two datacenters, or
across the internet, a link is a thousand times slower, and DDP spends its time waiting on it.
DiLoCo (Douillard et al., 2023) lets each replica take H steps alone and then averages where the
replicas went: H times fewer syncs, the same bytes each.

    1. the link                    why 100 Mbit/s and 50 ms, and what one sync costs on it
    2. five ways to train          DDP, DiLoCo at H = 10, 30, 100, Streaming DiLoCo, and one
                                   replica alone: validation loss, bytes, simulated time
    3. checks                      bytes by the formula; H = 1 is synchronous DP
    4. a replica dies              named at the next sync; the others agree and go on

The library is miniddp/local_sgd/ (diloco.py has the maths); tests/test_local_sgd.py holds it
bit for bit to torchft's DiLoCo and torch's PostLocalSGDOptimizer.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from char_corpus import Windows, load_corpus
from common import fmt_bytes, say, say_prose, section
from torch import nn

from miniddp import MiniDDP
from miniddp.instruments.figures.local_sgd import loss_against_time_and_bytes
from miniddp.job.env import init_distributed
from miniddp.job.notes import board_of
from miniddp.local_sgd import DiLoCo
from miniddp.models.gpt import GPT, GPTConfig, next_character_loss
from miniddp.observe.link import Link, wire_bytes

LINK = Link.parse("alpha=50ms,bandwidth=100mbit")
CONTEXT, BATCH, EVALS = 32, 16, 10
DIES_AFTER = 15  # section 4: the last replica dies after its 15th step (H = 10)


def build(vocabulary: int) -> GPT:
    torch.manual_seed(0)  # every replica the same initial weights
    return GPT(GPTConfig(vocabulary, CONTEXT, 48, 2, 4, 0.0))


def batch(windows: Windows, replica: int, step: int) -> torch.Tensor:
    """Each replica its own random windows: its share of the data."""
    g = torch.Generator().manual_seed(1000 * replica + step)
    return windows[torch.randint(len(windows), (BATCH,), generator=g).tolist()]


def link_seconds(payload: int, world: int) -> float:
    """One sync on the link: its latency once (the all-reduces leave together, so their
    latencies overlap), then a ring all-reduce's 2(W-1)/W of the payload each way."""
    return LINK.seconds(wire_bytes("all_reduce", payload, world))


class Run:
    """One way of training: its validation losses, with the bytes and simulated time so far."""

    def __init__(self, label: str, syncs_every: int | None, payload: int, world: int) -> None:
        self.label, self.syncs_every = label, syncs_every  # None: never syncs
        self.payload, self.world = payload, world
        self.points: list[tuple[float, float, float]] = []

    def record(self, steps: int, seconds_per_step: float, loss: float) -> None:
        syncs = 0 if self.syncs_every is None else steps // self.syncs_every
        sent = syncs * wire_bytes("all_reduce", self.payload, self.world)
        seconds = steps * seconds_per_step + syncs * link_seconds(self.payload, self.world)
        self.points.append((seconds, sent, loss))


@torch.no_grad()
def validation_loss(model: nn.Module, validation: torch.Tensor) -> float:
    model.eval()
    loss = next_character_loss(model, validation).item()
    model.train()
    return loss


def train(way: str, h: int, data: dict, steps: int, rank: int) -> tuple[nn.Module, list, DiLoCo]:
    """Train one way ("ddp", "alone", "diloco", "streaming", "dies"); rank 0 evaluates its own
    model as it stands every steps/EVALS steps. Returns the model, the (step, seconds of
    compute, loss) points, and the DiLoCo run (None for DDP and alone)."""
    model = build(data["vocabulary"])
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    forward, run = model, None
    if way == "ddp":
        forward = MiniDDP(model)
    elif way != "alone":
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        fragments, delay = None, 0
        if way == "streaming":  # the bottom half and the top half, synced in turn
            bottom = nn.ModuleList([model.token, model.position, model.blocks[0]])
            fragments, delay = [bottom, nn.ModuleList([model.blocks[1], model.norm])], 1
        run = DiLoCo(model, inner, outer, h, fragments=fragments, fragment_sync_delay=delay)
    points, every, computing = [], max(1, steps // EVALS), 0.0
    with run or nullcontext():
        for step in range(1, steps + 1):
            if way == "dies" and rank == dist.get_world_size() - 1 and step > DIES_AFTER:
                sys.stdout.flush()
                os._exit(0)  # no goodbye: its connections simply close
            started = time.perf_counter()
            inner.zero_grad()
            next_character_loss(forward, batch(data["train"], rank, step)).backward()
            inner.step()
            computing += time.perf_counter() - started
            if step % every == 0 and rank == 0:
                points.append((step, computing, validation_loss(model, data["validation"])))
    return model, points, run


def fingerprint(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 19: DiLoCo across a slow link.")
    parser.add_argument("--steps", type=int, default=300, help="inner steps per run")
    parser.add_argument("--plot", type=Path, metavar="DIR", help="save the figure here")
    args = parser.parse_args()
    env = init_distributed()
    rank, world = env.rank, env.world_size
    if world < 2:
        parser.error("run it on several replicas: NPROC=4 ./launch.sh " + parser.prog)
    torch.set_num_threads(1)
    corpus = load_corpus(max_characters=300_000)
    windows = Windows(corpus.validation, CONTEXT)
    data = {
        "vocabulary": len(corpus.vocabulary),
        "train": Windows(corpus.train, CONTEXT),
        "validation": windows[list(range(0, len(windows), max(1, len(windows) // 128)))[:128]],
    }
    model = build(data["vocabulary"])
    params = sum(p.numel() for p in model.parameters())
    payload = params * 4

    section("1. The link")
    ddp_sync = link_seconds(payload, world)
    say_prose(f"""
        Two datacenters on different continents are ~50 ms apart (light in fibre covers
        10,000 km in 50 ms), and a training job rarely gets more than a 100 Mbit/s share of a
        long-haul or internet path: {LINK}. On it, one all-reduce of this model's
        {params:,} float32 parameters ({fmt_bytes(payload)}) over {world} replicas costs
        alpha + 2(W-1)/W n / bandwidth = {ddp_sync * 1e3:.0f} ms. DDP pays that every step; a
        step of compute here takes tens of milliseconds. DiLoCo pays it every H steps.
        """)

    section("2. Five ways to train")
    ways = [("DDP", "ddp", 1), ("alone", "alone", 0)]
    ways += [(f"DiLoCo H={h}", "diloco", h) for h in (10, 30, 100)]
    ways += [("Streaming H=30, 2 fragments", "streaming", 30)]
    curves: dict[str, list] = {}
    seconds_per_step: list[float] = []
    for label, way, h in ways:
        trained, points, run = train(way, h, data, args.steps, rank)
        if rank != 0:
            continue
        seconds_per_step.append(points[-1][1] / points[-1][0])
        curves[label] = (way, h, points, run)
        say(f"  {label:<28} validation loss {points[-1][2]:.3f} after {args.steps} steps")
    dist.barrier()
    if rank == 0:
        compute = statistics.median(seconds_per_step)  # one figure: only the link differs
        runs = {}
        for label, (way, h, points, run) in curves.items():
            every = {"alone": None, "ddp": 1}.get(way, h)
            sent = payload
            if run is not None:  # streaming sends a fragment every H/F steps
                every, sent = run.steps_per_fragment, payload // len(run.fragments)
            record = Run(label, every, sent, world)
            for step, _, loss in points:
                record.record(step, compute, loss)
            runs[label] = record
        say(f"\n  compute {compute * 1e3:.0f} ms a step (the runs' median), then the link:")
        say(f"  {'':<28} {'sent/replica':>13} {'simulated time':>15} {'val loss':>9}")
        for label, record in runs.items():
            seconds, sent, loss = record.points[-1]
            say(f"  {label:<28} {fmt_bytes(sent):>13} {seconds / 60:>13.1f} m {loss:>9.3f}")
        ddp, alone = runs["DDP"].points[-1][2], runs["alone"].points[-1][2]
        for h in (10, 30, 100):
            mine = runs[f"DiLoCo H={h}"].points[-1][2]
            share = (alone - mine) / (alone - ddp) if alone > ddp else float("nan")
            say(f"  DiLoCo H={h}: {share:.0%} of {world} replicas' gain, at {h}x less traffic")
        for label in ("DDP", "DiLoCo H=10"):
            total = runs[label].points[-1][0]
            say(f"  {label}: {1 - args.steps * compute / total:.0%} of its time on the link")
        if args.plot:
            path = loss_against_time_and_bytes(
                {label: r.points for label, r in runs.items()},
                args.plot / "19_across_the_internet.png",
                f"{world} replicas of a {params:,}-parameter GPT over {LINK}",
            )
            say(f"  figure: {path}")
    say_prose("""
        What the papers claim: with 8 replicas DiLoCo matched synchronous training at 500x less
        communication (Douillard et al., 2023: 150M-400M parameters, H = 500); OpenDiLoCo and
        INTELLECT-1 trained across continents with it; Streaming DiLoCo lowers the peak
        bandwidth further by syncing fragments in turn. What this tiny run shows is printed
        above, and it is noisy and short: a longer run of the same comparison (4 replicas of a
        94k-parameter character model, 1500 steps, measured when this chapter was planned) kept
        53-70 % of the gain from 4 replicas over one, at 10-100x less traffic. How much of DDP's
        time the link takes depends on the ratio of bytes (the parameters) to compute (the
        parameters times the tokens a step): the printed share is this model's and this batch's.
        """)

    section("3. Checks")
    sent_ok = rank != 0 or all(
        r.sent_bytes == expected_bytes(r, args.steps) for *_, r in curves.values() if r
    )
    say(f"  bytes by the formula (steps/H syncs x {fmt_bytes(payload)}): {sent_ok}")
    diloco_h1, _, _ = train_h1(data, rank, "diloco")
    synchronous, _, _ = train_h1(data, rank, "ddp")
    gap = max(
        (a - b).abs().max().item() for a, b in zip(diloco_h1.parameters(), synchronous.parameters())
    )
    say(f"  H = 1, outer SGD lr 1, no momentum, against synchronous DP: differs by {gap:.1e}")
    assert sent_ok and gap < 1e-5, "the structure this chapter claims does not hold"

    section("4. A replica dies")
    say_prose(f"""
        DiLoCo at H = 10 again; replica {world - 1} ends its process after step {DIES_AFTER},
        between syncs 1 and 2. (torchrun ends a whole job when a worker fails; the replicas of a
        real DiLoCo run are separate jobs, so here the victim exits with status 0 instead: to
        the others it is the same, its connections close.)
        """)
    model, _, run = train("dies", 10, data, 40, rank)
    failure = run.exchange.failure
    if rank == 0 and failure is not None:
        say("  rank 0 heard: " + str(failure).splitlines()[0])
        say(f"  the survivors agreed through the store on ranks {run.exchange.survivors}")
    store = board_of(None).store
    store.set(f"ch18/{rank}", fingerprint(model))
    survivors = run.exchange.survivors or list(range(world))
    same = len({store.get(f"ch18/{r}").decode() for r in survivors}) == 1
    say(f"  after {run.fragment_syncs} syncs, survivors {survivors} hold the same bits: {same}")
    assert failure is not None and same, "the survivors did not carry on together"
    say("\nChapter 19 done: every check held.")
    sys.stdout.flush()
    os._exit(0)  # not cleanup(): it would wait for the dead replica


def expected_bytes(run: DiLoCo, steps: int) -> int:
    """Fragment k % F syncs at the k-th sync, every H/F steps, and sends its float32 bytes."""
    sizes = [sum(p.numel() * 4 for p in f.params) for f in run.fragments]
    return sum(sizes[k % len(sizes)] for k in range(steps // run.steps_per_fragment))


def train_h1(data: dict, rank: int, way: str) -> tuple[nn.Module, None, None]:
    """Five steps of inner SGD: DiLoCo with H = 1 and outer SGD(lr 1), or MiniDDP."""
    model = build(data["vocabulary"])
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    forward, run = model, nullcontext()
    if way == "ddp":
        forward = MiniDDP(model)
    else:
        run = DiLoCo(model, inner, torch.optim.SGD(model.parameters(), lr=1.0), 1)
    with run:
        for step in range(5):
            inner.zero_grad()
            next_character_loss(forward, batch(data["train"], rank, step)).backward()
            inner.step()
    return model, None, None


if __name__ == "__main__":
    main()
