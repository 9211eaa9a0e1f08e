"""`python -m miniddp.bench compose`: the 3-D step (pipeline x data x tensor parallelism) of
MiniDDP's pieces against torch's own composition, on the same GPT, the same mesh, the same batch.

    python -m miniddp.bench compose                  # (pp, dp, tp) = (2, 2, 2) on 8 ranks
    torchrun --standalone --nproc_per_node=4 -m miniddp.bench compose --mesh 2,1,2

The default, 8 ranks, 20 interleaved steps on the bare machine then over a 1 ms link, takes
about 2 minutes on 2 shared cores. Run plainly, it relaunches itself on 8 ranks; another mesh
size runs under torchrun with its own number of ranks.

ours     miniddp.mesh.init_device_mesh, then miniddp.parallelize.parallelize(GPT, mesh,
         data_parallel="ddp"): TP (miniddp.tensor_parallel), the pipeline split (GPTStage,
         miniddp.pipeline's PipelineStage and Schedule1F1B), MiniDDP over mesh["dp"], and the
         tied embedding's gradient summed over the first and last stage.
torch's  torch.distributed.device_mesh.init_device_mesh; parallelize_module with ColwiseParallel
         and RowwiseParallel on the same modules (the GPT's qkv rows go head by head, so a
         colwise qkv keeps whole heads; the embedding Rowwise with Replicate token ids); the
         same GPTStage split, its parameters DTensors; torch's DDP over mesh["dp"], after
         `_pre_dp_module_transform` (torch's own bridge from TP to DDP); pipelining's
         PipelineStage and Schedule1F1B. The loss is torch's `loss_parallel`: the head's logits
         stay sharded by vocabulary, as ours go to `vocab_parallel_cross_entropy`. torch has no
         tie across stages: the same all-reduce of the two copies' gradients, by hand.

Both send the same collectives (per step and rank, 22 or 34 all-reduces and 4 sends at the
default), with one more on ours: the pipeline schedule's all-reduce that checks every stage was
called alike. Both run on gloo. Before and after timing, a step of each on the same windows:
the losses and every gradient must agree within rounding, else the benchmark stops. Dropout
is 0, so neither side draws. Timed: forward and backward of every microbatch, gradients
complete (the tie included), no optimizer; interleaved (the order rotated each iteration, a
barrier before each step). A step lasts as long as its slowest rank, and costs the CPU time of
all ranks together (on a machine with fewer cores than ranks, the two go together). Reported:
the median of the per-iteration ratios ours / torch's with its 95% interval
(miniddp/instruments/bench/paired.py).

    --link none                      the bare machine: gloo over loopback
    --link alpha=1ms,bandwidth=1gbit every collective and activation crosses a simulated link:
                                     the process group of
                                     miniddp.instruments.link_group.simulated_link, which torch's
                                     DDP, DTensor and pipelining call like any other
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from miniddp.instruments.bench.options import (
    add_gpt_options,
    add_iters_and_json,
    add_links_option,
    links_to_run,
    whole_number,
)
from miniddp.instruments.bench.paired import paired_ratio, paired_ratio_interval, quantile, rotated
from miniddp.instruments.link_group import simulated_link
from miniddp.job.env import cleanup, init_distributed, launched_by_torchrun
from miniddp.mesh import init_device_mesh
from miniddp.models.gpt import GPT, GPTConfig
from miniddp.observe.link import Link
from miniddp.parallelize import (
    AXES,
    GPTStage,
    first_and_last_stage_group,
    parallelize,
    tensor_parallel_plan,
)
from miniddp.tensor_parallel import ColwiseParallel

DESIGNS = ("ours", "torch")
DEFAULT_MESH = (
    2,
    2,
    2,
)  # (pp, dp, tp): 8 ranks, as miniddp/instruments/bench/__main__.py's RANKS starts
LOSS_TOLERANCE = 1e-5  # float32: the two sides add in different orders, nothing more
GRADIENT_TOLERANCE = 1e-5  # relative to the largest gradient entry


@dataclass
class Side:
    """One design on this rank: `step(windows)` runs one pipeline step (gradients complete on
    return) and gives this replica's mean loss on the last stage, None elsewhere."""

    step: Callable[[torch.Tensor], torch.Tensor | None]
    params: dict[str, nn.Parameter]


def build_gpt(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=args.vocab,
        context=args.length,
        width=args.width,
        layers=args.layers,
        heads=args.heads,
        dropout=0.0,
    )
    return GPT(config)


def ours(args: argparse.Namespace) -> Side:
    mesh = init_device_mesh("cpu", args.mesh, mesh_dim_names=AXES)
    parts = parallelize(
        build_gpt(args), mesh, n_microbatches=args.microbatches, data_parallel="ddp"
    )
    params = dict(parts.model.named_parameters())

    def step(windows: torch.Tensor) -> torch.Tensor | None:
        for param in params.values():
            param.grad = None
        return parts.train_step(windows)

    return Side(step, params)


def theirs(args: argparse.Namespace, link: Link | None) -> Side:
    """torch's composition, step for step the one parallelize() builds (its docstring)."""
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as torch_tp
    from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
    from torch.nn.parallel import DistributedDataParallel

    mesh = torch_mesh("cpu", args.mesh, mesh_dim_names=AXES)
    pp, dp, tp = args.mesh
    model = build_gpt(args)
    if tp > 1:  # 1. TP: the same plan, in torch's styles; the head's logits left sharded
        plan = {
            name: torch_tp.ColwiseParallel()
            if isinstance(style, ColwiseParallel)
            else torch_tp.RowwiseParallel()
            for name, style in tensor_parallel_plan(model).items()
        }
        plan["token"] = torch_tp.RowwiseParallel(input_layouts=Replicate())  # whole token ids
        plan["head"] = torch_tp.ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        torch_tp.parallelize_module(model, mesh["tp"], plan)
        model.head.weight = model.token.weight  # both cut by vocabulary rows: one shard
    index = mesh["pp"].get_local_rank()  # 2. the pipeline split, parallelize()'s
    blocks = range(index * args.layers // pp, (index + 1) * args.layers // pp)
    part = GPTStage(model, blocks, first=index == 0, last=index == pp - 1)
    module: nn.Module = part
    if dp > 1:  # 3. torch's DDP over "dp", around what this rank holds
        if tp > 1:
            _pre_dp_module_transform(part)  # DTensor parameters -> their local shards, for DDP
        module = DistributedDataParallel(part, process_group=mesh["dp"].get_group())
    params = dict(part.named_parameters())  # now: a forward swaps in DTensors made from them

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    stage = pipelining.PipelineStage(module, index, pp, "cpu", group=mesh["pp"].get_group())
    # torch's schedule divides the summed gradients by m itself (scale_grads), over
    # `submodule.parameters()`. After `_pre_dp_module_transform`'s first forward the TP
    # parameters are no longer registered there (DTensor attributes built from DDP's local
    # shards), and their gradients stay m times too large. So: the same division, by hand,
    # over the parameters DDP holds.
    by_hand = dp > 1 and tp > 1
    schedule = pipelining.Schedule1F1B(
        stage, args.microbatches, loss_fn=loss_fn, scale_grads=not by_hand
    )
    pair = first_and_last_stage_group(mesh.mesh, 0, mesh["pp"].get_group())  # the "pp" axis
    tied = params.get("token.weight") if index == 0 else params.get("head.weight")
    sharded_loss = torch_tp.loss_parallel if tp > 1 else nullcontext

    def step(windows: torch.Tensor) -> torch.Tensor | None:
        for param in params.values():
            param.grad = None
        inputs, targets, losses = windows[:, :-1], windows[:, 1:], []
        if index == 0:
            schedule.step(inputs)
        elif index == pp - 1:
            with sharded_loss():  # its forward and its backward, as torch asks
                schedule.step(target=targets, losses=losses)
        else:
            schedule.step()
        for param in params.values() if by_hand else ():  # as torch's stage.scale_grads does
            if param.grad is not None:
                param.grad.div_(args.microbatches)
        if tied is not None:  # the tie across stages, by hand: sum the two copies' gradients
            tied.grad = _as_sharded(tied.grad, tied)
            dist.all_reduce(_local(tied.grad), group=pair)
        return torch.stack([_local(loss).detach() for loss in losses]).mean() if losses else None

    return Side(step, params)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a plain tensor is its own)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _as_sharded(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`grad` laid out as its parameter is: DTensor's embedding backward leaves the token
    embedding's gradient whole (Replicate) on every TP rank, though the weight is cut by rows."""
    placements = getattr(param, "placements", None)
    if placements is None or grad.placements == placements:
        return grad
    return grad.redistribute(placements=placements)  # Replicate -> Shard: each keeps its rows


def windows(args: argparse.Namespace) -> torch.Tensor:
    """This replica's share of one global batch: (batch, length + 1) token ids."""
    dp, replica = args.mesh[1], (dist.get_rank() // args.mesh[2]) % args.mesh[1]
    generator = torch.Generator().manual_seed(0)
    shape = (dp * args.batch, args.length + 1)
    return torch.randint(args.vocab, shape, generator=generator).tensor_split(dp)[replica]


def check_same_maths(sides: dict[str, Side], batch: torch.Tensor) -> dict[str, float]:
    """One step of each on the same windows; the largest differences over all ranks, of the
    loss and of any gradient (relative to that gradient's largest entry). Raises if either is
    past rounding: a timing of two different computations would be moot."""
    loss = {name: side.step(batch) for name, side in sides.items()}
    apart = torch.zeros(2, dtype=torch.float64)
    if loss["ours"] is not None:
        apart[0] = float((loss["ours"] - loss["torch"]).abs())
    ours, theirs = sides["ours"].params, sides["torch"].params
    if sorted(ours) != sorted(theirs):
        raise AssertionError(
            f"the sides hold different parameters: {sorted(ours)} {sorted(theirs)}"
        )
    for name, param in ours.items():
        mine, torch_grad = param.grad, _local(_as_sharded(theirs[name].grad, theirs[name]))
        scale = float(torch_grad.abs().max()) or 1.0
        apart[1] = max(float(apart[1]), float((mine - torch_grad).abs().max()) / scale)
    dist.all_reduce(apart, op=dist.ReduceOp.MAX)
    result = {"loss": float(apart[0]), "gradient": float(apart[1])}
    if result["loss"] > LOSS_TOLERANCE or result["gradient"] > GRADIENT_TOLERANCE:
        raise AssertionError(
            f"ours and torch's compute different steps: losses {result['loss']:.1e} apart, "
            f"gradients {result['gradient']:.1e} (tolerance {LOSS_TOLERANCE:g}, "
            f"{GRADIENT_TOLERANCE:g}): a timing would compare two different things"
        )
    return result


@contextmanager
def over(link: Link | None) -> Iterator[None]:
    """Every message of both designs over `link` (None: the bare machine)."""
    with simulated_link(link):
        yield


def time_designs(args: argparse.Namespace, link: Link | None) -> tuple[dict, dict, dict]:
    """Each design's step time in every timed iteration (the slowest rank's wall seconds, and
    the CPU seconds of all ranks together), and how far apart one step of each was."""
    with over(link):
        sides = {"ours": ours(args), "torch": theirs(args, link)}
        batch = windows(args)
        before = check_same_maths(sides, batch)
        wall: dict[str, list[float]] = {d: [] for d in DESIGNS}
        cpu: dict[str, list[float]] = {d: [] for d in DESIGNS}
        for iteration in range(args.warmup + args.iters):
            for design in rotated(list(DESIGNS), iteration):
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                sides[design].step(batch)
                seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                cpu_seconds = torch.tensor([time.process_time() - start_cpu], dtype=torch.float64)
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # a step lasts as its slowest rank
                dist.all_reduce(cpu_seconds)  # and costs what every rank spent
                if iteration >= args.warmup:
                    wall[design].append(seconds.item())
                    cpu[design].append(cpu_seconds.item())
        after = check_same_maths(sides, batch)  # the timed steps were the same ones too
    return wall, cpu, {what: max(before[what], after[what]) for what in before}


def report(
    args: argparse.Namespace, times: dict, cpu: dict, apart: dict, link: Link | None
) -> dict:
    where = "the bare machine" if link is None else f"a simulated link ({link})"
    pp, dp, tp = args.mesh
    print(
        f"\n3-D step, (pp, dp, tp) = ({pp}, {dp}, {tp}) on {math.prod(args.mesh)} ranks, "
        f"{where}: GPT(width {args.width}, {args.layers} blocks, {args.heads} heads, vocab "
        f"{args.vocab}), {args.batch} x {args.length} tokens per replica in "
        f"{args.microbatches} microbatches, 1F1B, {args.iters} interleaved steps"
    )
    print(
        f"  a step of each on the same windows, before and after timing: losses "
        f"{apart['loss']:.1e} apart, gradients {apart['gradient']:.1e} (relative): the same maths"
    )
    print(f"  {'design':<12} {'median':>9} {'p10':>9} {'p90':>9}   {'CPU, all ranks':>14}")
    for design, values in times.items():
        row = [quantile(values, q) * 1e3 for q in (0.5, 0.1, 0.9)]
        spent = quantile(cpu[design], 0.5) * 1e3
        print(f"  {design:<12} " + " ".join(f"{v:>7.2f}ms" for v in row) + f"   {spent:>12.1f}ms")
    ratio = paired_ratio(times["ours"], times["torch"])
    low, high = paired_ratio_interval(times["ours"], times["torch"])
    cpu_ratio = paired_ratio(cpu["ours"], cpu["torch"])
    cpu_low, cpu_high = paired_ratio_interval(cpu["ours"], cpu["torch"])
    print("  paired ratio ours / torch's (median, 95% interval):")
    print(f"  ours  vs torch       {ratio:5.2f}x  [{low:.2f}, {high:.2f}]   step time")
    print(f"  ours  vs torch       {cpu_ratio:5.2f}x  [{cpu_low:.2f}, {cpu_high:.2f}]   CPU")
    return {
        "link": str(link) if link else "none",
        "times": times,
        "cpu": cpu,
        "ratio": ratio,
        "interval": [low, high],
        "cpu_ratio": cpu_ratio,
        "cpu_interval": [cpu_low, cpu_high],
        "apart": apart,
    }


def mesh_shape(text: str) -> tuple[int, int, int]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a mesh: give PP,DP,TP, three whole numbers >= 1, e.g. 2,2,2"
        )
    if shape[0] < 2:
        raise argparse.ArgumentTypeError(
            f"{text!r} has no pipeline: PP must be >= 2 (the benchmark times the 3-D step; "
            "torch's TP-to-DDP bridge does not keep a tie within one stage)"
        )
    return shape


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m miniddp.bench compose", description=__doc__)
    count = whole_number(at_least=1)
    parser.add_argument(
        "--mesh", type=mesh_shape, default=DEFAULT_MESH, help="PP,DP,TP (default 2,2,2: 8 ranks)"
    )
    add_gpt_options(parser)
    parser.add_argument("--batch", type=count, default=8, help="windows per replica (default 8)")
    parser.add_argument("--microbatches", type=count, default=4, help="m (default 4)")
    add_iters_and_json(parser, 20, "timed iterations")
    parser.add_argument("--warmup", type=whole_number(at_least=0), default=3)
    add_links_option(parser, "every collective and activation")
    args = parser.parse_args(argv)
    pp, _, tp = args.mesh
    problems = []
    if args.layers < pp:
        problems.append(f"--layers {args.layers} cannot fill {pp} stages")
    if args.heads % tp or args.vocab % tp:
        problems.append(f"--heads {args.heads} and --vocab {args.vocab} must divide by TP {tp}")
    if args.width % args.heads:
        problems.append(f"--width {args.width} must divide by --heads {args.heads}")
    if args.microbatches < pp or (args.microbatches == pp and args.mesh[1] > 1):
        problems.append(
            f"--microbatches {args.microbatches}: torch's 1F1B takes m >= PP ({pp}), and with "
            "DP its DDP fails its bucket rebuild at m = PP (an internal assert in reducer.cpp, "
            "seen at PP = 2): give m > PP"
        )
    if args.batch % args.microbatches:
        problems.append(f"--batch {args.batch} must divide by --microbatches {args.microbatches}")
    ranks = math.prod(args.mesh)
    if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) != ranks:
        problems.append(
            f"--mesh {','.join(map(str, args.mesh))} holds {ranks} ranks, the job has "
            f"{os.environ['WORLD_SIZE']}: launch with --nproc_per_node={ranks}"
        )
    elif not launched_by_torchrun() and ranks != math.prod(DEFAULT_MESH):
        problems.append(
            f"--mesh {','.join(map(str, args.mesh))} holds {ranks} ranks, and run plainly the "
            f"benchmark starts {math.prod(DEFAULT_MESH)}: run it under torchrun, "
            f"`torchrun --standalone --nproc_per_node={ranks} -m miniddp.bench compose "
            f"--mesh {','.join(map(str, args.mesh))}`"
        )
    if problems:
        parser.error("; ".join(problems))
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    links = links_to_run(args)
    env = init_distributed()
    torch.set_num_threads(1)  # the ranks share the cores
    results = []
    for link in links:
        times, cpu, apart = time_designs(args, link)
        if env.is_main:
            results.append(report(args, times, cpu, apart, link))
    if env.is_main and args.json:
        settings = vars(args) | {"link": None, "mesh": list(args.mesh)}
        with open(args.json, "w") as file:
            json.dump({"settings": settings, "runs": results}, file, indent=2)
        print(f"wrote {args.json}")
    dist.barrier()
    cleanup()
