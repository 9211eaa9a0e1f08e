"""What the ranks run for tests/test_parallelize_ep.py: chapter 12's GPT with experts in its
second block, through `parallelize` on a ("pp", "dp", "ep", "tp") mesh, against one process.

The one-process reference, float64: each step, `accumulate` batches of the dp x ep replicas'
windows (replica r's are the r-th of R equal slices), each batch cut into the pipeline's
microbatches (without a pipeline, one), microbatch m being every replica's m-th side by side;
for each, the mean next-character loss plus the MoE's aux loss of those tokens, over the
number of microbatches, backward; the gradients' norm; one AdamW step.
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
from miniddp.expert_parallel import GroupedExperts
from miniddp.models import GPT, MoEConfig, moe_aux_loss
from miniddp.parallelize import ParallelGPT, parallelize
from miniddp.parallelize_experts import EP_AXES
from miniddp.sharding import clip_grad_norm_, full_state_dict
from tests.mesh_tasks import mesh_once
from tests.parallelize_tasks import CONFIG as DENSE
from tests.parallelize_tasks import SPLIT_DIM, MeshScenario, windows

CONFIG = replace(DENSE, moe=MoEConfig(num_experts=4, top_k=2, aux_loss_coef=0.1))
STEPS, LR, MICROBATCHES = 3, 1e-2, 2


class Scenario(MeshScenario):
    THIRD = "ep"

    @property
    def replicas(self) -> int:
        return self.shape[1] * self.shape[2]


def build_gpt(precision: str, config=CONFIG) -> GPT:
    torch.manual_seed(0)
    model = GPT(config)
    return model.double() if precision == "fp64" else model


def batches(step: int, accumulate: int, replicas: int) -> list[torch.Tensor]:
    """The step's `accumulate` batches of every replica's windows."""
    return [windows(step * accumulate + a, replicas) for a in range(accumulate)]


def one_process(scenario: Scenario, precision: str = "fp64") -> dict[str, Any]:
    """Each batch's loss (the replicas' mean), each step's gradient norm, the parameters."""
    model = build_gpt(precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    m = MICROBATCHES if scenario.shape[0] > 1 else 1
    losses, norms = [], []
    for step in range(STEPS):
        for batch in batches(step, scenario.accumulate, scenario.replicas):
            per_replica = [w.tensor_split(m) for w in batch.tensor_split(scenario.replicas)]
            batch_losses = []
            for i in range(m):
                micro = torch.cat([replica[i] for replica in per_replica])
                logits = model(micro[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), micro[:, 1:].flatten())
                ((loss + moe_aux_loss(model)) / m).backward()
                batch_losses.append(loss.item())
            losses.append(sum(batch_losses) / m)
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        optimizer.step()
        optimizer.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}


def build(scenario: Scenario, shape: tuple[int, int, int, int] | None = None) -> ParallelGPT:
    mixed = MixedPrecision(param_dtype=torch.bfloat16) if scenario.precision == "bf16" else None
    return parallelize(
        build_gpt(scenario.precision),
        mesh_once(shape or scenario.shape, EP_AXES),
        n_microbatches=MICROBATCHES,
        data_parallel=scenario.data_parallel,
        mixed_precision=mixed,
    )


def step(parts: ParallelGPT, scenario: Scenario, optimizer, index: int) -> tuple[list, float]:
    """One optimizer step: this replica's losses (None off the last stage) and the gradients'
    norm from clip_grad_norm_ (max_norm inf: it scales by 1). Every parameter must have its
    gradient: AdamW would skip one without, unseen within bf16's tolerances."""
    losses = []
    for batch in batches(index, scenario.accumulate, parts.replicas):
        loss = parts.train_step(batch.tensor_split(parts.replicas)[parts.replica])
        losses.append(None if loss is None else loss.item())
    missing = [name for name, p in parts.model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"
    norm = clip_grad_norm_(parts.parameters(), max_norm=math.inf).item()
    optimizer.step()
    optimizer.zero_grad()
    return losses, norm


def full_parameters(parts: ParallelGPT, sharded: bool) -> dict[str, torch.Tensor]:
    """This rank's stage's parameters, whole: gathered over fully_shard, TP and ep."""
    state = full_state_dict(parts.model) if sharded else dict(parts.model.named_parameters())
    full = {}
    for name, tensor in state.items():
        tensor = tensor.detach()
        dim = next((d for suffix, d in SPLIT_DIM.items() if name.endswith(suffix)), None)
        dim = 0 if name == "head.weight" else dim  # the tied copy, cut as the embedding
        for axis, cut in (("tp", dim), ("ep", 0 if ".experts." in name else None)):
            group, size = parts.mesh[axis].get_group(), parts.mesh[axis].size()
            if size > 1 and cut is not None:
                pieces = [torch.empty_like(tensor) for _ in range(size)]
                dist.all_gather(pieces, tensor.contiguous(), group=group)
                tensor = torch.cat(pieces, cut)
        full[name] = tensor.clone()
    return full


def train(scenario: Scenario, checkpoint: str | None = None, resume_at=None) -> dict[str, Any]:
    """STEPS optimizer steps: every rank's losses, norms, whole parameters, their dtypes; with
    `checkpoint`, a save before the last step, loaded into the GPT parallelized over the mesh
    `resume_at` (another ep), whose last step is compared with this one's."""
    parts = build(scenario)
    optimizer = torch.optim.AdamW(parts.parameters(), lr=LR)
    losses, norms, resumed = [], [], None
    for index in range(STEPS):
        if checkpoint is not None and index == STEPS - 1:
            resumed = resume(scenario, parts, optimizer, Path(checkpoint), resume_at, index)
        step_losses, norm = step(parts, scenario, optimizer, index)
        losses += step_losses
        norms.append(norm)
    sharded = scenario.data_parallel == "fsdp" and scenario.replicas > 1
    result = {"losses": losses, "norms": norms, "params": full_parameters(parts, sharded)}
    result["dtypes"] = sorted({str(p.dtype) for p in parts.parameters()})
    result["replica"] = (parts.replica, parts.replicas)
    if resumed is not None:
        result["resumed"] = resumed
    return result


def resume(scenario, parts, optimizer, path: Path, shape, index: int) -> dict[str, torch.Tensor]:
    """Save before step `index`; load into the GPT parallelized over `shape`, take that step
    there: its whole parameters after."""
    save_checkpoint(path, parts.model, optimizer, Progress(step=index, epoch=0, batches_done=0))
    other = replace(scenario, shape=shape)
    fresh = build(other)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=LR)
    load_checkpoint(path, fresh.model, fresh_optimizer)
    step(fresh, other, fresh_optimizer, index)
    dist.barrier()
    return full_parameters(fresh, sharded=False)


def run_scenarios(
    scenarios: list[Scenario], checkpoint: str | None = None, resume_at=None
) -> list[dict]:
    """Several scenarios in one pool run; the first saves a checkpoint and resumes at another
    mesh when `checkpoint` is given."""
    return [train(s, checkpoint if i == 0 else None, resume_at) for i, s in enumerate(scenarios)]


def refusal(what: str) -> str:
    """What parallelize says on a (1, 1, 2, 1) mesh: "experts" (3 experts over ep = 2) or
    "dense" (a GPT without experts)."""
    mesh = mesh_once((1, 1, 2, 1), EP_AXES)
    try:
        if what == "experts":
            parallelize(build_gpt("fp64", replace(CONFIG, moe=MoEConfig(3, 2))), mesh)
        else:
            parallelize(build_gpt("fp64", DENSE), mesh)
    except ValueError as error:
        return str(error)
    return "accepted"


def experts_held() -> list[int]:
    """How many experts each MoE holds on this rank of a (1, 1, 2, 1) mesh."""
    parts = build(Scenario((1, 1, 2, 1)))
    return [m.w1.shape[0] for m in parts.model.modules() if isinstance(m, GroupedExperts)]
