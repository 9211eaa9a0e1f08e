"""Chapter 17: from a laptop to 16,000 GPUs. The formulas the chapters verified, with a GPU's
constants in place of this machine's: which layouts fit a real model on a real cluster, which
wins, and why.

    python tutorials/17_scale.py          (one process; under torchrun only rank 0 runs it)

Everything here comes from `miniddp.plan` (read miniddp/plan/__init__.py first): a layout's
memory and step time, term by term, each term the library's formula with the chapter that
verifies it (or a note that none does). Its two constants per GPU were fitted on four published
runs only, and it predicts 18 others within 11% (tests/test_plan_published.py).

    1. the toy, measured          chapter 12's GPT in this process, beside the plan's terms
    2. GPT-3 175B, 1,024 A100s    which layouts fit, which wins, every term of the best
    3. Llama 3 70B, 1,024 H100s   the same, with 2024's software
    4. MFU                        predicted, beside the published development set
    5. the questions learners ask why TP stays in a node, why PP grows with the model, when
                                  ZeRO-3 beats PP, what context parallelism costs at 128k
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import replace

import torch
from common import say, say_prose, section
from torch.nn import functional as F

from miniddp.models.gpt import GPT, GPTConfig
from miniddp.plan import Layout, Partial, evaluate, search
from miniddp.plan.calibrate import DEVELOPMENT
from miniddp.plan.clusters import A100, H100, measured_cpu
from miniddp.plan.search import GiB, Plan, why_best
from miniddp.plan.shapes import PRESETS

TOY_BATCH, TOY_STEPS = 16, 5  # chapter 12's defaults: 16 windows of 64 characters
GPT3_RUN = dict(seq=2048, batch=1536, gpus=1024)  # GPT-3's 3.2M tokens a step (Brown et al.)
LLAMA_RUN = dict(seq=8192, batch=1024, gpus=1024)  # 8M tokens a step
LONG_RUN = dict(seq=131_072, batch=64, gpus=1024)  # the same 8M tokens, 128k at a time
TIME_TERMS = ("compute", "bubble", "tp", "cp", "pp", "dp", "optimizer")
MEMORY_TERMS = ("parameters", "gradients", "optimizer_state", "compute_copies", "activations")


def show_terms(plan: Plan, printed: set[str]) -> None:
    """Every term of one plan, memory then time, and whether a chapter verifies it."""
    say(f"  {plan.layout}: {plan.memory_bytes / GiB:.1f} GiB, {plan.step_s:.2f} s a step")
    for term in plan.memory:
        mark = "" if term.verified else "  (no chapter verifies it)"
        say(f"    {term.name:<16}{term.value / GiB:>7.2f} GiB{mark}")
        printed.add(term.name)
    for term in plan.time:
        mark = "" if term.verified else "  (no chapter verifies it)"
        hidden = term.value - term.exposed
        say(f"    {term.name:<16}{term.exposed:>7.3f} s  +{hidden:.3f} s hidden{mark}")
        printed.add(term.name)


def show_top(plans: list[Plan], count: int = 4) -> None:
    say(f"  {'layout':<62} {'GiB':>5} {'step s':>7} {'TFLOP/s':>8} {'MFU':>5}")
    for plan in plans[:count]:
        say(
            f"  {str(plan.layout):<62} {plan.memory_bytes / GiB:>5.1f} {plan.step_s:>7.2f} "
            f"{plan.tflops_per_gpu():>8.1f} {plan.mfu:>5.1%}"
        )


def section_toy(checks: dict[str, bool], printed: set[str]) -> None:
    section("1. The toy: chapter 12's GPT in this process, measured beside the plan")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = PRESETS["chapter12"]
    config = GPTConfig(model.vocab, 64, model.hidden, model.layers, model.heads, dropout=0.0)
    gpt = GPT(config)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-3)
    windows = torch.randint(model.vocab, (TOY_BATCH, 65))
    seconds = []
    for step in range(TOY_STEPS + 1):  # the first warms up, uncounted
        start = time.perf_counter()
        logits = gpt(windows[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start) if step else None
    measured = statistics.median(seconds)
    cpu = measured_cpu()
    plan = evaluate(model, cpu, Layout(1, 1, 1, 1, zero=0), 64, TOY_BATCH, 1)
    say_prose(f"""\
        The plan knows this machine by two numbers it measures: a matmul's FLOP/s at the
        chapter's shapes ({cpu.peak_flops / 1e9:.1f} GFLOP/s on one thread) and chapter 16's
        simulated link. One process of chapter 12's GPT, {TOY_BATCH} windows of 64 a step:""")
    show_terms(plan, printed)
    ratio = measured / plan.step_s
    say_prose(f"""\
        Measured: {measured * 1e3:.0f} ms a step (median of {TOY_STEPS}), {ratio:.2f}x the
        plan's {plan.step_s * 1e3:.0f} ms. The gap is what the plan leaves out at this size:
        Python and torch's dispatch around each small op, and the elementwise kernels (the
        CPU has no HBM term). On a GPU the second constant, fitted, carries them; at 16,000
        GPUs the matmuls are large enough that their share is small.""")
    checks["the toy's every time term printed"] = all(t in printed for t in TIME_TERMS)
    checks["the toy's measured step is a finite multiple of the plan's"] = 0 < ratio < 1e3


def section_cluster(
    title: str, model_name: str, cluster, run: dict, checks: dict, printed: set[str]
) -> Plan:
    section(title)
    model = PRESETS[model_name]
    plans = search(model, cluster, run["seq"], run["batch"], run["gpus"])
    say(
        f"  {model.parameters / 1e9:.0f} B parameters, {run['batch']} sequences of "
        f"{run['seq']}: {len(plans)} layouts fit, the fastest:"
    )
    show_top(plans)
    say(f"  why: {why_best(plans)}")
    show_terms(plans[0], printed)
    checks[f"{model_name}: every layout called fitting is within 80 GiB"] = all(
        plan.memory_bytes <= 80 * GiB for plan in plans
    )
    checks[f"{model_name}: every term of the best printed"] = all(
        t in printed for t in (*TIME_TERMS, *MEMORY_TERMS)
    )
    return plans[0]


def section_mfu(gpt3: Plan, llama: Plan, checks: dict[str, bool]) -> None:
    section("4. MFU: predicted, beside the published development set")
    say("  the four published runs the constants were fitted on (each its own FLOP count):")
    for gpu, rows in DEVELOPMENT.items():
        preset = A100 if gpu == "a100" else H100
        for row in rows:
            predicted = row.predicted_tflops(preset)
            published = row.tflops_per_gpu
            say(
                f"    {gpu} {row.model.name:>5} on {row.gpus:>5}: published {published:>6.1f}"
                f" TFLOP/s ({published * 1e12 / preset.peak_flops:.0%}), plan {predicted:>6.1f}"
            )
    say_prose(f"""\
        And the two plans above: GPT-3 175B at {gpt3.mfu:.0%} MFU on A100s
        ({gpt3.tflops_per_gpu():.0f} model TFLOP/s), Llama 3 70B at {llama.mfu:.0%} on H100s.
        The fit reproduces its four rows by construction; the test is the 18 it never saw
        (tests/test_plan_published.py: median 4.7%, at most 10.7%).""")
    checks["MFU between 20% and 70% for both plans"] = all(0.2 < p.mfu < 0.7 for p in (gpt3, llama))


def section_questions(checks: dict[str, bool]) -> None:
    section("5. The questions learners ask, answered with numbers")
    llama = PRESETS["llama3-70b"]
    run = (LLAMA_RUN["seq"], LLAMA_RUN["batch"], LLAMA_RUN["gpus"])
    gpt3 = (PRESETS["gpt3-175b"], H100, GPT3_RUN["seq"], GPT3_RUN["batch"], GPT3_RUN["gpus"])
    inside, across = (search(*gpt3, Partial(tp=t, cp=1))[0] for t in (8, 16))
    tp_inside, tp_across = (next(t for t in p.time if t.name == "tp") for p in (inside, across))
    say_prose(f"""\
        Why TP stays inside a node. TP all-reduces every layer's activations 4 times a
        microbatch, on the critical path. GPT-3 175B on 1,024 H100s: tp = 8 on NVLink exposes
        {tp_inside.exposed:.2f} s a step; tp = 16 crosses the network at an eighth of the
        bandwidth and exposes {tp_across.exposed:.2f} s, a step of {across.step_s:.2f} s against
        {inside.step_s:.2f}. (Llama 3 70B cannot even try: tp must divide its 8 key/value
        heads.)""")
    checks["TP across nodes exposes more than TP inside one"] = (
        tp_across.exposed > tp_inside.exposed
    )

    pipelines = {}
    for name in ("llama3-8b", "llama3-70b", "llama3-405b"):
        pipelines[name] = search(PRESETS[name], H100, *run, Partial(tp=8, cp=1, zero=1))[0]
    listed = ", ".join(f"{n}: pp = {p.layout.pp}" for n, p in pipelines.items())
    say_prose(f"""\
        Why PP grows with the model. With tp = 8, a GPU must hold its 1/(8·pp) of the layers'
        states and the activations 1F1B keeps; the bubble, (p-1)/(vm+p-1), costs little while
        v·m is large. Best pp on 1,024 H100s: {listed}.""")
    pps = [p.layout.pp for p in pipelines.values()]
    checks["the best pp grows with the model"] = pps == sorted(pps) and pps[0] < pps[-1]

    sharded = replace(H100, max_zero=3)  # fully_shard, as chapter 11 builds it
    zero3 = search(llama, sharded, *run, Partial(pp=1, zero=3, cp=1))[0]
    piped = search(llama, sharded, *run, Partial(zero=1, cp=1))[0]
    winner = "ZeRO-3" if zero3.step_s < piped.step_s else "the pipeline"
    say_prose(f"""\
        When ZeRO-3 beats PP. ZeRO-3 gathers each layer's parameters twice a microbatch and
        reduce-scatters its gradient; prefetched, those hide under compute while a layer's
        compute outlasts its gather (chapter 11's model). Llama 3 70B, 8M tokens on 1,024
        H100s: ZeRO-3 without a pipeline {zero3.step_s:.2f} s ({zero3.layout}), the best
        pipeline with ZeRO-1 {piped.step_s:.2f} s ({piped.layout}): {winner} wins here, with
        {zero3.layout.dp} replicas whose gathers cross the network against a bubble of
        {next(t.exposed for t in piped.time if t.name == "bubble"):.2f} s.""")
    checks["ZeRO-3 and PP both priced"] = zero3.step_s > 0 and piped.step_s > 0

    long = (LONG_RUN["seq"], LONG_RUN["batch"], LONG_RUN["gpus"])
    without = min(
        (
            evaluate(llama, H100, layout, *long)
            for layout in (Layout(8, 8, 1, 16, v=5, zero=1), Layout(8, 16, 1, 8, v=5, zero=1))
        ),
        key=lambda plan: plan.memory_bytes,
    )
    best = search(llama, H100, *long, Partial(tp=8))[0]
    cp_term = next(t for t in best.time if t.name == "cp")
    say_prose(f"""\
        What CP costs at 128k tokens. One 131,072-token sequence keeps {
        without.memory_bytes / GiB:.0f} GiB a GPU without context parallelism ({
        without.layout
    }): it does not fit
        in 80. The best layout splits it over cp = {best.layout.cp} ({best.layout}): the ring
        moves K and V, {cp_term.value:.2f} s a step of which {cp_term.exposed:.3f} s shows,
        because a hop's transfer is shorter than a block's s² scores (chapter 15).""")
    checks["128k tokens: no CP does not fit, CP does"] = (
        not without.fits and best.fits and best.layout.cp > 1
    )


def main() -> None:
    if os.environ.get("RANK", "0") != "0":
        sys.exit(0)  # one process is the chapter; torchrun's others have nothing to do
    started = time.perf_counter()
    say_prose("""\
        Chapter 17: from a laptop to 16,000 GPUs. The plan (miniddp.plan) prices a layout term
        by term with the formulas chapters 01-15 verified; here its constants become a GPU's.""")
    checks: dict[str, bool] = {}
    printed: set[str] = set()
    section_toy(checks, printed)
    gpt3 = section_cluster(
        "2. GPT-3 175B on 1,024 A100s (Megatron-LM 2021's software)",
        "gpt3-175b",
        A100,
        GPT3_RUN,
        checks,
        set(),
    )
    llama = section_cluster(
        "3. Llama 3 70B on 1,024 H100s (Megatron-Core 2024's software)",
        "llama3-70b",
        H100,
        LLAMA_RUN,
        checks,
        set(),
    )
    section_mfu(gpt3, llama, checks)
    section_questions(checks)
    section("Checks")
    for name, passed in checks.items():
        say(f"  {'ok ' if passed else 'FAILED'} {name}")
    assert all(checks.values()), [name for name, passed in checks.items() if not passed]
    seconds = time.perf_counter() - started
    say(f"Verified in {seconds:.0f} s: every term printed, every claim checked.")


if __name__ == "__main__":
    main()
