"""Rank tasks for tests/test_clip_composed.py: one model, its gradients under TP, DP x TP x FSDP,
PP and (pp, dp, tp), and the norm miniddp.sharding.clip_grad_norm_ finds, beside one process's.

The reference on every rank is one process: the whole model, the whole (global) batch, and
`torch.nn.utils.clip_grad_norm_`. Each task returns, per norm order, this rank's norm, the
reference norm, and the largest difference between this rank's clipped gradients and its part of
the reference's clipped gradients (its TP chunk, its fully_shard piece, its stage's parameters).

The pipeline's gradients are computed by hand, not by a schedule: the stage's slice runs on the
activation one process computes at the cut (stage 1) or backpropagates the gradient one process
computes there (stage 0). That is exactly what a schedule hands each stage, without depending on
the schedule; each stage's parameters are marked as PipelineStage marks them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from miniddp import fully_shard
from miniddp.placement import DataShard, Stage, TensorShard, mark
from miniddp.sharding import clip_grad_norm_
from miniddp.sharding.fully_shard import cut
from miniddp.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from tests.mesh_tasks import mesh_once

WIDTH, HIDDEN, BATCH = 4, 8, 6
MAX_NORM = 0.1  # far below every norm here: every case clips
NORMS = (2.0, float("inf"))
# The plan on every Sequential(Linear, Tanh, Linear) here, and the dim each parameter's TP shard
# is cut along (None: replicated over the TP group): written out, not read from the marks.
PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}
TP_DIMS = {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": None}


def block(seed: int) -> nn.Sequential:
    """One tensor-parallel block: column-parallel up, row-parallel down."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, WIDTH))


def batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank `index`'s batch (the same on every rank of its TP and PP groups)."""
    generator = torch.Generator().manual_seed(100 + index)
    x = 3 * torch.randn(BATCH, WIDTH, generator=generator)
    return x, torch.randn(BATCH, WIDTH, generator=generator)


def one_process(model: nn.Module, data: list[int], norm_type: float) -> tuple[torch.Tensor, dict]:
    """The reference: `model` whole, on the batches of `data` together; torch's clip."""
    x, y = (torch.cat(t) for t in zip(*map(batch, data)))
    nn.functional.mse_loss(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)
    return norm, {name: p.grad.clone() for name, p in model.named_parameters()}


def tp_chunk(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """What a TP rank holds of `full`: chunk(full, W, dim)[rank], or all of it if replicated."""
    dim = TP_DIMS[".".join(name.split(".")[-2:])]  # "stages.1.0.weight": the block's "0.weight"
    return full if dim is None else torch.chunk(full, tp_size, dim)[tp_rank]


def largest_difference(model: nn.Module, expected: dict[str, torch.Tensor]) -> float:
    return max((p.grad - expected[name]).abs().max().item() for name, p in model.named_parameters())


def outcome(norm: torch.Tensor, reference: torch.Tensor, difference: float) -> dict:
    return {"norm": norm.detach().clone(), "reference": reference, "grad_difference": difference}


def tensor_parallel() -> dict[float, dict]:
    """TP over 2 ranks: each holds half of the two weights and of the first bias, and all of the
    second bias (replicated: its norm counted once)."""
    tp = mesh_once((2,), ("tp",))["tp"]
    results = {}
    for norm_type in NORMS:
        reference, clipped = one_process(block(0), [0], norm_type)
        model = parallelize_module(block(0), tp, PLAN)
        x, y = batch(0)
        nn.functional.mse_loss(model(x), y).backward()
        norm = clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)
        rank, size = tp.get_local_rank(), tp.size()
        expected = {n: tp_chunk(n, g, rank, size) for n, g in clipped.items()}
        results[norm_type] = outcome(norm, reference, largest_difference(model, expected))
    return results


def data_tensor_fully_sharded() -> dict[float, dict]:
    """(dp, tp) = (2, 2): TP inside each row, then fully_shard over each column, so every
    parameter is a flat piece of a TP shard (or of the replicated bias); each dp rank its own
    batch, the reference on both together."""
    mesh = mesh_once((2, 2), ("dp", "tp"))
    dp, tp = mesh["dp"], mesh["tp"]
    results = {}
    for norm_type in NORMS:
        reference, clipped = one_process(block(0), [0, 1], norm_type)
        model = fully_shard(parallelize_module(block(0), tp, PLAN), process_group=dp.get_group())
        x, y = batch(dp.get_local_rank())
        nn.functional.mse_loss(model(x), y).backward()
        norm = clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)
        expected = {
            name: cut(tp_chunk(name, g, tp.get_local_rank(), tp.size()), dp.get_local_rank(), 2)
            for name, g in clipped.items()
        }
        results[norm_type] = outcome(norm, reference, largest_difference(model, expected))
    return results


def data_tensor_zero() -> dict[float, dict]:
    """(dp, tp) = (2, 2): TP inside each row, MiniDDP and ZeRO-1 over each column, mesh["dp"]:
    each gradient is counted on its ZeRO owner, a rank of the dp group (group rank 0 or 1,
    global ranks 0 and 2, or 1 and 3), not on the global rank of that number."""
    from miniddp import MiniDDP, ZeroRedundancyOptimizer

    mesh = mesh_once((2, 2), ("dp", "tp"))
    dp, tp = mesh["dp"], mesh["tp"]
    results = {}
    for norm_type in NORMS:
        reference, clipped = one_process(block(0), [0, 1], norm_type)
        model = parallelize_module(block(0), tp, PLAN)
        replica = MiniDDP(model, process_group=dp.get_group())
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, process_group=dp.get_group())
        x, y = batch(dp.get_local_rank())
        nn.functional.mse_loss(replica(x), y).backward()
        norm = clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)
        rank, size = tp.get_local_rank(), tp.size()
        expected = {n: tp_chunk(n, g, rank, size) for n, g in clipped.items()}
        results[norm_type] = outcome(norm, reference, largest_difference(model, expected))
    return results


class TiedPipeline(nn.Module):
    """Two stages, each a block, with an extra square map at each end whose weight is tied (as a
    GPT ties its embedding and its head): stage 0 holds `first`, the last stage a replica of
    the same parameter in `last`."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.first = nn.Linear(WIDTH, WIDTH, bias=False)
        self.stages = nn.ModuleList([block(seed + 1), block(seed + 2)])
        self.last = nn.Linear(WIDTH, WIDTH, bias=False)
        self.last.weight = self.first.weight

    def part(self, index: int) -> nn.Sequential:
        """Stage `index`'s slice of the forward."""
        return nn.Sequential(self.first, self.stages[0]) if index == 0 else self.stages[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.part(1)(self.part(0)(x)))


def pipeline() -> dict[float, dict]:
    """PP over 2 ranks, stage s on rank s, over group None (the whole job, PipelineStage's
    default). The tied weight's replica on the last stage is marked as stage 0's, its gradient
    the sum of both uses on both stages (the all-reduce between the tied copies that a tied
    pipeline runs): counted once."""
    index = dist.get_rank()
    results = {}
    for norm_type in NORMS:
        reference, clipped = one_process(TiedPipeline(0), [0], norm_type)
        model = TiedPipeline(0)
        x, y = batch(0)
        nn.functional.mse_loss(model(x), y).backward()  # every stage's gradients, by hand
        held = model.part(index) if index == 0 else nn.Sequential(model.part(1), model.last)
        for param in held.parameters():
            mark(param, stage=Stage(None, index, 2))
        if index == 1:
            mark(model.last.weight, stage=Stage(None, 0, 2))  # stage 0's, a replica here
        norm = clip_grad_norm_(held.parameters(), MAX_NORM, norm_type)
        results[norm_type] = outcome(norm, reference, held_difference(model, held, clipped))
    return results


def held_difference(model: nn.Module, held: nn.Module, expected: dict[str, torch.Tensor]) -> float:
    """The largest difference on the parameters of `model` that `held` holds."""
    kept = {id(p) for p in held.parameters()}
    return max(
        (p.grad - expected[name]).abs().max().item()
        for name, p in model.named_parameters()
        if id(p) in kept
    )


class TwoBlocks(nn.Module):
    """Two blocks in a row: stage 0 and stage 1 of the 3-D case."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.stages = nn.ModuleList([block(seed), block(seed + 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages[1](torch.tanh(self.stages[0](x)))


def three_d() -> dict[float, dict]:
    """(pp, dp, tp) = (2, 2, 2): each stage's block split by TP over its row, marked as its
    stage's, then fully_shard over its column (the order TP -> PP -> FSDP: the shards inherit
    both marks). Each dp rank runs its own batch; the stage's input (stage 1) or its output's
    gradient (stage 0) is what one process computes at the cut for that batch."""
    mesh = mesh_once((2, 2, 2), ("pp", "dp", "tp"))
    pp, dp, tp = mesh["pp"], mesh["dp"], mesh["tp"]
    index = pp.get_local_rank()
    results = {}
    for norm_type in NORMS:
        reference, clipped = one_process(TwoBlocks(0), [0, 1], norm_type)
        whole = TwoBlocks(0)
        x, y = batch(dp.get_local_rank())
        at_cut = torch.tanh(whole.stages[0](x))
        cut_input = at_cut.detach().requires_grad_()
        nn.functional.mse_loss(whole.stages[1](cut_input), y).backward()
        part = parallelize_module(block(index), tp, PLAN)
        for param in part.parameters():
            mark(param, stage=Stage(pp.get_group(), index, 2))
        part = fully_shard(part, process_group=dp.get_group())
        if index == 0:
            torch.tanh(part(x)).backward(cut_input.grad)
        else:
            nn.functional.mse_loss(part(at_cut.detach()), y).backward()
        norm = clip_grad_norm_(part.parameters(), MAX_NORM, norm_type)
        prefix = f"stages.{index}."
        expected = {
            name.removeprefix(prefix): cut(
                tp_chunk(name, g, tp.get_local_rank(), tp.size()), dp.get_local_rank(), 2
            )
            for name, g in clipped.items()
            if name.startswith(prefix)
        }
        results[norm_type] = outcome(norm, reference, largest_difference(part, expected))
    return results


def pipeline_scheduled() -> dict[float, dict]:
    """PP over 2 ranks through PipelineStage and ScheduleGPipe (2 microbatches): no mark by
    hand, the stage marks its own parameters."""
    from miniddp.pipeline import PipelineStage, ScheduleGPipe

    index = dist.get_rank()
    results = {}
    for norm_type in NORMS:
        reference, clipped = one_process(TwoBlocks(0), [0], norm_type)
        model = TwoBlocks(0)
        part = nn.Sequential(model.stages[0], nn.Tanh()) if index == 0 else model.stages[1]
        stage = PipelineStage(part, index, 2, "cpu")
        schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=nn.functional.mse_loss)
        x, y = batch(0)
        if index == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        norm = clip_grad_norm_(part.parameters(), MAX_NORM, norm_type)
        results[norm_type] = outcome(norm, reference, held_difference(model, part, clipped))
    return results


def mixed_groups(which: str) -> None:
    """Marks no mesh could give: two tensor-parallel groups of different ranks, or a data
    group and a tensor group that share ranks. The norm would be added along neither."""
    mesh = mesh_once((2, 1), ("dp", "tp"))  # tp: this rank alone; dp: both ranks
    one, two = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    one.grad, two.grad = torch.ones(2), torch.ones(2)
    if which == "two tensor groups":
        mark(one, tensor=TensorShard(mesh["tp"].get_group(), 0))
        mark(two, tensor=TensorShard(mesh["dp"].get_group(), 0))
    else:
        mark(one, tensor=TensorShard(mesh["dp"].get_group(), 0))
        mark(two, data=DataShard(dist.group.WORLD))
    clip_grad_norm_([one, two], MAX_NORM)
