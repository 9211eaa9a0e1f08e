"""Chapter 16b: 3-D parallelism, what each rank sends. Chapter 16's GPT on the same (pp, dp, tp) =
(2, 2, 2) mesh: its messages per axis, which layout of 8 ranks wins on which link, and one step.

    NPROC=8 ./launch.sh tutorials/16b_three_d_traffic.py     (torchrun --nproc_per_node=8 ...)
    ... --link alpha=100us,bandwidth=1mbit                      the simulated link (the default)
    ... --link none                                             the quick run: nothing timed
    ... --plot DIR                                              draw this run's step in DIR

Chapter 16 counted what each rank holds. Every rank also talks, on three axes at once:

    1. what each rank sends         TP's, PP's and DP's messages in one step, counted against
                                    traffic_formula (miniddp/parallelize_formulas.py)
    2. which layout wins            the alpha-beta model prices all 8 layouts of 8 ranks on a
                                    latency-bound and a bandwidth-bound link; two are timed
    3. one step, drawn              the pipeline in ASCII; docs/figures/16_three_d.png

The figure is drawn by miniddp/instruments/figures/three_d.py
(`python -m miniddp.figures --only 16`).
tests/test_three_d_audit.py counts the messages of every layout against the same formula.

Any other number of ranks is refused, naming the command. Measured on 2 cores shared with other
jobs (load average about 30): the default run took 47 s from the first line to the last, most
of it the two layouts timed over the link, and 75 s with torchrun and 8 processes importing
torch; with --link none, 16 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import add_link_option, add_plot_option, fmt_bytes, say, say_prose, section
from three_d_setup import (
    DP_ONLY,
    FIGURE,
    THREE_D,
    WINDOWS,
    WORLD,
    Run,
    end_with_checks,
    gather,
    mesh_of,
    start,
    train,
)

from miniddp.instruments.bench.options import whole_number
from miniddp.instruments.figures import three_d
from miniddp.instruments.link_group import link_groups, simulated_link
from miniddp.models.gpt import GPTConfig
from miniddp.observe.link import Link
from miniddp.parallelize_formulas import (
    every_layout,
    messages,
    slowest_stage_seconds,
    traffic_formula,
)
from miniddp.pipeline.bubble import ascii_chart

# A network slowed to the model's scale: a ring all-reduce of DP alone's 212 KiB of gradients
# takes 3 s at 1 Mbit/s, as one of 20 GB does at 100 Gbit/s. And one where every message's
# latency costs more than its bytes.
BANDWIDTH_BOUND = "alpha=100us,bandwidth=1mbit"
LATENCY_BOUND = "alpha=1ms,bandwidth=10gbit"
ROUNDS = 3  # timed steps per layout and link, interleaved
CLEAR_WIN = 1.3  # the model's faster layout is checked only when it predicts this much of a win


def section_sends(c: GPTConfig, run: Run, dp_only: Run) -> bool:
    section("1. What each rank sends")
    m, n = THREE_D.microbatches, THREE_D.tokens
    say_prose(f"""\
        Every dist.all_reduce and every point-to-point batch a rank issues, logged with the
        axis of its group (three_d.recording_the_wire), in the step after the first (the first
        also sends shapes and orders). The formulas, per step of m = {m} microbatches of
        N = {n} tokens, for a rank of stage s holding L/p = 2 blocks:

            TP  m(4 L/p + 1) all-reduces of N·H: g twice in forward and f twice in backward a
                block (chapter 13), and the embedding's g (first stage) or the head's f (last);
                the last also 3m of N numbers: the loss's max, sum and target logit
            PP  m activations of N·H sent on (first stage) or m gradients sent back (last);
                one all-reduce of the schedule's check; one of the tied embedding's gradient,
                VH/t, over the first and last stage of the pipeline
            DP  one all-reduce of the gradients, Ψ_s, in one bucket (MiniDDP, chapter 03)

        and each all-reduce on g ranks puts 2(g - 1)/g of its bytes on a ring's wire
        (chapter 01). Per rank, counted:""")
    formula = traffic_formula(c, THREE_D, run.stage)
    same = three_d.messages_sent(run.measured.step) == messages(formula)
    mine = {
        axis: (
            sum(t.count for t in formula if t.axis == axis),
            sum(t.wire_bytes for t in formula if t.axis == axis),
        )
        for axis in ("tp", "pp", "dp")
    }
    rows = gather((tuple(run.parts.mesh.get_coordinate()), mine, same))
    say(f"  {'rank':>4} {'(pp,dp,tp)':>10}   {'TP':>19}   {'PP':>19}   {'DP':>19}   formula")
    for rank, (where, axes, equal) in enumerate(rows):
        cells = "   ".join(
            f"{axes[axis][0]:>3} msgs {fmt_bytes(axes[axis][1]):>10}" for axis in ("tp", "pp", "dp")
        )
        say(f"  {rank:>4} {str(where):>10}   {cells}   {'=' if equal else 'differs'}")
    say("  what the formula lists for a rank of each stage:")
    for number in range(THREE_D.pp):
        for traffic in traffic_formula(c, THREE_D, number):
            size = f"{traffic.elements:,} x {traffic.element_bytes} B"
            plural = "s" if traffic.count > 1 else ""
            kind = f"all-reduce{plural} on {traffic.ranks}" if traffic.ranks else f"send{plural}"
            say(
                f"    stage {number} {traffic.axis} {traffic.count:>3} {kind:<16} of "
                f"{size:<13} {traffic.what}"
            )
    alone = traffic_formula(c, DP_ONLY, 0)
    alone_same = gather(three_d.messages_sent(dp_only.measured.step) == messages(alone))
    say(
        f"  DP alone, every rank: {alone[0].count} all-reduce of {alone[0].elements:,} over "
        f"{WORLD}: {fmt_bytes(alone[0].wire_bytes)} on the wire "
        f"({'=' if all(alone_same) else 'differs from'} the formula)"
    )
    tp_count, tp_bytes = rows[0][1]["tp"]
    say_prose(f"""\
        DP alone sends the fewest messages and the most bytes: every rank the whole gradient,
        once. 3-D cuts DP's wire bytes from {fmt_bytes(alone[0].wire_bytes)} to
        {fmt_bytes(rows[0][1]["dp"][1])} (a rank holds about a quarter of the model, and a ring
        of 2 puts once its bytes on the wire where a ring of 8 puts 1.75 times), and pays with
        TP's {tp_count} messages a step ({fmt_bytes(tp_bytes)}). TP's grow with the tokens and
        wait inside every layer; DP's grow with the parameters and leave once, at the end of
        backward. PP's are few and small: one activation a microbatch, to one neighbour.""")
    return all(row[-1] for row in rows) and all(alone_same)


def fmt_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def section_layouts(c: GPTConfig, links: dict[str, Link]) -> dict[str, str]:
    section("2. Which layout wins, on which link")
    say_prose("""\
        The formulas of section 1 hold for any layout (tests/test_three_d_audit.py counts the
        messages of every layout of 4 ranks and of 8), so the alpha-beta model (chapter 01) can
        price each without running it: on a link of latency alpha and bandwidth beta each
        message costs alpha + wire bytes / beta, one after another on a rank's link; TP's and
        PP's sit inside the F's and B's, which the pipeline's fill and drain stretch by
        (m + p - 1)/m; DP's come once, at the end (link_seconds). Every layout of 8 ranks this
        GPT allows (t divides the 4 heads, p the 4 blocks; with a pipeline a microbatch is one
        window), for the slowest stage, a step:""")
    layouts = every_layout(WORLD, c, WINDOWS)
    names = list(links)
    short = [name.split("-")[0] for name in names]  # "latency", "bandwidth", "link"
    widths = [max(len(name), 9) for name in short]
    say(f"  {'':>21}{'messages and wire bytes a step, slowest stage':^48}  time on the link")
    say(
        f"  {'(pp,dp,tp)':>10} {'m':>2} {'bubble':>6}  "
        + "".join(f"{axis:<16}" for axis in ("TP", "PP", "DP"))
        + "  ".join(f"{name:>{width}} " for name, width in zip(short, widths)).rstrip()
    )
    seconds = {
        (layout, name): slowest_stage_seconds(c, layout, links[name])
        for layout in layouts
        for name in names
    }
    best = {name: min(layouts, key=lambda layout: seconds[layout, name]) for name in names}
    for layout in layouts:
        stages = [traffic_formula(c, layout, stage) for stage in range(layout.pp)]
        heaviest = max(stages, key=lambda sent: sum(t.wire_bytes for t in sent))
        cells = ""
        for axis in ("tp", "pp", "dp"):
            count = sum(t.count for t in heaviest if t.axis == axis)
            wire = sum(t.wire_bytes for t in heaviest if t.axis == axis)
            cells += f"{count:>3} {fmt_bytes(wire):>10}  "
        times = "  ".join(
            f"{fmt_seconds(seconds[layout, name]):>{width}}"
            + ("*" if best[name] == layout else " ")
            for name, width in zip(names, widths)
        )
        say(
            f"  {str(layout.shape):>10} {layout.microbatches:>2} {layout.bubble:>6.2f}  "
            f"{cells}{times}".rstrip()
        )
    for name in names:
        say(f"  * {name} ({links[name]}): {best[name].shape} sends the least time")
    say_prose("""\
        On a link where latency dominates, the fewest messages win: DP alone, one all-reduce a
        step. Where bandwidth does, the fewest bytes: pipeline stages (a few activations of
        N·H) and DP over few ranks, each holding little; TP's messages are small but many, and
        the bubble (p - 1)/(m + p - 1) is idle compute the link model does not price. Real
        machines mix links: TP inside a machine on NVLink (its column costs almost nothing
        there), PP and DP across machines; that is why the mesh puts TP on the fastest axis.""")
    return {name: str(best[name].shape) for name in names}


def timed_step(run: Run, windows: torch.Tensor, link: Link | None) -> float:
    """One training step between barriers, over `link` (None: the bare machine): the slowest
    rank's seconds, the same number on every rank."""
    dist.barrier()
    started = time.perf_counter()
    with simulated_link(link):
        run.train_step(windows)
    dist.barrier()
    seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def section_measured(
    c: GPTConfig, runs: dict[str, Run], link: Link | None, windows: torch.Tensor
) -> bool | None:
    say("")
    if link is None:
        say("  The bare machine (--link none): nothing timed; give --link to time two layouts.")
        return None
    say_prose(f"""\
        Measured: the 3-D run and DP alone, {ROUNDS} steps each on the bare machine and {ROUNDS}
        over the simulated link {link} (miniddp/instruments/link_group.py: every collective runs,
        and completes when such a link would have delivered it), interleaved. The model
        predicts the bare step plus its all-reduces' time on the link (the pipeline's sends
        cross the link too, but the model leaves them out).""")
    times: dict[str, dict[str, list[float]]] = {name: {"bare": [], "link": []} for name in runs}
    for _ in range(ROUNDS):
        for name, run in runs.items():
            times[name]["bare"].append(timed_step(run, windows, None))
            times[name]["link"].append(timed_step(run, windows, link))
    bare, measured, model = {}, {}, {}
    for name, run in runs.items():
        bare[name] = statistics.median(times[name]["bare"])
        measured[name] = statistics.median(times[name]["link"])
        model[name] = slowest_stage_seconds(c, run.layout, link, sends=False)
        say(
            f"  {name:<20} bare {fmt_seconds(bare[name]):>9}   on the link "
            f"{fmt_seconds(measured[name]):>9}   predicted "
            f"{fmt_seconds(bare[name] + model[name]):>9} (bare + {fmt_seconds(model[name])})"
        )
    three, alone = runs
    say_prose(f"""\
        Bare, the 3-D step takes {bare[three] / bare[alone]:.1f} times DP alone's here: 8
        processes share {os.cpu_count()} cores, and each of TP's small all-reduces waits until
        its partner is scheduled. The link adds {fmt_seconds(measured[three] - bare[three])}
        to it (the model: {fmt_seconds(model[three])}) and
        {fmt_seconds(measured[alone] - bare[alone])} to DP alone's (the model:
        {fmt_seconds(model[alone])}).""")
    predicted = {name: bare[name] + model[name] for name in runs}
    faster, expected = (min(values, key=values.get) for values in (measured, predicted))
    ratio = max(predicted.values()) / min(predicted.values())
    if ratio < CLEAR_WIN:
        say(
            f"  the model calls it close ({ratio:.2f}x): {faster} was faster here, unchecked "
            "on a machine this noisy"
        )
        return None
    say(f"  predicted: {expected} wins by {ratio:.1f}x; measured: {faster} wins")
    return faster == expected


def section_step(run: Run, plot: Path | None) -> list[three_d.RankStep]:
    section("3. One step, drawn")
    steps = three_d.gather_steps(run.measured.step)
    say_prose("""\
        The step of section 1 as it ran, for one pipeline (ranks 0 and 4, replica 0, shard 0):
        F and B of each microbatch, stages down, time across, '.' idle (chapter 14's picture).
        Every other pipeline ran the same order beside it:""")
    say(ascii_chart([steps[rank].blocks for rank in (0, 4)]))
    say("  per rank, ms in the step: F and B (of which TP's all-reduces), waiting, DP's all-reduce")
    computing, talking = 0.0, 0.0
    for rank_step in steps:
        busy = sum(block.duration for block in rank_step.blocks)
        tp, dp = (
            sum((e.end or e.start) - e.start for e in rank_step.wire if e.axis == axis)
            for axis in ("tp", "dp")
        )
        waiting = sum(end - start for start, end in rank_step.waits)
        computing, talking = computing + busy, talking + tp
        say(
            f"    rank {rank_step.rank} {str(tuple(rank_step.coordinate)):>9}: F and B "
            f"{busy * 1e3:6.1f} ({tp * 1e3:6.1f}), waiting {waiting * 1e3:6.1f}, DP "
            f"{dp * 1e3:5.1f}"
        )
    say_prose(f"""\
        TP's all-reduces took {talking / computing:.0%} of the ranks' F and B time here (8
        ranks on {os.cpu_count()} cores: a rank waits in each until its partner is scheduled).
        DP's one all-reduce goes out from inside the last backward, when the bucket's last
        gradient is ready, and that backward ends when it has arrived (MiniDDP's wait); the
        gradient the stage before waits for has left already (pipeline/stage.py). The
        figure ({FIGURE}, `python -m miniddp.figures --only 16`) draws the mesh beside every
        rank's step, with what each axis sent and when.""")
    if plot is not None and dist.get_rank() == 0:
        say(f"  this run's step, drawn: {three_d.mesh_and_step(steps, plot / '16_three_d.png')}")
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 16b: what each of 8 ranks sends.")
    parser.add_argument(
        "--steps", type=whole_number(at_least=2), default=2, help="AdamW steps (default 2)"
    )
    add_link_option(parser, default_link=BANDWIDTH_BOUND)
    add_plot_option(parser)
    args = parser.parse_args()
    batches, _, c, started = start("16b_three_d_traffic.py", "16b", args.steps)
    say_prose(f"""\
        Chapter 16b: what each rank sends, chapter 16's GPT on {WORLD} ranks as (pp, dp, tp) =
        {THREE_D.shape} and as DP alone {DP_ONLY.shape}, {args.steps} steps of {WINDOWS}
        windows of chapter 12's text; the second step is recorded.""")
    with link_groups():  # the runs' groups cross the link of section_measured, bare elsewhere
        run = train(THREE_D, mesh_of(THREE_D), c, batches)
        dp_only = train(DP_ONLY, mesh_of(DP_ONLY), c, batches)
        checks = {"what each axis sends = the formulas": section_sends(c, run, dp_only)}
        links = {
            "latency-bound": Link.parse(LATENCY_BOUND),
            "bandwidth-bound": Link.parse(BANDWIDTH_BOUND),
        }
        if args.link is not None and args.link not in links.values():
            links["link"] = args.link  # --link
        winners = section_layouts(c, links)
        checks["latency-bound: DP alone sends the least time"] = (
            winners["latency-bound"] == "(1, 8, 1)"
        )
        runs = {"3-D (2, 2, 2)": run, "DP alone (1, 8, 1)": dp_only}
        measured = section_measured(c, runs, args.link, batches[0])
        if measured is not None:
            checks["on the link, the model's faster layout was faster"] = measured
        steps = section_step(run, args.plot)
        checks["one pipeline step recorded on every rank"] = all(s.blocks for s in steps)

    end_with_checks(
        checks,
        started,
        "each rank sends what the formulas say on each axis, and the model's cheapest layout "
        "on a latency-bound link is DP alone.",
    )


if __name__ == "__main__":
    main()
