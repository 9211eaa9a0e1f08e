"""Rank tasks for tests/test_checkpoint_parallel.py: checkpoints of a tensor-parallel model, of a
pipeline stage and of DP x TP x PP. They run inside the pool's workers, which import them by
module name, so they live here rather than in the test file.

Each task trains a few AdamW steps (so the optimizer holds exp_avg and exp_avg_sq shaped like
the shards), saves on every rank, builds the same model afresh with other weights, loads, and
returns this rank's state just before the save and just after the load.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from miniddp import MiniDDP, cleanup
from miniddp.checkpoint import CheckpointError, Progress, load_checkpoint, save_checkpoint
from miniddp.job.faults import CollectiveFailed
from miniddp.pipeline import PipelineStage, ScheduleGPipe
from miniddp.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from tests.mesh_tasks import mesh_once

# The dim each tensor-parallel entry of `block()` is split along (Megatron's MLP: the first
# Linear by columns of its output, the second by rows of its input); "2.bias" is replicated.
SPLIT_DIMS = {"0.weight": 0, "0.bias": 0, "2.weight": 1}
HIDDEN = 8  # divisible by a TP size of 1, 2 and 4
PROGRESS = Progress(step=2, epoch=0, batches_done=2)


def block(seed: int) -> nn.Sequential:
    """The unsplit model: an MLP block, the same names and shapes in one process."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 4))


def tp_block(seed: int, group: dist.ProcessGroup | None) -> nn.Module:
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    return parallelize_module(block(seed), group, plan)


def inputs(seed: int = 0) -> torch.Tensor:
    return torch.linspace(-1, 1, 16).reshape(4, 4) + seed


def train(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    for _ in range(PROGRESS.step):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Copies of this rank's parameters (by name) and optimizer state (by parameter number)."""
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    saved = optimizer.state_dict()["state"]
    moments = {
        index: {name: value.clone() for name, value in state.items()}
        for index, state in saved.items()
    }
    return {"params": params, "optimizer": moments}


def tp_round_trip(path: str) -> dict[str, Any]:
    """TP over every rank of the pool: train, save on every rank, load into a fresh TP model.
    Also this rank's output before the save, to compare with one process loading the file."""
    group = mesh_once((dist.get_world_size(),), ("tp",))["tp"].get_group()
    model = tp_block(seed=0, group=group)
    optimizer = adamw(model)
    train(model, optimizer, inputs())
    before = state_of(model, optimizer)
    with torch.no_grad():
        output = model(inputs(1))
    save_checkpoint(path, model, optimizer, PROGRESS)
    fresh = tp_block(seed=1, group=group)
    fresh_optimizer = adamw(fresh)
    load_checkpoint(path, fresh, fresh_optimizer)
    return {"saved": before, "loaded": state_of(fresh, fresh_optimizer), "output": output}


def tp_resume(path: str) -> dict[str, Any]:
    """Resume a checkpoint saved at another TP size, at this pool's (TP over the whole pool):
    this rank's state after the load, and the model's output."""
    model = tp_block(seed=2, group=None)
    optimizer = adamw(model)
    load_checkpoint(path, model, optimizer, allow_world_size_change=True)
    with torch.no_grad():
        output = model(inputs(1))
    return {"loaded": state_of(model, optimizer), "output": output}


def stage_block(stage: int, seed: int) -> nn.Sequential:
    """Stage `stage`'s layers: every stage the same names and shapes, so that loading stage 0's
    state into stage 1 would be accepted, silently, as it was."""
    torch.manual_seed(seed + stage)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh())


def pp_round_trip(path: str) -> dict[str, Any]:
    """Two pipeline stages trained by GPipe, saved on every rank, loaded into fresh stages."""
    pp = mesh_once((dist.get_world_size(),), ("pp",))
    group, stage = pp["pp"].get_group(), pp["pp"].get_local_rank()
    count = pp["pp"].size()
    submodule = stage_block(stage, seed=10)
    schedule = ScheduleGPipe(PipelineStage(submodule, stage, count, "cpu", group=group), 2, mse)
    optimizer = adamw(submodule)
    for step in range(PROGRESS.step):
        x, y = inputs(step), torch.zeros(4, 4)
        if stage == 0:
            schedule.step(x)
        elif stage == count - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
    before = state_of(submodule, optimizer)
    save_checkpoint(path, submodule, optimizer, PROGRESS)
    fresh = stage_block(stage, seed=20)
    PipelineStage(fresh, stage, count, "cpu", group=group)  # marks its parameters as stage's
    fresh_optimizer = adamw(fresh)
    load_checkpoint(path, fresh, fresh_optimizer)
    return {"saved": before, "loaded": state_of(fresh, fresh_optimizer), "stage": stage}


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def three_d_stage(seed: int) -> tuple[MiniDDP, dict[str, int]]:
    """This rank's part of (pp, dp, tp) = (2, 2, 2): its stage's MLP block split over its TP
    group, in MiniDDP over its DP group, as its pipeline's stage. Returns the wrapper and where
    this rank sits on each axis."""
    mesh = mesh_once((2, 2, 2), ("pp", "dp", "tp"))
    where = {axis: mesh[axis].get_local_rank() for axis in ("pp", "dp", "tp")}
    model = tp_block(seed + where["pp"], mesh["tp"].get_group())
    ddp = MiniDDP(model, process_group=mesh["dp"].get_group())
    PipelineStage(ddp, where["pp"], 2, "cpu", group=mesh["pp"].get_group())
    return ddp, where


def three_d_round_trip(path: str) -> dict[str, Any]:
    """DP x TP x PP on 8 ranks: each stage trained on its own (each DP replica on its own data,
    its gradients averaged by MiniDDP; how the gradients came does not matter to a
    checkpoint), saved on every rank, loaded into fresh wrappers."""
    ddp, where = three_d_stage(seed=30)
    optimizer = adamw(ddp)
    train(ddp, optimizer, inputs(where["dp"]))
    before = state_of(ddp.module, optimizer)
    save_checkpoint(path, ddp, optimizer, PROGRESS)
    fresh, _ = three_d_stage(seed=40)
    fresh_optimizer = adamw(fresh)
    load_checkpoint(path, fresh, fresh_optimizer)
    loaded = state_of(fresh.module, fresh_optimizer)
    return {"saved": before, "loaded": loaded, "where": where}


def save_on_rank_0_alone(path: str) -> str:
    """The end of a tensor-parallel script, with torch's idiom: `if rank == 0:
    save_checkpoint(...)`, then `cleanup()` on every rank. Returns what this rank raised
    (caught here, so that the pool, which this breaks, is not used again by the harness)."""
    model = tp_block(seed=0, group=None)
    optimizer = adamw(model)
    train(model, optimizer, inputs())
    try:
        if dist.get_rank() == 0:
            save_checkpoint(path, model, optimizer, PROGRESS)
        cleanup()
    except (CheckpointError, CollectiveFailed) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"
