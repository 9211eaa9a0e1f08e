"""Chapter 05's picture: k micro-steps under no_sync(), then the synced one, on a time axis.

Two gloo ranks (spawned, with a deadline) train rung 5 of the ladder (miniddp/steps/no_sync.py)
for one optimizer step of k micro-steps, the first k-1 inside `no_sync()`. Each rank times its
own forwards and backwards, and the wrapper's events (a `Recorder` as its observer) give each
bucket's all-reduce, from its launch to its completion. The picture then shows what chapter 05
counts: the accumulating micro-steps are compute only, and every bucket travels in the last
backward.
"""

from __future__ import annotations

import pickle
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from miniddp.instruments.figures.draw import plt, save
from miniddp.instruments.figures.record import spawn_and_collect
from miniddp.instruments.timeline_views import COMPUTE_COLORS
from miniddp.observe.events import NO_OBSERVER, Recorder
from miniddp.steps import NoSyncDDP

WORLD_SIZE = 2
MICRO_STEPS = 4
JOB_TIMEOUT_S = 180
BUCKET_CAP_MB = 0.25  # the model's 1.1 MiB of gradients in about five buckets
Span = tuple[str, float, float]  # (what, start, end) in seconds since the first forward


def train_on_rank(rank: int, store_path: str, out_path: str) -> None:
    """One rank: a warm-up step (the order recorded, then the rebuild), then one optimizer
    step of MICRO_STEPS micro-steps, timed. Rank 0 writes every rank's spans."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD_SIZE)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=60)
    )
    torch.manual_seed(0)
    widths = [64, 256, 256, 256, 256, 256, 10]
    model = NoSyncDDP(
        nn.Sequential(*(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))),
        bucket_cap_mb=BUCKET_CAP_MB,
    )
    data = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randn(512, 64, generator=data), torch.randn(512, 10, generator=data))
        for _ in range(MICRO_STEPS)
    ]
    for inputs, targets in batches[:2]:  # the first records the order, the second rebuilds
        nn.functional.mse_loss(model(inputs), targets).backward()
    model.zero_grad()
    dist.barrier()
    recorder = model.observer = Recorder()
    compute: list[Span] = []
    for micro, (inputs, targets) in enumerate(batches):
        synced = micro == MICRO_STEPS - 1
        started = time.perf_counter()
        with model.no_sync() if not synced else torch.enable_grad():
            loss = nn.functional.mse_loss(model(inputs), targets) / MICRO_STEPS
            forwarded = time.perf_counter()
            loss.backward()  # the synced one returns once every bucket is averaged
        compute += [("forward", started, forwarded), ("backward", forwarded, time.perf_counter())]
    model.observer = NO_OBSERVER
    events = recorder.events
    launched = {e.name: e.time for e in events if e.kind == "launch"}
    done = {}
    for event in events:  # completion: the first of "reduced" and the wait that saw it
        if event.kind in ("reduced", "wait") and event.name in launched:
            done[event.name] = min(done.get(event.name, event.time), event.time)
    # The synced backward's last part is the wait for the buckets still in flight: split it off.
    ended = next(e.time for e in events if (e.kind, e.name) == ("backward", "end"))
    _, forwarded, returned = compute.pop()
    compute += [("backward", forwarded, ended), ("wait", ended, returned)]
    comm = [(name, launched[name], done[name]) for name in launched]
    t0 = compute[0][1]
    spans = [
        [(what, start - t0, end - t0) for what, start, end in lane] for lane in (compute, comm)
    ]
    everyone = [None] * WORLD_SIZE
    dist.all_gather_object(everyone, spans)
    if rank == 0:
        Path(out_path).write_bytes(pickle.dumps(everyone))
    dist.destroy_process_group()


def record(work_dir: Path) -> list[list[list[Span]]]:
    """Spawn the ranks, wait (with a deadline); per rank, its compute and communication spans."""
    return spawn_and_collect(train_on_rank, WORLD_SIZE, work_dir, JOB_TIMEOUT_S)


def draw(ranks: list[list[list[Span]]], path: str | Path) -> Path:
    """Compute and communication lanes per rank; each micro-step labelled with what it sent."""
    figure, axes = plt.subplots(figsize=(11, 4.2))
    for rank, (compute, comm) in enumerate(ranks):
        for what, start, end in compute:
            bar = [(start * 1e3, (end - start) * 1e3)]
            axes.broken_barh(bar, (2 * rank - 0.4, 0.8), color=COMPUTE_COLORS[what])
        for index, (_, start, end) in enumerate(comm):
            bar = [(start * 1e3, max(end - start, 1e-5) * 1e3)]
            color = "tab:orange" if index % 2 == 0 else "tab:brown"
            axes.broken_barh(bar, (2 * rank + 1 - 0.4, 0.8), color=color)
    compute, comm = ranks[0]
    forwards = [start for what, start, _ in compute if what == "forward"]
    for micro, start in enumerate(forwards):
        synced = micro == len(forwards) - 1
        what = f"synced:\n{len(comm)} all-reduces" if synced else "no_sync:\nno all-reduce"
        axes.axvline(start * 1e3, color="gray", linestyle=":", linewidth=1)
        axes.text(start * 1e3 + 0.2, -0.55, f"micro-step {micro + 1}\n{what}", fontsize=8)
    lanes = [f"rank {rank} {lane}" for rank in range(len(ranks)) for lane in ("compute", "comm")]
    axes.set_yticks(range(len(lanes)))
    axes.set_yticklabels(lanes)
    axes.set_ylim(len(lanes) - 0.4, -1.9)
    axes.set_xlabel("ms since the rank's first forward began")
    axes.set_title(
        f"One optimizer step of {len(forwards)} micro-steps: .grad accumulates locally inside "
        "no_sync(),\nthen the last backward all-reduces the sum, bucket by bucket",
        fontsize=10,
    )
    legend = {
        "forward": COMPUTE_COLORS["forward"],
        "backward": COMPUTE_COLORS["backward"],
        "waiting for the last all-reduces": COMPUTE_COLORS["wait"],
        "a bucket's all-reduce in flight (colours alternate)": "tab:orange",
    }
    handles = [plt.Rectangle((0, 0), 1, 1, color=color) for color in legend.values()]
    axes.legend(
        handles, list(legend), loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, fontsize=8
    )
    return save(figure, path)
