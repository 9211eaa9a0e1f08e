"""What the ranks run for tests/test_composition.py: one small model trained under every
combination of DP (MiniDDP or fully_shard), TP and PP a real loop uses, on one mesh, and
returned as full tensors to compare with one process.

The model: two blocks, each Linear(8, 16) -> Tanh -> Linear(16, 8) -> Tanh, in float64. Under
TP each block's first Linear is colwise and its second rowwise (Megatron's MLP); under PP each
block is a stage. The mesh is always (pp, dp, tp), an axis of size 1 where that parallelism is
off, so one function builds every combination in torchtitan's order: TP, then the pipeline
split, then DP or FSDP over the "dp" axis.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from miniddp import MiniDDP, fully_shard
from miniddp.pipeline import PipelineStage, ScheduleGPipe
from miniddp.sharding import full_state_dict
from miniddp.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from tests.mesh_tasks import mesh_once

NAMES = ("pp", "dp", "tp")
WIDTH, HIDDEN, BLOCKS = 8, 16, 2
MICROBATCHES, SAMPLES_PER_REPLICA, STEPS = 2, 4, 3
PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}
SPLIT_DIM = {"0.weight": 0, "0.bias": 0, "2.weight": 1}  # what TP cuts, and along which dim


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, WIDTH), nn.Tanh())
        for _ in range(BLOCKS)
    ]
    return nn.Sequential(*blocks).double()


def global_batch(step: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    size = replicas * SAMPLES_PER_REPLICA
    x = torch.randn(size, WIDTH, generator=generator, dtype=torch.float64)
    return x, torch.randn(size, WIDTH, generator=generator, dtype=torch.float64)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def one_process(replicas: int) -> dict[str, torch.Tensor]:
    """The reference: the whole model, each step's whole global batch, AdamW."""
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(STEPS):
        x, y = global_batch(step, replicas)
        mse(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def train_composed(shape: tuple[int, int, int], data_parallel: str = "ddp") -> dict:
    """This rank's part of the model trained STEPS AdamW steps on a (pp, dp, tp) mesh of
    `shape`, DP by `data_parallel` ("ddp": MiniDDP, "fsdp": fully_shard); its part returned as
    full tensors named as in one process ("1.2.weight": block 1's second Linear)."""
    pp, dp, tp = shape
    mesh = mesh_once(shape, NAMES)
    model = build_model()
    blocks = list(range(BLOCKS))
    if pp > 1:  # the pipeline split: this rank keeps one block
        blocks = [mesh["pp"].get_local_rank()]
    part = nn.Sequential(*(model[b] for b in blocks))
    if tp > 1:
        for block in part:
            parallelize_module(block, mesh["tp"], PLAN)
    optimizer_params = part.parameters
    wrapped: nn.Module = part
    if dp > 1 and data_parallel == "ddp":
        wrapped = MiniDDP(part, process_group=mesh["dp"].get_group())
    elif dp > 1:
        for block in part:
            fully_shard(block, process_group=mesh["dp"].get_group())
        wrapped = fully_shard(part, process_group=mesh["dp"].get_group())
    optimizer = torch.optim.AdamW(optimizer_params(), lr=0.01)
    replica = mesh["dp"].get_local_rank()
    if pp > 1:
        pp_group = mesh["pp"].get_group()
        stage = PipelineStage(wrapped, blocks[0], pp, "cpu", group=pp_group)
        schedule = ScheduleGPipe(stage, MICROBATCHES, mse)
    for step in range(STEPS):
        x, y = (t.tensor_split(dp)[replica] for t in global_batch(step, dp))
        if pp == 1:
            mse(wrapped(x), y).backward()
        elif stage.is_first:
            schedule.step(x)
        else:
            schedule.step(target=y)
        optimizer.step()
        optimizer.zero_grad()
    return full_tensors(part, blocks, mesh, data_parallel == "fsdp" and dp > 1)


def full_tensors(part: nn.Sequential, blocks: list[int], mesh, sharded: bool) -> dict:
    """Undo FSDP (full_state_dict over "dp"), then TP (all-gather over "tp" along the dim the
    plan split), and name each tensor as one process does."""
    state = (
        full_state_dict(part) if sharded else {n: p.detach() for n, p in part.named_parameters()}
    )
    tp_group, tp = mesh["tp"].get_group(), mesh["tp"].size()
    full = {}
    for name, tensor in state.items():
        position, _, inner = name.partition(".")
        if tp > 1 and inner in SPLIT_DIM:
            pieces = [torch.empty_like(tensor) for _ in range(tp)]
            dist.all_gather(pieces, tensor.contiguous(), group=tp_group)
            tensor = torch.cat(pieces, dim=SPLIT_DIM[inner])
        full[f"{blocks[int(position)]}.{inner}"] = tensor.clone()
    return full


def wrap_tensor_parallel_model_over_its_own_group(wrapper: str) -> dict:
    """A TP model over the whole job (2 ranks), then a data-parallel wrapper over the same
    ranks: what it raised, and whether this rank's shards are what they were."""
    model = build_model()[0]
    parallelize_module(model, None, PLAN)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        if wrapper == "ddp":
            MiniDDP(model)
        elif wrapper == "fsdp":
            fully_shard(model)
        else:
            from miniddp import ZeroRedundancyOptimizer

            ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
        message = "no error"
    except ValueError as error:
        message = str(error)
    untouched = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return {"message": message, "untouched": untouched}
