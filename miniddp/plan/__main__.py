"""python -m miniddp.plan: a model, a cluster, N GPUs -> the layouts that fit, best first.

    --model PRESET | --layers L --hidden H --heads A [--kv-heads G] [--ffn F] [--gated-mlp]
                     --vocab V
    --seq S --global-batch B (sequences) --gpus N --gpu a100|h100|cpu|FILE.json
    --layout tp=8,pp=16,cp=1,dp=64[,ep=..,v=..,microbatch=..,zero=..,recompute=..]
    --json PATH      {"layouts": [...]}, best first (with --layout, the one evaluated)
    --plot PATH      memory and time per term for the best layouts (a PNG)

Bad input (a layout whose product is not N, heads not divisible by tp, layers not by pp·v, a
sequence not by 2·cp, nothing that fits) is refused with the problem and the fix, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from miniddp.plan.clusters import load_cluster
from miniddp.plan.layout import BadLayout, Partial, parse_layout
from miniddp.plan.search import GiB, Plan, search, why_best
from miniddp.plan.shapes import PRESETS, Transformer

SHAPE_FLAGS = ("layers", "hidden", "heads", "vocab")


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m miniddp.plan",
        description="Predict each layout's memory and step time from the chapters' formulas.",
    )
    parser.add_argument("--model", choices=sorted(PRESETS), help="a preset shape")
    for flag in (*SHAPE_FLAGS, "kv-heads", "ffn"):
        parser.add_argument(f"--{flag}", type=int, help="the model's shape, without --model")
    parser.add_argument("--gated-mlp", action="store_true", help="SwiGLU: three MLP matmuls")
    parser.add_argument("--seq", type=int, default=2048, help="tokens a sequence (2048)")
    parser.add_argument("--global-batch", type=int, default=512, help="sequences a step (512)")
    parser.add_argument("--gpus", type=int, default=8, help="how many GPUs (8)")
    parser.add_argument("--gpu", default="h100", help="a100, h100, cpu, or a JSON file (h100)")
    parser.add_argument("--layout", help="tp=..,pp=..,cp=..,dp=..[,v=..]: the rest is chosen")
    parser.add_argument("--json", type=Path, help="write the layouts, best first, to PATH")
    parser.add_argument("--plot", type=Path, help="draw memory and time per term to PATH")
    parser.add_argument("--top", type=int, default=8, help="layouts in the table (8)")
    parser.add_argument(
        "--memory-slack",
        type=float,
        default=1.0,
        help="let memory pass by this factor (1.1 for a published layout: the memory model is "
        "checked to 10%%)",
    )
    return parser, parser.parse_args(argv)


def model_of(args: argparse.Namespace) -> Transformer:
    shape = {flag: getattr(args, flag) for flag in SHAPE_FLAGS}
    if args.model is not None:
        given = [f"--{flag}" for flag, value in shape.items() if value is not None]
        if given or args.kv_heads or args.ffn or args.gated_mlp:
            raise ValueError(
                f"--model {args.model} and shape flags ({', '.join(given) or 'others'}) both "
                "given: use one, a preset or the flags"
            )
        return PRESETS[args.model]
    missing = [f"--{flag}" for flag, value in shape.items() if value is None]
    if missing:
        raise ValueError(
            f"give --model (one of {', '.join(sorted(PRESETS))}) or the shape: "
            f"{', '.join(missing)} missing"
        )
    gated = args.gated_mlp
    return Transformer(
        "custom",
        **shape,
        kv_heads=args.kv_heads,
        ffn=args.ffn,
        gated=gated,
        biases=not gated,
        dropout=not gated,
    )


def table(plans: list[Plan], top: int) -> str:
    head = (
        f"{'tp':>3} {'pp':>3} {'cp':>3} {'dp':>5} {'v':>2} {'mb':>3} {'zero':>4} "
        f"{'recompute':>9} {'GiB':>6} {'step s':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'hw':>6} "
        f"{'MFU':>5}"
    )
    rows = [head]
    for plan in plans[:top]:
        layout = plan.layout
        rows.append(
            f"{layout.tp:>3} {layout.pp:>3} {layout.cp:>3} {layout.dp:>5} {layout.v:>2} "
            f"{layout.microbatch:>3} {layout.zero:>4} {layout.recompute:>9} "
            f"{plan.memory_bytes / GiB:>6.3g} {plan.step_s:>8.4g} {plan.tokens_per_s:>10.3g} "
            f"{plan.tflops_per_gpu():>8.4g} {plan.tflops_per_gpu('hardware'):>6.4g} "
            f"{plan.mfu:>5.1%}"
        )
    return "\n".join(rows)


def terms_text(plan: Plan) -> str:
    usable = plan.cluster.memory_bytes / GiB
    lines = [f"memory per GPU, {plan.memory_bytes / GiB:.1f} of the {usable:g} GiB usable:"]
    for term in plan.memory:
        lines.append(f"  {term.name:<16}{term.value / GiB:>8.2f} GiB  {term.why}")
        lines.append(f"  {'':<16}{'':>12}  from {term.source}")
    lines.append(f"time per step, {plan.step_s:.3f} s (exposed; hidden under compute beside):")
    for term in plan.time:
        hidden = term.value - term.exposed
        lines.append(f"  {term.name:<10}{term.exposed:>9.3f} s  (+{hidden:.3f} hidden)  {term.why}")
        lines.append(f"  {'':<10}{'':>11}  from {term.source}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(argv)
    try:
        model = model_of(args)
        cluster = load_cluster(args.gpu)
        partial = parse_layout(args.layout) if args.layout else Partial()
        for name in ("seq", "global_batch", "gpus"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if not 1.0 <= args.memory_slack <= 2.0:
            raise ValueError(f"--memory-slack {args.memory_slack}: give a factor from 1.0 to 2.0")
        batch, gpus, slack = args.global_batch, args.gpus, args.memory_slack
        plans = search(model, cluster, args.seq, batch, gpus, partial, slack)
    except (BadLayout, ValueError) as error:
        parser.error(str(error))
    if args.layout:
        plans = plans[:1]
    print(
        f"{model.name}: {model.parameters / 1e9:.3g} B parameters, {args.global_batch} sequences "
        f"of {args.seq} a step, on {args.gpus} x {cluster.name}; {len(plans)} layouts fit"
    )
    print(table(plans, args.top))
    print(f"best: {why_best(plans)}")
    print(terms_text(plans[0]))
    unverified = sorted({t.name for t in plans[0].memory + plans[0].time if not t.verified})
    print(f"terms no chapter verifies (their sources say what is assumed): {', '.join(unverified)}")
    if args.json:
        args.json.write_text(json.dumps({"layouts": [plan.as_dict() for plan in plans]}, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        from miniddp.plan.figure import draw

        draw(plans[: min(args.top, 6)], args.plot)
        print(f"drew {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
