"""miniddp.observe.timeline: spans and summaries from known event lists, the three views,
recording on real ranks (and off), torch.profiler spans, and the claims chapter 04 makes about
the rungs of the ladder and the baselines.

What the ranks run sits next to the test that checks it: the pool's workers import it as
`tests.test_timeline.<function>`; `profile_a_step` runs as torchrun workers of its own instead, as
`python -m tests.test_timeline OUT_DIR` (see there why).
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp import MiniDDP
from miniddp.instruments.bench.baselines import BASELINES, DeferredMiniDDP
from miniddp.instruments.timeline_views import ascii_timeline, chrome_trace, plot
from miniddp.observe.events import NO_OBSERVER, Event
from miniddp.observe.timeline import (
    COMM,
    COMPUTE,
    ProfilerSpans,
    StepTimeline,
    gather,
    recording,
    split_steps,
    summarize,
)
from miniddp.steps import BucketedDDP, TorchLayoutDDP
from tests.harness.processes import child_env, run_ranks_like_torchrun

REPO = Path(__file__).resolve().parents[1]


def events(*moments: tuple[float, str, str]) -> list[Event]:
    return [Event(t, kind, name) for t, kind, name in moments]


# A step with two buckets, times in seconds. bucket 0 is in flight 2..4, bucket 1 3.5..7: the
# communication lane is busy 2..7 (5 s), of which 2..5 while backward ran (3 s): overlap 0.6.
ONE_STEP = events(
    (0.0, "forward", "start"),
    (1.0, "forward", "end"),
    (1.0, "backward", "start"),
    (1.5, "hook", "2.weight"),
    (1.9, "ready", "bucket 0"),
    (2.0, "launch", "bucket 0"),
    (3.4, "hook", "0.weight"),
    (3.5, "launch", "bucket 1"),
    (4.0, "reduced", "bucket 0"),
    (5.0, "backward", "end"),
    (5.1, "wait", "bucket 0"),
    (7.0, "wait", "bucket 1"),
    (7.5, "sync", "end"),
    (7.6, "reduced", "bucket 1"),  # gloo's thread got Python's lock after the wait returned
)


def test_summary_of_a_known_step():
    (step,) = split_steps(ONE_STEP)
    summary = summarize(step)
    assert summary.step_s == pytest.approx(7.5)  # until gradients are averaged (sync end)
    assert summary.backward_s == pytest.approx(4.0)
    assert summary.comm_s == pytest.approx(5.0)
    assert summary.overlapped_s == pytest.approx(3.0)
    assert summary.exposed_s == pytest.approx(2.0)
    assert summary.tail_s == pytest.approx(2.5)
    assert summary.overlap == pytest.approx(0.6)


def test_spans_pair_starts_with_ends_and_a_bucket_ends_when_first_seen_done():
    (step,) = split_steps(ONE_STEP)
    spans = {(s.lane, s.name): (s.start, s.end) for s in step.spans}
    assert spans == {
        (COMPUTE, "forward"): (0.0, 1.0),
        (COMPUTE, "backward"): (1.0, 5.0),
        (COMPUTE, "wait"): (5.0, 7.5),
        (COMM, "bucket 0"): (2.0, 4.0),  # reduced (4.0) before the wait saw it (5.1)
        (COMM, "bucket 1"): (3.5, 7.0),  # the wait (7.0) saw it before "reduced" was noted
    }
    assert [m.name for m in step.marks if m.kind == "hook"] == ["2.weight", "0.weight"]


def test_steps_split_at_each_forward_and_late_completions_stay_with_their_step():
    later = [Event(e.time + 10, e.kind, e.name) for e in ONE_STEP if e.kind != "reduced"]
    late_reduced = [Event(10.5, "reduced", "bucket 1"), Event(13.9, "reduced", "bucket 0")]
    rebuild = [Event(9.9, "rebuild", "2 buckets")]  # noted inside forward, before its "start"
    first, second = split_steps(
        ONE_STEP[:-1] + late_reduced[:1] + rebuild + later + late_reduced[1:]
    )
    assert (first.step, second.step) == (0, 1)
    assert first.span("bucket 1").end == 7.0  # its wait; the "reduced" at 10.5 is later
    assert second.span("bucket 0").end == 13.9
    assert [m.kind for m in second.marks][:1] == ["rebuild"]
    assert summarize(first).comm_s == pytest.approx(5.0)


def test_concurrent_buckets_count_once_and_no_communication_means_no_overlap():
    both = events(
        (0, "forward", "start"),
        (1, "forward", "end"),
        (1, "backward", "start"),
        (2, "launch", "bucket 0"),
        (2, "launch", "bucket 1"),
        (4, "reduced", "bucket 0"),
        (6, "reduced", "bucket 1"),
        (8, "backward", "end"),
        (8, "wait", "bucket 0"),
        (8, "wait", "bucket 1"),
        (8, "sync", "end"),
    )
    summary = summarize(split_steps(both)[0])
    assert (summary.comm_s, summary.overlapped_s, summary.exposed_s) == (4, 4, 0)
    assert summary.overlap == 1.0
    silent = events(
        (0, "forward", "start"),
        (1, "forward", "end"),
        (1, "backward", "start"),
        (3, "backward", "end"),
        (3, "sync", "end"),
    )
    quiet = summarize(split_steps(silent)[0])
    assert quiet.comm_s == 0 and math.isnan(quiet.overlap)


def two_ranks() -> list[StepTimeline]:
    (rank0,) = split_steps(ONE_STEP, rank=0)
    shifted = [Event(e.time + 0.6, e.kind, e.name) for e in ONE_STEP]
    (rank1,) = split_steps(shifted, rank=1)
    return [rank0, rank1]


def test_chrome_trace_is_valid_json_with_every_bucket_on_every_rank_and_nesting_rows():
    trace = json.loads(json.dumps(chrome_trace(two_ranks())))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        names = sorted(e["name"] for e in spans if e["pid"] == rank and e["cat"] == COMM)
        assert names == ["bucket 0", "bucket 1"]
    # A trace viewer needs the spans of one thread to nest; concurrent buckets get two rows.
    for pid, tid in {(e["pid"], e["tid"]) for e in spans}:
        row = sorted(
            (e["ts"], e["ts"] + e["dur"]) for e in spans if (e["pid"], e["tid"]) == (pid, tid)
        )
        assert all(end <= next_start for (_, end), (next_start, _) in zip(row, row[1:]))
    bucket_rows = {e["tid"] for e in spans if e["cat"] == COMM and e["pid"] == 0}
    assert len(bucket_rows) == 2
    bucket0 = next(e for e in spans if e["pid"] == 1 and e["name"] == "bucket 0")
    assert (bucket0["ts"], bucket0["dur"]) == (2.6e6, 2e6)  # rank 1 is 0.6 s after rank 0
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"compute", "communication", "communication 2"} <= names


def test_ascii_timeline_draws_two_lanes_per_rank_on_one_axis():
    drawing = ascii_timeline(two_ranks(), width=81)  # 8.1 s, 0.1 s per column
    lines = drawing.splitlines()
    rows = [line.split("|")[1] for line in lines[1:5]]
    assert all(len(row) == 81 for row in rows)
    compute0, comm0, compute1, comm1 = rows
    assert compute0.startswith("f" * 10 + "b" * 40 + "w" * 25)
    assert comm0[20:40] == "0" * 20 and comm0[40:70] == "1" * 30  # oldest bucket in flight
    assert compute1.startswith(" " * 6 + "f" * 10)
    assert lines[1].startswith("rank 0") and lines[3].startswith("rank 1")


def test_a_bucket_in_flight_only_under_an_older_one_is_drawn_where_it_was_launched():
    """Bucket 1 launched at 3 s and seen done at 5 s with bucket 0 (at the final wait): it is
    never the oldest in flight, and without a mark of its own the drawing would hide it."""
    hidden = events(
        (0.0, "forward", "start"),
        (1.0, "forward", "end"),
        (1.0, "backward", "start"),
        (2.0, "launch", "bucket 0"),
        (3.0, "launch", "bucket 1"),
        (4.0, "backward", "end"),
        (5.0, "wait", "bucket 0"),
        (5.0, "wait", "bucket 1"),
        (5.5, "sync", "end"),
    )
    (step,) = split_steps(hidden)
    comm = ascii_timeline([step], width=55).splitlines()[2].split("|")[1]  # 0.1 s a column
    assert comm[20:30] == "0" * 10 and comm[30] == "1" and comm[31:50] == "0" * 19


def test_plot_writes_a_png(tmp_path):
    path = plot(two_ranks(), tmp_path / "t.png", title="two ranks")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profiler_spans_close_bucket_ranges_from_another_thread():
    """A bucket's range ends on gloo's thread: it must end there, not at the end of the trace."""
    listener = ProfilerSpans()

    def note(kind: str, name: str) -> None:
        listener(Event(time.perf_counter(), kind, name))

    with torch.profiler.profile() as profile:
        note("forward", "start")
        note("forward", "end")
        note("backward", "start")
        note("launch", "bucket 0")
        finisher = threading.Thread(target=lambda: (time.sleep(0.02), note("reduced", "bucket 0")))
        finisher.start()
        finisher.join()
        note("backward", "end")
        note("sync", "end")
        time.sleep(0.2)  # a range left open would run to here
    ms = {e.name: e.time_range.elapsed_us() / 1e3 for e in profile.events()}
    assert set(ms) >= {
        "miniddp: forward",
        "miniddp: backward",
        "miniddp: wait",
        "miniddp: bucket 0",
    }
    assert 15 < ms["miniddp: bucket 0"] < 150


def deep_model() -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])


def rank_batch() -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(dist.get_rank()))


def train_step(model: nn.Module) -> None:
    for param in model.parameters():
        param.grad = None
    model(rank_batch()).square().mean().backward()
    if hasattr(model, "finish_gradient_synchronization"):  # the naive rung averages here
        model.finish_gradient_synchronization()


def recording_off_leaves_no_trace() -> dict:
    """Steps outside `recording()` record nothing, before and after a recorded block."""
    ddp = MiniDDP(deep_model(), bucket_cap_mb=0.005)
    train_step(ddp)
    before = ddp.observer
    with recording(ddp) as events:
        train_step(ddp)
        listeners_inside = len(ddp.observer.listeners)
    recorded = len(events)
    train_step(ddp)
    train_step(ddp)
    return {
        "before": before is NO_OBSERVER,
        "listeners_inside": listeners_inside,
        "recorded": recorded,
        "after": len(events),
        "observer_after": ddp.observer is NO_OBSERVER,
    }


def test_recording_is_opt_in_and_leaves_nothing_behind(pool2):
    for outcome in pool2.run(recording_off_leaves_no_trace):
        assert outcome["before"]  # nobody watches until an instrument attaches an observer
        assert outcome["listeners_inside"] == 1  # the profiler spans
        assert outcome["recorded"] > 0
        assert outcome["after"] == outcome["recorded"]  # later steps added nothing
        assert outcome["observer_after"]


def recorded_steps(cap_mb: float, steps: int = 2) -> dict:
    """A recorded MiniDDP run on every rank: buckets, gathered steps, summaries, trace."""
    ddp = MiniDDP(deep_model(), bucket_cap_mb=cap_mb)
    train_step(ddp)  # learn the order; buckets are rebuilt at the next forward
    with recording(ddp) as events:
        for _ in range(steps):
            dist.barrier()
            train_step(ddp)
    everyone = gather(split_steps(events, dist.get_rank()))
    return {
        "buckets": len(ddp.buckets),
        "steps": everyone,
        "summaries": [summarize(s) for s in everyone],
        "trace": chrome_trace(everyone),
        "events": [(e.kind, e.name) for e in events],
    }


def test_recorded_buckets_on_real_ranks(pool2):
    results = pool2.run(recorded_steps, 0.005, 2)
    for result in results:
        assert result["buckets"] >= 3
        steps = result["steps"]
        assert sorted((s.rank, s.step) for s in steps) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        for step in steps:
            assert sorted(s.name for s in step.buckets) == [
                f"bucket {i}" for i in range(result["buckets"])
            ]
        for summary in result["summaries"]:
            assert 0 <= summary.overlap <= 1
            assert summary.overlapped_s + summary.exposed_s == pytest.approx(summary.comm_s)
            assert summary.step_s >= summary.backward_s + summary.tail_s - 1e-9
        spans = [e for e in result["trace"]["traceEvents"] if e["ph"] == "X"]
        for rank in (0, 1):
            names = {e["name"] for e in spans if e["pid"] == rank and e["cat"] == COMM}
            assert names == {f"bucket {i}" for i in range(result["buckets"])}
    assert results[0]["trace"] == results[1]["trace"]  # gathered: the same on every rank


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
        train_step(model)
        train_step(model)  # after the rebuild
        grads = [p.grad.clone() for p in model.parameters()]
        events = []
        if hasattr(model, "observer"):
            with recording(model) as events:
                train_step(model)
        out[name] = {
            "grads": grads,
            "events": [(e.time, e.kind, e.name) for e in events],
            "all_reduces": getattr(model, "all_reduce_count", None),
            "summaries": [summarize(one) for one in split_steps(events)],
        }
    return out


def launch_times(events: list) -> tuple[list[float], float]:
    backward_end = next(t for t, kind, name in events if (kind, name) == ("backward", "end"))
    return [t for t, kind, _ in events if kind == "launch"], backward_end


def test_every_design_averages_to_the_same_bits_and_launches_when_it_says(pool2):
    for rank_result in pool2.run(every_design):
        reference = rank_result["torch"]["grads"]
        for name, outcome in rank_result.items():
            for ours, theirs in zip(outcome["grads"], reference):
                assert torch.equal(ours, theirs), name
        launched, end = launch_times(rank_result["naive"]["events"])
        assert len(launched) == 16 and min(launched) >= end  # one per tensor, after backward
        flat = rank_result["flat"]["events"]
        launched, end = launch_times(flat)
        last_hook = max(t for t, kind, _ in flat if kind == "hook")
        assert len(launched) == 1 and last_hook <= launched[0] <= end  # with the last gradient
        for name in ("async", "buckets", "torch layout", "bucketed"):
            launched, end = launch_times(rank_result[name]["events"])
            assert len(launched) >= 3 and min(launched) < end, name  # from the hooks
        assert len(launch_times(rank_result["async"]["events"])[0]) == 16  # one per tensor
        launched, end = launch_times(rank_result["deferred"]["events"])
        assert len(launched) >= 3 and min(launched) >= end
        # Each design's recorded step makes one timeline, with its communication in it.
        for name, outcome in rank_result.items():
            if name == "torch":
                continue  # torch's DDP notes no events
            (summary,) = outcome["summaries"]
            assert summary.comm_s > 0 and 0 <= summary.overlap <= 1, name
            assert summary.overlapped_s + summary.exposed_s == pytest.approx(summary.comm_s)
            assert summary.step_s >= summary.backward_s > 0, name
        assert rank_result["naive"]["summaries"][0].overlap == 0  # nothing sent during backward


def profile_a_step(out_dir: str) -> None:
    """Profile two recorded MiniDDP steps with torch.profiler; each rank writes what it saw.

    Runs in processes of its own, not in the test pool: with torch 2.13 on CPU, gloo
    collectives issued after a torch.profiler session that saw gloo work can corrupt the heap
    (reproduced with plain torch), and would crash the pool's next test. So: no collective
    after the profile.
    """
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    ddp = MiniDDP(deep_model(), bucket_cap_mb=0.005)
    train_step(ddp)
    with recording(ddp) as events, torch.profiler.profile() as profile:
        for _ in range(2):
            dist.barrier()
            train_step(ddp)
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


@pytest.mark.slow  # 10 s under torch's profiler; the trace's own shape is tested above
def test_profiler_trace_shows_buckets_beside_gloos_all_reduce(tmp_path):
    command = [sys.executable, "-m", "tests.test_timeline", str(tmp_path)]
    returncode, output = run_ranks_like_torchrun(command, 2, child_env(tmp_path), timeout=120)
    assert returncode == 0, output[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        names = [span["name"] for span in report["spans"]]
        assert "gloo:all_reduce" in names
        for bucket in set(report["launches"]):
            assert names.count(f"miniddp: {bucket}") == 2  # two profiled steps
        assert names.count("miniddp: backward") == names.count("miniddp: forward") == 2
        gloo_threads = {s["thread"] for s in report["spans"] if s["name"] == "gloo:all_reduce"}
        ours = {s["thread"] for s in report["spans"] if s["name"].startswith("miniddp: ")}
        assert gloo_threads.isdisjoint(ours)  # gloo works on threads of its own
        # Each bucket's range runs from its launch to the end of its wait: at least as long as
        # its all-reduce, and inside its step, not on to the end of the trace.
        last = [s for s in report["spans"] if s["name"].startswith("miniddp: bucket")][
            -len(set(report["launches"])) :
        ]
        for span in last:
            comm_ms = report["last_step_comm_ms"][span["name"].removeprefix("miniddp: ")]
            assert comm_ms - 1 <= span["ms"] <= report["last_step_ms"] + 1


if __name__ == "__main__":
    profile_a_step(sys.argv[1])
