"""`python -m miniddp.bench step`: a training step under every design, against torch's DDP.

Every variant (variants.py, beside this file) lives in the same pair of processes, on its own
copy of the same model (workloads.py), and is timed interleaved and paired with torch's DDP at
the same caps (paired.py); a step's time is the slowest rank's.

A step is: gradients set to None (what `optimizer.zero_grad()` does), forward, loss, backward,
`finish_gradient_synchronization()`; it ends with gradients averaged (the naive rung averages in
that last call, every other design before `backward()` returns). The optimizer is left out: it
costs every variant the same. CPU time is the process's (the training thread and gloo's), summed
over ranks. Overlap and tail come from separate, recorded iterations after the timed ones
(recording is cheap, but the timed steps pay nothing for it).

    python -m miniddp.bench step                                  # everything, ~3-5 minutes
    python -m miniddp.bench step --models mlp --variants miniddp-1,deferred-1,torch-1 --iters 20
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from miniddp.instruments.bench import backend_for
from miniddp.instruments.bench.options import (
    add_link_option,
    link_or_environment,
    whole_number,
    writable_file,
    writable_folder,
)
from miniddp.instruments.bench.paired import (
    SAME_SPEED_AS_TORCH,
    paired_ratio,
    paired_ratio_interval,
    quantile,
    step,
    time_interleaved,
)
from miniddp.instruments.bench.variants import VARIANT_HELP, VARIANTS
from miniddp.instruments.bench.workloads import Workload, workloads
from miniddp.instruments.link_group import simulated_link
from miniddp.instruments.timeline_views import write_chrome_trace
from miniddp.job.env import cleanup, init_distributed
from miniddp.observe.timeline import gather, recording, split_steps, summarize


def record_overlap(
    models: dict[str, nn.Module], workload: Workload, iters: int, trace_dir: str | None
) -> dict[str, list[dict[str, float]]]:
    """Recorded steps of every variant that notes events; summaries from every rank."""
    recordable = {n: m for n, m in models.items() if hasattr(m, "observer")}
    summaries: dict[str, list[dict[str, float]]] = {name: [] for name in recordable}
    for name, model in recordable.items():
        params = [p for p in model.parameters() if p.requires_grad]
        with recording(model, profiler_spans=False) as events:
            for _ in range(iters):
                dist.barrier()
                step(model, params, workload)
        steps = gather(split_steps(events, dist.get_rank()))
        for one in steps:
            summary = summarize(one)
            summaries[name].append(
                {**vars(summary), "overlap": summary.overlap, "buckets": len(one.buckets)}
            )
        if trace_dir and dist.get_rank() == 0:
            os.makedirs(trace_dir, exist_ok=True)
            write_chrome_trace(steps, os.path.join(trace_dir, f"{workload.name}-{name}.json"))
    return summaries


def run_workload(workload: Workload, variant_names: list[str], args: argparse.Namespace) -> dict:
    models = {name: VARIANTS[name][0](workload.build().to(args.device)) for name in variant_names}
    workload = replace(workload, batch=tuple(t.to(args.device) for t in workload.batch))
    local = time_interleaved(models, workload, args.iters)
    overlap = record_overlap(models, workload, args.trace_iters, args.trace_dir)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    reference = workload.build()
    tensors = [p for p in reference.parameters() if p.requires_grad]
    del models
    return {
        "model": workload.name,
        "what": workload.what,
        "parameters": sum(p.numel() for p in tensors),
        "tensors": len(tensors),
        "iters": args.iters,
        "tokens": workload.tokens * dist.get_world_size(),
        "wall_s": {n: _max_over_ranks(everyone, n, "wall") for n in variant_names},
        "cpu_s": {n: _sum_over_ranks(everyone, n, "cpu") for n in variant_names},
        "overlap": overlap,
    }


def _max_over_ranks(everyone: list, name: str, key: str) -> list[float]:
    return [max(values) for values in zip(*(rank[name][key] for rank in everyone))]


def _sum_over_ranks(everyone: list, name: str, key: str) -> list[float]:
    return [sum(values) for values in zip(*(rank[name][key] for rank in everyone))]


def statistics_of(result: dict) -> dict[str, dict[str, float]]:
    """Per variant: median and quartiles of the step time, paired ratios, CPU, overlap."""
    wall, cpu = result["wall_s"], result["cpu_s"]
    rows = {}
    for name, seconds in wall.items():
        reference = VARIANTS[name][1]
        recorded = result["overlap"].get(name, [])
        row = {
            "median_ms": statistics.median(seconds) * 1e3,
            "p25_ms": quantile(seconds, 0.25) * 1e3,
            "p75_ms": quantile(seconds, 0.75) * 1e3,
            "cpu_ms": statistics.median(cpu[name]) * 1e3,
            "reference": reference,
        }
        if reference in wall:
            row["vs_reference"] = paired_ratio(seconds, wall[reference])
            row["cpu_vs_reference"] = paired_ratio(cpu[name], cpu[reference])
        if recorded:
            overlaps = [s["overlap"] for s in recorded if not math.isnan(s["overlap"])]
            row["overlap"] = statistics.median(overlaps) if overlaps else math.nan
            row["tail_ms"] = statistics.median(s["tail_s"] for s in recorded) * 1e3
            row["buckets"] = max(s["buckets"] for s in recorded)
        rows[name] = row
    return rows


def format_table(result: dict, rows: dict[str, dict[str, float]]) -> str:
    lines = [
        f"\n{result['model']}: {result['what']}; {result['iters']} interleaved iterations",
        f"{'variant':<13} {'median':>8} {'p25-p75':>15} {'vs torch':>16} {'CPU':>8} "
        f"{'CPU vs':>7} {'overlap':>7} {'tail':>7}",
        f"{'':<13} {'ms':>8} {'ms':>15} {'(paired median)':>16} {'ms':>8} {'torch':>7} "
        f"{'':>7} {'ms':>7}",
    ]
    for name, row in rows.items():
        spread = f"{row['p25_ms']:.1f}-{row['p75_ms']:.1f}"
        versus = (
            f"{row['vs_reference']:.3f}x {row['reference']}"
            if "vs_reference" in row and row["reference"] != name
            else "-"
        )
        cpu_versus = f"{row['cpu_vs_reference']:.3f}" if "cpu_vs_reference" in row else "-"
        if row["reference"] == name:
            cpu_versus = "-"
        overlap = f"{row['overlap']:.2f}" if not math.isnan(row.get("overlap", math.nan)) else "-"
        tail = f"{row['tail_ms']:.1f}" if "tail_ms" in row else "-"
        lines.append(
            f"{name:<13} {row['median_ms']:8.1f} {spread:>15} {versus:>16} "
            f"{row['cpu_ms']:8.1f} {cpu_versus:>7} {overlap:>7} {tail:>7}"
        )
    return "\n".join(lines + tokens_per_second(result))


def tokens_per_second(result: dict) -> list[str]:
    """A language model's rate, all ranks together: MiniDDP's against torch's DDP as a paired
    ratio (the inverse of their step times'), with its 95% interval."""
    wall = result["wall_s"]
    if not result.get("tokens") or "miniddp" not in wall or "torch" not in wall:
        return []
    rate = {name: result["tokens"] / statistics.median(wall[name]) for name in ("miniddp", "torch")}
    low, high = paired_ratio_interval(wall["torch"], wall["miniddp"])
    ratio = paired_ratio(wall["torch"], wall["miniddp"])
    return [
        f"tokens/s: miniddp {rate['miniddp']:,.0f}, torch {rate['torch']:,.0f}; "
        f"miniddp / torch {ratio:.3f} (95% interval {low:.3f}-{high:.3f})"
    ]


# Overlap and the ablations (deferred, naive) are figures in the table above, not targets: they
# describe the design, not a promise about speed. The one target is SAME_SPEED_AS_TORCH.


def targets(results: list[dict]) -> list[dict]:
    """Every MiniDDP variant against torch's DDP at the same settings, wall and CPU time: its
    paired median must be at most SAME_SPEED_AS_TORCH."""
    wanted = []  # (model, what, value, interval)
    for result in results:
        model, wall, rows = result["model"], result["wall_s"], result["rows"]
        for name, row in rows.items():
            theirs = row.get("reference")
            if not name.startswith("miniddp") or theirs is None or theirs not in wall:
                continue
            value = paired_ratio(wall[name], wall[theirs])
            interval = paired_ratio_interval(wall[name], wall[theirs])
            wanted.append((model, f"{name} / {theirs}", value, interval))
            if "cpu_vs_reference" in row:
                interval = paired_ratio_interval(result["cpu_s"][name], result["cpu_s"][theirs])
                wanted.append((model, f"CPU {name} / {theirs}", row["cpu_vs_reference"], interval))
    return [
        {
            "model": model,
            "what": what,
            "value": value,
            "target": f"<= {SAME_SPEED_AS_TORCH}",
            "met": value <= SAME_SPEED_AS_TORCH,
            "interval95": interval,
        }
        for model, what, value, interval in wanted
    ]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m miniddp.bench step",
        description="A training step: baselines, MiniDDP and torch's DDP, interleaved.",
        epilog="variants: " + "; ".join(f"{name}: {what}" for name, what in VARIANT_HELP.items()),
    )
    parser.add_argument(
        "--models",
        default="mlp,transformer,deep",
        help="comma-separated: mlp, transformer, deep, gpt",
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated (default: all)"
    )
    parser.add_argument(
        "--iters",
        type=whole_number(at_least=1),
        default=60,
        help="timed iterations (default 60: a 95%% interval of about +-3%% on a quiet machine)",
    )
    parser.add_argument(
        "--trace-iters",
        type=whole_number(at_least=0),
        default=5,
        help="recorded iterations per variant, for overlap and tail (default 5; 0: none)",
    )
    parser.add_argument(
        "--trace-dir", type=writable_folder, help="write a Chrome trace per model and variant here"
    )
    parser.add_argument(
        "--json", metavar="PATH", type=writable_file, help="also write every figure here"
    )
    add_link_option(parser, "every variant", "the bare machine")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where models and batches live (default cpu, over gloo); cuda: over NCCL when each "
        "rank has a GPU of its own, else over gloo, ranks sharing the GPUs",
    )
    args = parser.parse_args(argv)
    link_or_environment(parser, args)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device (torch.cuda.is_available() is False)")
    args.models = args.models.split(",")
    args.variants = args.variants.split(",")
    unknown_models = [m for m in args.models if m not in ("mlp", "transformer", "deep", "gpt")]
    if unknown_models:
        named = ", ".join(map(repr, unknown_models))
        parser.error(f"--models: unknown {named}; choose from mlp, transformer, deep, gpt")
    unknown_variants = [v for v in args.variants if v not in VARIANTS]
    if unknown_variants:
        named = ", ".join(map(repr, unknown_variants))
        parser.error(f"--variants: unknown {named}; choose from {', '.join(VARIANTS)}")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    env = init_distributed(backend=backend_for(args.device))
    if args.device == "cuda":
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())  # "cuda" means this one
    torch.set_num_threads(1)  # one intra-op thread per rank: the ranks share the cores
    say = print if env.is_main else (lambda *_, **__: None)
    if env.world_size < 2:
        raise SystemExit("run with at least 2 ranks: there is nothing to communicate with one")
    load_before = os.getloadavg()
    say(
        f"training step, {env.world_size} ranks, backend {env.backend} on {args.device}, "
        f"{torch.get_num_threads()} compute thread per rank, {os.cpu_count()} cores, "
        f"load average {load_before[0]:.2f}; link: {args.link or 'none, the bare machine'}",
        flush=True,
    )
    # Every variant is compared with torch at the same settings: add those that were left out.
    variants = list(dict.fromkeys(args.variants + [VARIANTS[v][1] for v in args.variants]))
    all_workloads = workloads(env.rank)
    results = []
    for model_name in args.models:
        with simulated_link(args.link):
            result = run_workload(all_workloads[model_name], variants, args)
        result["rows"] = statistics_of(result)
        results.append(result)
        say(format_table(result, result["rows"]), flush=True)
    checks = targets(results)
    load_after = os.getloadavg()
    say("\ntargets (paired medians over iterations, with their 95% confidence interval)")
    for c in checks:
        low, high = c["interval95"] or (math.nan, math.nan)
        interval = f"{low:.3f}-{high:.3f}" if c["interval95"] else ""
        say(
            f"  {c['model']:<12} {c['what']:<30} {c['value']:7.3f} {interval:>13}  "
            f"{c['target']:<8} {'met' if c['met'] else 'NOT met'}"
        )
    say(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1-minute)")
    if env.is_main and args.json:
        report = {
            "world_size": env.world_size,
            "backend": env.backend,
            "device": args.device,
            "machine": platform.platform(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "load_average_before": load_before,
            "load_average_after": load_after,
            "link": str(args.link) if args.link else None,
            "results": results,
            "targets": checks,
        }
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)
        say(f"wrote {args.json}")
    cleanup()
