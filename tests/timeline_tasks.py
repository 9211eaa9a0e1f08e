"""What the ranks run for tests/test_timeline.py: recorded steps of MiniDDP, the rungs of the
ladder and the baselines.

`python -m torch.distributed.run --nproc_per_node=2 -m tests.timeline_tasks OUT_DIR` runs
`profile_a_step` instead, in processes of its own (see there why).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp import MiniDDP
from miniddp.observe.baselines import BASELINES, DeferredMiniDDP
from miniddp.observe.timeline import gather, recording, split_steps, summarize
from miniddp.observe.timeline_views import chrome_trace
from miniddp.steps import BucketedDDP, TorchLayoutDDP


def deep_model() -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])


def batch() -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(dist.get_rank()))


def step(model: nn.Module) -> None:
    for param in model.parameters():
        param.grad = None
    model(batch()).square().mean().backward()
    if hasattr(model, "finish_gradient_synchronization"):  # the naive rung averages here
        model.finish_gradient_synchronization()


def recording_off_leaves_no_trace() -> dict:
    """Steps outside `recording()` record nothing, before and after a recorded block."""
    ddp = MiniDDP(deep_model(), bucket_cap_mb=0.005)
    step(ddp)
    before = (ddp.events, list(ddp.event_listeners))
    with recording(ddp) as events:
        step(ddp)
        listeners_inside = len(ddp.event_listeners)
    recorded = len(events)
    step(ddp)
    step(ddp)
    return {
        "before": before,
        "listeners_inside": listeners_inside,
        "recorded": recorded,
        "after": len(ddp.events),
        "listeners_after": len(ddp.event_listeners),
    }


def recorded_steps(cap_mb: float, steps: int = 2) -> dict:
    """A recorded MiniDDP run on every rank: buckets, gathered steps, summaries, trace."""
    ddp = MiniDDP(deep_model(), bucket_cap_mb=cap_mb)
    step(ddp)  # learn the order; buckets are rebuilt at the next forward
    with recording(ddp) as events:
        for _ in range(steps):
            dist.barrier()
            step(ddp)
    everyone = gather(split_steps(events, dist.get_rank()))
    return {
        "buckets": len(ddp.buckets),
        "steps": everyone,
        "summaries": [summarize(s) for s in everyone],
        "trace": chrome_trace(everyone),
        "events": [(e.kind, e.name) for e in events],
    }


def every_design() -> dict:
    """Every design on the same model and data: its averaged gradients and one recorded step,
    with that step's summary."""
    designs = {name: cls for name, cls in BASELINES.items() if name != "none"}
    designs["buckets"] = lambda m: BucketedDDP(m, bucket_cap_mb=0.005)
    designs["torch layout"] = lambda m: TorchLayoutDDP(m, bucket_cap_mb=0.005)
    designs["bucketed"] = lambda m: MiniDDP(m, bucket_cap_mb=0.005)
    designs["deferred"] = lambda m: DeferredMiniDDP(m, bucket_cap_mb=0.005)
    designs["torch"] = lambda m: DistributedDataParallel(m, bucket_cap_mb=0.005)
    out = {}
    for name, wrap in designs.items():
        model = wrap(deep_model())
        step(model)
        step(model)  # after the rebuild
        grads = [p.grad.clone() for p in model.parameters()]
        events = []
        if hasattr(model, "record_events"):
            with recording(model) as events:
                step(model)
        out[name] = {
            "grads": grads,
            "events": [(e.time, e.kind, e.name) for e in events],
            "all_reduces": getattr(model, "all_reduce_count", None),
            "summaries": [summarize(one) for one in split_steps(events)],
        }
    return out


def profile_a_step(out_dir: str) -> None:
    """Profile two recorded MiniDDP steps with torch.profiler; each rank writes what it saw.

    Runs under torchrun, not in the test pool: with torch 2.13 on CPU, gloo collectives issued
    after a torch.profiler session that saw gloo work can corrupt the heap (reproduced with plain
    torch), and would crash the pool's next test. So: no collective after the profile.
    """
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    ddp = MiniDDP(deep_model(), bucket_cap_mb=0.005)
    step(ddp)
    with recording(ddp) as events, torch.profiler.profile() as profile:
        for _ in range(2):
            dist.barrier()
            step(ddp)
    launches = [e.name for e in events if e.kind == "launch"]
    spans = [
        {"name": e.name, "thread": e.thread, "ms": e.time_range.elapsed_us() / 1e3}
        for e in profile.events()
        if e.name.startswith("miniddp: ") or e.name.startswith("gloo:")
    ]
    steps = split_steps(events, dist.get_rank())
    comm_ms = {s.name: s.duration * 1e3 for s in steps[-1].buckets}
    step_ms = (steps[-1].end - steps[-1].start) * 1e3
    report = {
        "launches": launches,
        "spans": spans,
        "last_step_comm_ms": comm_ms,
        "last_step_ms": step_ms,
    }
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()  # local: no collective


if __name__ == "__main__":
    profile_a_step(sys.argv[1])
