"""Chapter 04: does communication really hide behind backward, and by how much?

    torchrun --nproc_per_node=2 tutorials/04_overlap.py [--iters 8] [--trace overlap.json]

Chapter 03 showed buckets launching while backward still runs. This chapter measures what that
buys, with a timeline of every step (`miniddp.timeline`) and three designs, each fixing the
previous one's problem (`miniddp.baselines`):

1. naive: after backward, one blocking all-reduce per gradient. Nothing overlaps, and every
   gradient pays a full round trip.
2. per-parameter async: each gradient's all-reduce starts from its hook, during backward. Now
   communication overlaps compute, but there are still as many round trips as tensors.
3. bucketed (MiniDDP): a few big messages, each launched as soon as it is full.

Then a bucket-size sweep, and the alpha-beta model for where the best size should be. Times
are measured with the variants interleaved, in a rotated order, on the same machine at the same
moment: the ratios between them mean something even on a busy machine, the absolute times less.
`python -m miniddp.bench step` does the same at full size, against torch's DDP.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.distributed as dist
from common import fmt_bytes, say, section
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp import MiniDDP
from miniddp.baselines import NaiveAllReduce, NoCommunication, PerParameterAsync
from miniddp.bench.step import Workload, paired_ratio, time_interleaved
from miniddp.env import cleanup, init_distributed
from miniddp.timeline import (
    StepTimeline,
    ascii_timeline,
    gather,
    plot,
    recording,
    split_steps,
    summarize,
    write_chrome_trace,
)

LAYERS, WIDTH, BATCH = 16, 384, 32  # 32 tensors of 576 KiB and 1.5 KiB: 9.0 MiB of gradients
# From one bucket per tensor (1 KiB holds only a bias) to one bucket for everything.
SWEEP_CAPS_MB = (0.001, 0.5, 1.0, 2.0, 4.0, 16.0)
BUCKETED_CAP_MB = 1
BUCKETED = f"cap {BUCKETED_CAP_MB:g} MiB"  # the bucketed design of section 3


def build_model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(
            *[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]
        )


def make_workload(rank: int) -> Workload:
    inputs = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
    return Workload(
        "mlp",
        f"{LAYERS} Linear({WIDTH}, {WIDTH})",
        build_model,
        (inputs,),
        lambda model, batch: model(batch[0]).square().mean(),
    )


def record_one_step(model: nn.Module, workload: Workload) -> list[StepTimeline]:
    """One recorded step of `model`, every rank's, gathered on every rank."""
    for param in model.parameters():
        param.grad = None
    with recording(model) as events:
        dist.barrier()
        workload.loss(model, workload.batch).backward()
    return gather(split_steps(events, dist.get_rank()))


def slowest_rank(times: dict[str, dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per variant and iteration, the slowest rank's time: a step ends when every rank is done."""
    names = list(times)
    table = torch.tensor([times[name]["wall"] for name in names], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return {name: table[i].tolist() for i, name in enumerate(names)}


def launches_before_backward_ends(step: StepTimeline) -> int:
    backward = step.span("backward")
    return sum(1 for bucket in step.buckets if bucket.start < backward.end)


def describe(name: str, steps: list[StepTimeline], median_ms: float) -> str:
    summaries = [summarize(step) for step in steps]
    comm = statistics.mean(s.comm_s for s in summaries) * 1e3
    overlap = statistics.mean(s.overlap for s in summaries)
    exposed = statistics.mean(s.exposed_s for s in summaries) * 1e3
    return (
        f"{name}: median step {median_ms:.1f} ms; in the step drawn: {len(steps[0].buckets)} "
        f"all-reduces, {comm:.1f} ms of communication, {overlap:.0%} of it during backward, "
        f"{exposed:.1f} ms exposed after backward"
    )


def fit_alpha_beta(small: int = 4 * 1024, large: int = 4 * 1024 * 1024) -> tuple[float, float]:
    """time(bytes) = alpha + beta * bytes, from lone all-reduces: alpha is what a tiny message
    costs, beta what each extra byte adds. Medians of the slowest rank, so one hiccup of a busy
    machine does not move them."""
    medians = []
    for nbytes in (small, large):
        tensor = torch.ones(nbytes // 4)
        for _ in range(3):  # warm-up: gloo's first calls of a new size are slow
            dist.all_reduce(tensor)
        seconds = []
        for _ in range(15):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            seconds.append(time.perf_counter() - start)
        slowest = torch.tensor(seconds, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        medians.append(slowest.median().item())
    beta = max((medians[1] - medians[0]) / (large - small), 1e-12)
    return max(medians[0] - beta * small, 1e-7), beta


def predicted_step(bucket_bytes: float, total: float, alpha: float, beta: float, backward: float):
    """Backward (`backward` s) makes `total` bytes of gradients at an even pace, and a bucket of
    b bytes takes alpha + beta*b to reduce, one after another. The step ends at the later of:
    backward plus the last bucket, or the first bucket's readiness plus all the buckets in a
    row."""
    count = max(1.0, total / bucket_bytes)
    keeps_up = backward + alpha + beta * bucket_bytes
    falls_behind = backward / count + count * alpha + beta * total
    return max(keeps_up, falls_behind)


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 04: overlap, measured.")
    parser.add_argument("--iters", type=int, default=8, help="timed iterations per variant")
    parser.add_argument("--trace", help="write the bucketed step's Chrome trace here")
    parser.add_argument("--plot", help="save the three timelines as a PNG (needs matplotlib)")
    args = parser.parse_args()
    env = init_distributed()
    torch.set_num_threads(1)
    workload = make_workload(env.rank)
    tensors = list(build_model().parameters())
    total_bytes = sum(t.numel() * t.element_size() for t in tensors)
    say(
        f"Chapter 04: overlap on {env.world_size} ranks, backend {env.backend}, one compute "
        f"thread per rank.\nModel: {LAYERS} Linear({WIDTH}, {WIDTH}) layers, {len(tensors)} "
        f"gradient tensors, {fmt_bytes(total_bytes)} in all; batch {BATCH} per rank."
    )

    designs = {
        "no communication": NoCommunication,
        "naive": NaiveAllReduce,
        "per-parameter async": PerParameterAsync,
        **{
            f"cap {cap:g} MiB": (lambda m, c=cap: MiniDDP(m, bucket_cap_mb=c))
            for cap in SWEEP_CAPS_MB
        },
        # torch's DDP at the bucketed design's cap, so that the two differ only in who runs it
        "torch DDP": lambda m: DistributedDataParallel(m, bucket_cap_mb=BUCKETED_CAP_MB),
    }
    models = {name: wrap(workload.build()) for name, wrap in designs.items()}
    say(f"\nTiming {len(models)} variants, {args.iters} interleaved iterations each...")
    times = slowest_rank(time_interleaved(models, workload, args.iters))
    median_ms = {name: statistics.median(seconds) * 1e3 for name, seconds in times.items()}

    def ratio(ours: str, theirs: str) -> str:
        return f"{paired_ratio(times[ours], times[theirs]):.2f}x"

    recordable = [name for name in models if name != "torch DDP"]  # torch notes no events
    timelines = {name: record_one_step(models[name], workload) for name in recordable}
    grads = {name: [p.grad.clone() for p in model.parameters()] for name, model in models.items()}

    section("1. Naive: one blocking all-reduce per gradient, after backward")
    say(ascii_timeline(timelines["naive"]))
    say(describe("naive", timelines["naive"], median_ms["naive"]))
    say(
        f"The compute lane waits (w) while {len(tensors)} messages go one by one, in parameter "
        "order: all of the\ncommunication is exposed. Without any communication the step takes "
        f"{median_ms['no communication']:.1f} ms; naive costs\n"
        f"{ratio('naive', 'no communication')} that (median of per-iteration ratios)."
    )

    section("2. Per-parameter async: launch each gradient's all-reduce from its hook")
    say(ascii_timeline(timelines["per-parameter async"]))
    name = "per-parameter async"
    say(describe(name, timelines[name], median_ms[name]))
    say(
        "Launches start while backward runs, the last layer's first ('v' is tensor 31). But "
        "each message still\npays the fixed cost of a round trip, and gloo works through them "
        "in order: with many tensors the\nqueue outlasts backward, and the wait (w) is for "
        f"messages that were queued, not slow. vs naive: {ratio(name, 'naive')}."
    )

    section(f"3. Bucketed (MiniDDP, {BUCKETED}): few messages, each sent as soon as it is full")
    say(ascii_timeline(timelines[BUCKETED]))
    say(describe("bucketed", timelines[BUCKETED], median_ms[BUCKETED]))
    say(
        f"{len(models[BUCKETED].buckets)} buckets instead of {len(tensors)} messages: a quarter "
        "of the round trips, and the first bucket\nstill leaves early. "
        f"vs per-parameter async: {ratio(BUCKETED, 'per-parameter async')}; "
        f"vs naive: {ratio(BUCKETED, 'naive')}; "
        f"vs torch's DDP at the same cap: {ratio(BUCKETED, 'torch DDP')}.\n"
        "torch runs the same design in C++; MiniDDP's hooks and launches are Python, tens of "
        "microseconds each:\nsmall next to a real model's backward, but this toy's lasts a few "
        "milliseconds, so expect MiniDDP\nsome percent behind here. On a shared machine a few "
        "iterations also move this ratio between runs\n(by up to 30% at the default --iters 8): "
        "`python -m miniddp.bench step` measures it properly, with an interval.\n"
        "On this CPU machine gloo's threads share the cores with backward, so communication "
        "also slows the\ncompute it overlaps (compare the b lanes above). GPUs do not escape "
        "it entirely: NCCL's kernels run\non the same SMs as the compute and share its memory "
        "bandwidth, so overlapped compute runs\nsomewhat slower there too."
    )
    drawn = [s for n in ("naive", "per-parameter async", BUCKETED) for s in timelines[n]]
    if args.trace and env.is_main:
        path = write_chrome_trace(timelines[BUCKETED], args.trace)
        say(f"Chrome trace of the bucketed step (open it at ui.perfetto.dev): {path}")
    if args.plot and env.is_main:
        say(f"PNG of the three timelines: {plot(drawn, args.plot, title='naive, async, bucketed')}")

    section("4. Bucket size: too small is latency-bound, too large has nothing to overlap")
    alpha, beta = fit_alpha_beta()
    alone = [summarize(s) for s in timelines["no communication"]]
    backward = statistics.median(s.backward_s for s in alone)
    forward = statistics.median(s.step_s - s.backward_s - s.tail_s for s in alone)
    say(
        f"Measured on lone all-reduces: alpha = {alpha * 1e6:.0f} us per message, beta = "
        f"{beta * 1e9:.2f} ns per byte ({1 / beta / 1e9:.2f} GB/s).\nWithout communication, "
        f"forward takes {forward * 1e3:.1f} ms and backward {backward * 1e3:.1f} ms, producing "
        f"{fmt_bytes(total_bytes)} of gradients.\nThe model's step: forward + the later of "
        "(backward + the last bucket) and (the first bucket's\nreadiness + every bucket back to "
        "back).\n"
    )
    say(f"{'cap':>9} {'buckets':>7} {'mean size':>10} {'measured':>9} {'model':>8} {'overlap':>8}")
    sweep = []
    for cap in SWEEP_CAPS_MB:
        name = f"cap {cap:g} MiB"
        count = len(models[name].buckets)
        size = total_bytes / count
        model_ms = (forward + predicted_step(size, total_bytes, alpha, beta, backward)) * 1e3
        overlap = statistics.mean(summarize(s).overlap for s in timelines[name])
        sweep.append((median_ms[name], cap, count))
        say(
            f"{cap:>5g} MiB {count:>7} {fmt_bytes(size):>10} {median_ms[name]:>6.1f} ms "
            f"{model_ms:>5.1f} ms {overlap:>8.0%}"
        )
    best_ms, best_cap, _ = min(sweep)
    # The smallest bucket whose all-reduce keeps pace with the backward that fills it, if any
    # bucket up to the whole model's size does.
    slack = backward - beta * total_bytes
    keeps_pace = alpha * total_bytes / slack if slack > 0 else math.inf
    if keeps_pace < total_bytes:
        best_size = keeps_pace
        why = "where a bucket's all-reduce (alpha + beta*b) just keeps pace with the backward "
        why += "time that fills it (b * backward / total)"
    else:
        best_size = total_bytes * math.sqrt(alpha / backward)
        why = "communication alone outlasts backward: the first bucket's wait (b * backward / "
        why += "total) balances the messages' alphas (total / b * alpha)"
    say(
        f"\nMeasured optimum: cap {best_cap:g} MiB, {best_ms:.1f} ms (on a shared machine the "
        "measured column is noisy).\n"
        f"The model's optimum: buckets of about {fmt_bytes(best_size)},\n{why}.\n"
        "Smaller: alpha is paid too often and the messages fall behind backward. Bigger: each "
        "bucket waits for\nmore gradients before leaving, and the last one is all exposed. "
        "The model assumes communication\ncosts compute nothing; here gloo's threads take cores "
        "from backward, which the measured times show.\ntorch's default (1 MiB first bucket, "
        "then 25 MiB) is tuned for big models on GPUs."
    )

    section("Final check")
    reference = grads["torch DDP"]
    for name, theirs in grads.items():
        if name == "no communication":
            continue
        for ours, torchs in zip(theirs, reference):
            # W = 2: a + b = b + a, so every layout gives the same bits; more ranks may round
            # differently in different layouts.
            same = (
                torch.equal(ours, torchs) if env.world_size == 2 else torch.allclose(ours, torchs)
            )
            assert same, f"{name}: gradients differ from torch's DDP"
    for name, steps in timelines.items():
        for step in steps:
            s = summarize(step)
            assert s.comm_s == 0 or 0 <= s.overlap <= 1, (name, s)
            assert math.isclose(s.overlapped_s + s.exposed_s, s.comm_s, abs_tol=1e-9), (name, s)
    for step in timelines["naive"]:
        assert len(step.buckets) == len(tensors) and launches_before_backward_ends(step) == 0
    for name in ("per-parameter async", BUCKETED):
        assert all(launches_before_backward_ends(s) > 0 for s in timelines[name]), name
    counts = [count for _, _, count in sweep]
    assert counts == sorted(counts, reverse=True) and counts[0] == len(tensors) and counts[-1] == 1
    dist.barrier()
    # Only W = 2 is checked bit for bit (a + b = b + a); beyond, the bits depend on the layout.
    how_equal = "bit for bit" if env.world_size == 2 else "up to rounding (allclose)"
    say(
        f"Verified on {env.world_size} ranks: every design averages to torch's gradients "
        f"{how_equal}; naive sends\nnothing before backward ends, per-parameter async and bucketed "
        f"do; the sweep goes from {counts[0]} buckets\n(one per tensor) to 1; every summary "
        "adds up."
    )
    cleanup()


if __name__ == "__main__":
    main()
