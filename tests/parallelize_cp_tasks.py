"""What the ranks run for tests/test_parallelize_cp.py: chapter 12's GPT (small, dropout 0)
through `parallelize` on a ("pp", "dp", "cp", "tp") mesh, against one process.

The one-process reference: each step, `accumulate` batches of the dp replicas' windows, each
batch's mean loss backward in turn (the gradients add up, as two train_step calls add theirs),
the gradients' norm, one AdamW step. Every rank of a replica is given the replica's whole
windows; parallelize cuts them over cp itself.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

from miniddp import MixedPrecision
from miniddp.checkpoint import Progress, load_checkpoint, save_checkpoint
from miniddp.models.gpt import GPT
from miniddp.parallelize import CP_AXES, ParallelGPT, parallelize
from miniddp.sharding import clip_grad_norm_
from tests.mesh_tasks import mesh_once
from tests.parallelize_tasks import CONFIG, MeshScenario, full_tensors, windows

STEPS, LR = 3, 1e-2


class Scenario(MeshScenario):
    THIRD = "cp"


def build_gpt(precision: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    return model.double() if precision == "fp64" else model


def batches(step: int, accumulate: int, replicas: int) -> list[torch.Tensor]:
    """The step's `accumulate` batches of every replica's windows."""
    return [windows(step * accumulate + a, replicas) for a in range(accumulate)]


def one_process(scenario: Scenario, precision: str | None = None) -> dict[str, Any]:
    """Each step's losses (one per batch) and gradient norm, and the parameters at the end:
    one process, float64 (or float32 for a bf16 scenario: what bf16 is held to)."""
    precision = precision or scenario.precision
    model = build_gpt("fp64" if precision == "fp64" else "fp32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        for batch in batches(step, scenario.accumulate, scenario.shape[1]):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            losses.append(loss.item())
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        optimizer.step()
        optimizer.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}


def build(scenario: Scenario) -> ParallelGPT:
    mixed = MixedPrecision(param_dtype=torch.bfloat16) if scenario.precision == "bf16" else None
    return parallelize(
        build_gpt(scenario.precision),
        mesh_once(scenario.shape, CP_AXES),
        n_microbatches=2,
        data_parallel=scenario.data_parallel,
        mixed_precision=mixed,
    )


def step(parts: ParallelGPT, scenario: Scenario, optimizer, index: int) -> tuple[list, float]:
    """One optimizer step of `scenario`: its losses (this replica's, None off the last stage)
    and clip_grad_norm_'s norm (max_norm inf: it scales by 1)."""
    replicas, replica = scenario.shape[1], parts.mesh["dp"].get_local_rank()
    losses = []
    for batch in batches(index, scenario.accumulate, replicas):
        loss = parts.train_step(batch.tensor_split(replicas)[replica])
        losses.append(None if loss is None else loss.item())
    norm = clip_grad_norm_(parts.parameters(), max_norm=math.inf).item()
    optimizer.step()
    optimizer.zero_grad()
    return losses, norm


def train(scenario: Scenario, checkpoint: str | None = None) -> dict[str, Any]:
    """STEPS optimizer steps; every rank's losses, norms, full parameters (gathered over TP and
    fully_shard), their dtypes; with `checkpoint`, a save after STEPS - 1 steps and a load into a
    fresh parallelized GPT, whose last step must be the same bits as this one's."""
    parts = build(scenario)
    optimizer = torch.optim.AdamW(parts.parameters(), lr=LR)
    losses, norms, resumed = [], [], None
    for index in range(STEPS):
        if checkpoint is not None and index == STEPS - 1:
            resumed = resume(scenario, parts, optimizer, Path(checkpoint), index)
        step_losses, norm = step(parts, scenario, optimizer, index)
        losses += step_losses
        norms.append(norm)
    sharded = scenario.data_parallel == "fsdp" and scenario.shape[1] * scenario.shape[2] > 1
    params = full_tensors(parts.model, parts.mesh, sharded)
    result = {"losses": losses, "norms": norms, "params": params}
    result["dtypes"] = sorted({str(p.dtype) for p in parts.parameters()})
    if resumed is not None:
        same = [torch.equal(a, b) for a, b in zip(parts.parameters(), resumed.parameters())]
        result["resumed_same"] = all(same) and len(same) == len(list(parts.parameters()))
    return result


def resume(scenario: Scenario, parts: ParallelGPT, optimizer, path: Path, index: int):
    """Save `parts` before step `index`; load the file into a fresh parallelized GPT and take
    that step with it: what it holds after (its parameters, to compare with the original's)."""
    save_checkpoint(path, parts.model, optimizer, Progress(step=index, epoch=0, batches_done=0))
    fresh = build(scenario)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=LR)
    load_checkpoint(path, fresh.model, fresh_optimizer)
    step(fresh, scenario, fresh_optimizer, index)
    dist.barrier()
    return fresh


def run_scenarios(scenarios: list[Scenario], checkpoint: str | None = None) -> list[dict]:
    """Several scenarios in one pool run; the first saves, loads and resumes at `checkpoint`."""
    return [train(s, checkpoint if i == 0 else None) for i, s in enumerate(scenarios)]


def refusal(shape: tuple[int, int, int, int], what: str) -> str:
    """What parallelize or train_step says to bad input on a cp mesh: `what` is "length" (T not
    a multiple of 2 cp), "ragged" (one rank given shorter windows) or "dropout"."""
    mesh = mesh_once(shape, CP_AXES)
    try:
        if what == "dropout":
            parallelize(GPT(replace(CONFIG, dropout=0.1)), mesh)
            return "no error"
        parts = parallelize(build_gpt("fp64"), mesh)
        given = windows(0, 1)
        if what == "length":
            given = given[:, :7]  # T = 6, not a multiple of 2 cp = 4
        if what == "ragged" and dist.get_rank() == 1:
            given = given[:, :5]
        parts.train_step(given)
    except ValueError as error:
        return str(error)
    return "no error"
