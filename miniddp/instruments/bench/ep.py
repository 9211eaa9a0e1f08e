"""`python -m miniddp.bench ep`: expert parallelism's step, and its all-to-alls against the model.

    python -m miniddp.bench ep [--tokens 1024] [--dim 256] [--hidden 512] [--experts 8]
                               [--top-k 2] [--capacity-factor 1.25] [--iters 20]
                               [--link none --link alpha=1ms,...]

On the bare machine, then over a simulated link (miniddp/instruments/link_group.py: every send
waits for the link, alpha + bytes / bandwidth, one at a time per rank), each rank routes its
own `--tokens` tokens through one MoE layer:

    dispatch + combine  the counts' all-to-all, the rows' all-to-all out, the regrouping, and
                        the all-to-all back (the experts replaced by nothing), against the
                        alpha-beta model: for each all-to-all, every step of the pairwise
                        exchange lasts alpha + (its largest piece) beta (collectives/cost_model.py,
                        all_to_all_time, from the pieces this batch really sent). alpha and
                        beta are fitted on this machine (fit_cost_model); over the link, the
                        link's alpha and 1 / bandwidth are added to them
    ep step             forward and backward of the MoE with ExpertParallel: each rank E/W
                        experts, the tokens travelling
    dp step             the same MoE replicated, every expert on every rank, no all-to-all: what
                        expert parallelism trades memory against
    deepspeed step      DeepSpeed-MoE's layer (deepspeed.moe.layer.MoE) configured alike, with
                        the same weights (bench/deepspeed_moe.py): E SwiGLU experts over the
                        same ranks (ep_size = W), top-k gating, the same capacity factor applied
                        per rank (DeepSpeed's rule, and ours), no random token priority, no
                        sampled second expert, no minimum capacity; skipped, saying why, where
                        deepspeed is not installed or k > 2 (its gates are top-1 and top-2)

Timed interleaved (a barrier before each, the order rotated each iteration), the slowest rank's
seconds per step; ratios are medians of per-iteration ratios with 95% intervals (paired.py).
DeepSpeed's collectives go to gloo as ours do. Its gate dispatches into E x capacity slots, each
slot sent whether filled or not, where ours sends exactly the rows kept. (Its dropless mode,
drop_tokens=False, aborted gloo here with top-2: a size mismatch in its all-to-all.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from miniddp.collectives import CostModel, all_to_all_time, fit_cost_model
from miniddp.expert_parallel import ExpertParallel, MoE
from miniddp.expert_parallel.parallel import AllToAllDispatch
from miniddp.instruments.bench.deepspeed_moe import deepspeed_like, deepspeed_on_gloo
from miniddp.instruments.bench.options import add_iters_and_json, whole_number
from miniddp.instruments.bench.paired import paired_ratio, paired_ratio_interval, rotated
from miniddp.instruments.link_group import link_groups, simulated_link
from miniddp.job.env import cleanup, init_distributed
from miniddp.observe.link import Link
from miniddp.tensor_parallel import parallelize_module

VARIANTS = ("dispatch + combine", "ep step", "dp step", "deepspeed step")
DEFAULT_LINK = "alpha=1ms,bandwidth=1gbit"


def deepspeed_moe(moe: MoE) -> tuple[nn.Module | None, str]:
    """DeepSpeed-MoE's layer configured as `moe`, with its weights, and its version; or None,
    and why not."""
    if moe.top_k > 2:
        return None, f"its gates are top-1 and top-2, not top-{moe.top_k}"
    deepspeed = deepspeed_on_gloo()
    if deepspeed is None:
        return None, "not installed (pip install deepspeed)"
    return deepspeed_like(moe, dist.get_world_size()), f"deepspeed {deepspeed.__version__}"


class Case:
    """This rank's tokens, the two MoEs (split and replicated, the same weights), and the rows
    and counts the split one dispatches."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        options = {"capacity_factor": args.capacity_factor}
        self.replicated = MoE(args.dim, args.hidden, args.experts, args.top_k, **options)
        self.split = MoE(args.dim, args.hidden, args.experts, args.top_k, **options)
        self.split.load_state_dict(self.replicated.state_dict())
        parallelize_module(self.split.experts, dist.group.WORLD, ExpertParallel())
        g = torch.Generator().manual_seed(dist.get_rank())
        self.x = torch.randn(args.tokens, args.dim, generator=g)
        with torch.no_grad():
            routed = self.split.router(self.x).experts
        kept = self.split.within_capacity(routed).reshape(-1)
        choices = routed.reshape(-1)[kept]
        order = torch.argsort(choices, stable=True)
        self.rows = self.x[kept.nonzero().squeeze(1)[order] // args.top_k]
        self.counts = torch.bincount(choices, minlength=args.experts)
        self.dispatch = self.split.experts.dispatch
        assert isinstance(self.dispatch, AllToAllDispatch)
        self.deepspeed, self.deepspeed_version = deepspeed_moe(self.replicated)

    def dispatch_and_combine(self) -> None:
        self.dispatch(lambda rows, counts: rows, self.rows, self.counts)

    def ep_step(self) -> None:
        self.split.zero_grad()
        self.split(self.x).sum().backward()

    def dp_step(self) -> None:
        self.replicated.zero_grad()
        self.replicated(self.x).sum().backward()

    def deepspeed_step(self) -> None:
        assert self.deepspeed is not None
        self.deepspeed.zero_grad()
        self.deepspeed(self.x)[0].sum().backward()

    def sent(self) -> torch.Tensor:
        """[s, d]: rows rank s sends rank d in this batch's dispatch, gathered from all."""
        world_size = dist.get_world_size()
        mine = self.counts.view(world_size, -1).sum(1)
        every = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(every, mine)
        return torch.stack(every)


def predicted_seconds(model: CostModel, case: Case, args: argparse.Namespace) -> float:
    """The counts' all-to-all (E/W int64 a piece) and the rows' there and back."""
    world_size = dist.get_world_size()
    counts = torch.full((world_size, world_size), args.experts // world_size)
    sent = case.sent()
    row_bytes = args.dim * 4
    return (
        all_to_all_time(model, 8, counts)
        + all_to_all_time(model, row_bytes, sent)
        + all_to_all_time(model, row_bytes, sent.T)
    )


def measure(args: argparse.Namespace, case: Case, link: Link | None, bare: CostModel) -> dict:
    model = bare
    if link is not None:
        model = CostModel(bare.alpha + link.alpha, bare.beta + 1 / link.bandwidth)
    run = (case.dispatch_and_combine, case.ep_step, case.dp_step, case.deepspeed_step)
    steps = {n: step for n, step in zip(VARIANTS, run) if case.deepspeed or n != "deepspeed step"}
    variants = list(steps)
    with simulated_link(link):
        for step in steps.values():
            step()  # warm-up
        seconds = torch.zeros(len(variants), args.iters, dtype=torch.float64)
        for iteration in range(args.iters):
            for name in rotated(variants, iteration):
                dist.barrier()
                start = time.perf_counter()
                steps[name]()
                seconds[variants.index(name), iteration] = time.perf_counter() - start
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    times = {name: seconds[i].tolist() for i, name in enumerate(variants)}
    predicted = predicted_seconds(model, case, args)
    ratios = {}
    pairs = {"ep / dp": ("ep step", "dp step"), "ep / deepspeed": ("ep step", "deepspeed step")}
    for label, (a, b) in pairs.items():
        if b not in times:
            continue
        low, high = paired_ratio_interval(times[a], times[b])
        ratios[label] = {"ratio": paired_ratio(times[a], times[b]), "interval": [low, high]}
    measured = statistics.median(times["dispatch + combine"])
    return {
        "link": str(link) if link else "none",
        "deepspeed": case.deepspeed_version,
        "model": {"alpha": model.alpha, "beta": model.beta},
        "times": times,
        "median_ms": {name: statistics.median(t) * 1e3 for name, t in times.items()},
        "dispatch_combine_predicted_ms": predicted * 1e3,
        "measured_over_model": measured / predicted,
        "ratios": ratios,
    }


def report(result: dict) -> None:
    where = (
        "the bare machine" if result["link"] == "none" else f"a simulated link ({result['link']})"
    )
    alpha, beta = result["model"]["alpha"], result["model"]["beta"]
    print(f"\non {where}: model alpha {alpha * 1e6:.0f} us, {1e-9 / beta:.2f} GB/s")
    if "deepspeed step" not in result["times"]:
        print(f"  (DeepSpeed-MoE left out: {result['deepspeed']})")
    for name, ms in result["median_ms"].items():
        print(f"  {name:<19} {ms:9.2f} ms")
    predicted = result["dispatch_combine_predicted_ms"]
    print(
        f"  dispatch + combine, the model: {predicted:.2f} ms; measured / model "
        f"{result['measured_over_model']:.2f}x"
    )
    for label, ratio in result["ratios"].items():
        low, high = ratio["interval"]
        print(f"  {label:<19} {ratio['ratio']:.2f}x  [{low:.2f}, {high:.2f}]")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m miniddp.bench ep", description=__doc__)
    count = whole_number(at_least=1)
    parser.add_argument("--tokens", type=count, default=1024, help="per rank (default 1024)")
    parser.add_argument("--dim", type=count, default=256)
    parser.add_argument("--hidden", type=count, default=512)
    parser.add_argument("--experts", type=count, default=8)
    parser.add_argument("--top-k", type=count, default=2)
    parser.add_argument(
        "--capacity-factor", type=float, default=1.25, help="per rank, as DeepSpeed (default 1.25)"
    )
    parser.add_argument(
        "--link",
        type=Link.parse,
        action="append",
        help=f"'none' or e.g. {DEFAULT_LINK}; repeat to run several (default: none, then "
        f"{DEFAULT_LINK})",
    )
    add_iters_and_json(parser, 20)
    args = parser.parse_args(argv)
    if not args.capacity_factor > 0:
        parser.error(f"--capacity-factor must be > 0, got {args.capacity_factor}")
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} is more than --experts {args.experts}")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    env = init_distributed()
    torch.set_num_threads(1)  # the ranks share the cores
    if args.experts % env.world_size:
        raise SystemExit(f"--experts {args.experts} must be a multiple of {env.world_size} ranks")
    bare = fit_cost_model()
    links = args.link or [None, Link.parse(DEFAULT_LINK)]
    with link_groups():  # the case's groups cross each link in turn
        case = Case(args)
        results = [measure(args, case, link, bare) for link in links]
    if env.is_main:
        print(
            f"one MoE layer, {args.tokens} tokens a rank, dim {args.dim}, hidden {args.hidden}, "
            f"{args.experts} experts, top-{args.top_k}, capacity factor {args.capacity_factor}, "
            f"float32, W = {env.world_size}; "
            f"{args.iters} interleaved steps, medians; DeepSpeed-MoE: {case.deepspeed_version}"
        )
        for result in results:
            report(result)
        if args.json:
            with open(args.json, "w") as file:
                settings = vars(args) | {"link": [r["link"] for r in results]}
                json.dump({"settings": settings, "runs": results}, file, indent=2)
            print(f"wrote {args.json}")
    dist.barrier()
    cleanup()
