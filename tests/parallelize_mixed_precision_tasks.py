"""What the ranks run for tests/test_parallelize_mixed_precision.py: chapter 12's GPT (small, fp32
masters) through `parallelize(..., mixed_precision=MixedPrecision(torch.bfloat16))` on a
(pp, dp, tp) mesh, against one process computing with the same mixed precision.

The one-process reference, written out: each replica's windows, cut into the pipeline's
microbatches, go through a bf16 cast of the fp32 masters; each microbatch's loss is computed in
fp32 from the logits cast up, its bf16 gradients are added into fp32 sums, microbatch by
microbatch; the replicas' sums are added and divided by their number (MiniDDP's and
fully_shard's order, a sum then one division); AdamW steps the fp32 masters. With a pipeline the
last stage computes the head with its own bf16 copy of the tied embedding, so the reference
does too (`untie`), and the two gradients meet in fp32 (TiedAcrossStages); in one piece the tie
is one bf16 copy, whose two uses autograd adds in bf16.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from miniddp import MixedPrecision
from miniddp.checkpoint import Progress, load_checkpoint, save_checkpoint
from miniddp.models.gpt import GPT
from miniddp.parallelize import AXES, ParallelGPT, parallelize
from miniddp.sharding import clip_grad_norm_
from tests.mesh_tasks import mesh_once
from tests.parallelize_tasks import CONFIG, full_tensors, windows

BF16, FP32 = torch.bfloat16, torch.float32
MICROBATCHES, STEPS, LR = 2, 3, 1e-2


@dataclass(frozen=True)
class Scenario:
    """One composition: the mesh (pp, dp, tp), MiniDDP or fully_shard, bf16 or fp32."""

    shape: tuple[int, int, int]
    data_parallel: str = "ddp"
    precision: str = "bf16"

    @property
    def name(self) -> str:
        return f"{self.shape} {self.data_parallel} {self.precision}"

    @property
    def mixed_precision(self) -> MixedPrecision | None:
        return MixedPrecision(param_dtype=BF16) if self.precision == "bf16" else None


def build_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def replica_gradients(
    model: GPT, batch: torch.Tensor, microbatches: int, untie: bool, precision: str
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One replica's fp32 gradient sums over its microbatches, and its mean loss."""
    compute = copy.deepcopy(model)
    if precision == "bf16":
        compute = compute.to(BF16)  # the copies: each master rounded to bf16
    if untie:  # the last stage's own copy of the embedding, for the head
        compute.head.weight = nn.Parameter(compute.token.weight.detach().clone())
    sums: dict[str, torch.Tensor] = {}
    losses = []
    for piece in batch.tensor_split(microbatches):
        logits = compute(piece[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), piece[:, 1:].flatten())
        (loss / microbatches).backward()
        losses.append(loss.detach())
        for name, param in compute.named_parameters():
            grad, param.grad = param.grad, None
            sums[name] = grad.float() if name not in sums else sums[name] + grad  # fp32 sums
    return sums, torch.stack(losses).mean()


def one_process(shape: tuple[int, int, int], precision: str = "bf16") -> dict[str, Any]:
    """The reference for a mesh of this shape: its replicas and microbatches, in one process.
    Per step: every replica's loss, and the gradients' norm; the parameters at the end.

    On one thread, as every rank runs (tests/harness/pool.py): a bf16 matmul on CPU cuts its
    sums by thread, so two threads round otherwise (measured: the loss of step 1 moves by
    2e-5, and the training parts from the ranks')."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _one_process(shape, precision)
    finally:
        torch.set_num_threads(threads)


def _one_process(shape: tuple[int, int, int], precision: str) -> dict[str, Any]:
    pp, replicas, _ = shape
    model = build_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        parts = windows(step, replicas).tensor_split(replicas)
        microbatches = MICROBATCHES if pp > 1 else 1
        results = [replica_gradients(model, p, microbatches, pp > 1, precision) for p in parts]
        losses.append([loss.item() for _, loss in results])
        means = {}
        for name in results[0][0]:
            total = results[0][0][name]
            for sums, _ in results[1:]:
                total = total + sums[name]
            means[name] = total / replicas  # a sum, then one division
        if pp > 1:  # the tie: the two stages' gradients summed in fp32
            means["token.weight"] = means["token.weight"] + means.pop("head.weight")
        for name, param in model.named_parameters():
            param.grad = means[name]
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        optimizer.step()
        optimizer.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params}


class Dtypes:
    """The dtypes seen in a run: of the parameters inside forward (each module's own, read in
    its forward pre-hook), of what crosses each border (a stage's received inputs and its
    sent outputs), and outside: the parameters and gradients between steps, the loss."""

    def __init__(self, parts: ParallelGPT) -> None:
        self.inside: set[str] = set()
        self.crossing: set[str] = set()
        self.outside: set[str] = set()
        self.loss: set[str] = set()
        for module in parts.model.modules():
            if module._parameters:
                module.register_forward_pre_hook(self._inside)
        if parts.schedule is not None:
            self._watch_borders(parts.schedule.stage)

    def _inside(self, module: nn.Module, args: Any) -> None:
        self.inside |= {str(p.dtype) for p in module._parameters.values() if p is not None}

    def _watch_borders(self, stage: Any) -> None:
        forward = stage.forward

        def watched(microbatch: int, inputs: tuple, keep: bool = True) -> Any:
            if not stage.is_first:
                self.crossing |= {str(x.dtype) for x in inputs if x.is_floating_point()}
            output = forward(microbatch, inputs, keep)
            if not stage.is_last:
                self.crossing.add(str(output.dtype))
            return output

        stage.forward = watched

    def between_steps(self, parts: ParallelGPT) -> None:
        for param in parts.parameters():
            self.outside.add(str(param.dtype))
            if param.grad is not None:
                self.outside.add(f"grad {param.grad.dtype}")


def train(scenario: Scenario, checkpoint: str | None = None) -> dict[str, Any]:
    """`STEPS` AdamW steps of the scenario; each step's loss (its replica's, on the last stage)
    and the norm clip_grad_norm_ returns (max_norm inf: it scales by 1, so nothing changes),
    the dtypes seen, the full parameters; with `checkpoint`, a save and a load into a fresh
    parallelized GPT, and what the fresh one holds."""
    mesh = mesh_once(scenario.shape, AXES)
    parts = build(scenario)
    seen = Dtypes(parts)
    optimizer = torch.optim.AdamW(parts.parameters(), lr=LR)
    replicas, replica = scenario.shape[1], mesh["dp"].get_local_rank()
    losses, norms = [], []
    for step in range(STEPS):
        loss = parts.train_step(windows(step, replicas).tensor_split(replicas)[replica])
        seen.between_steps(parts)
        norm = clip_grad_norm_(parts.parameters(), max_norm=math.inf)
        seen.outside.add(f"norm {norm.dtype}")
        norms.append(norm.item())
        optimizer.step()
        optimizer.zero_grad()
        seen.between_steps(parts)
        if loss is not None:
            seen.loss.add(str(loss.dtype))
        losses.append(None if loss is None else loss.item())
    sharded = scenario.data_parallel == "fsdp" and replicas > 1
    result = {
        "losses": losses,
        "norms": norms,
        "params": full_tensors(parts.model, mesh, sharded),
        "dtypes": {k: sorted(getattr(seen, k)) for k in ("inside", "crossing", "outside", "loss")},
    }
    if checkpoint is not None:
        result["loaded"] = round_trip(scenario, parts, optimizer, Path(checkpoint))
    return result


def build(scenario: Scenario) -> ParallelGPT:
    mesh = mesh_once(scenario.shape, AXES)
    return parallelize(
        build_gpt(),
        mesh,
        n_microbatches=MICROBATCHES,
        data_parallel=scenario.data_parallel,
        mixed_precision=scenario.mixed_precision,
    )


def round_trip(
    scenario: Scenario, parts: ParallelGPT, optimizer: torch.optim.Optimizer, path: Path
) -> dict[str, Any]:
    """Save on every rank, load into a fresh parallelized GPT: what the file holds (the dtypes
    of its floating-point tensors: the model, Adam's moments and step counts), and whether the
    fresh one holds this one's parameters and moments, bit for bit, in fp32."""
    save_checkpoint(path, parts.model, optimizer, Progress(step=STEPS, epoch=0, batches_done=STEPS))
    fresh = build(scenario)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=LR)
    load_checkpoint(path, fresh.model, fresh_optimizer)
    saved = torch.load(path, weights_only=True)
    in_file = {str(t.dtype) for t in _tensors(saved) if t.is_floating_point()}
    pairs = zip(parts.parameters(), fresh.parameters(), strict=True)
    same = all(a.dtype == b.dtype == FP32 and torch.equal(a, b) for a, b in pairs)
    moments = [
        (optimizer.state[a][key], fresh_optimizer.state[b][key])
        for a, b in zip(parts.parameters(), fresh.parameters())
        for key in ("exp_avg", "exp_avg_sq")
    ]
    same_moments = all(a.dtype == b.dtype == FP32 and torch.equal(a, b) for a, b in moments)
    return {"file": sorted(in_file), "same": same, "same_moments": same_moments}


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for value in tree.values() for t in _tensors(value)]
    if isinstance(tree, (list, tuple)):
        return [t for value in tree for t in _tensors(value)]
    return []


def run_scenarios(scenarios: list[Scenario], checkpoint: str | None = None) -> list[dict]:
    """Several scenarios in one pool run (a pool's start is what costs); the first one saves
    and loads a checkpoint at `checkpoint` when given."""
    return [train(s, checkpoint if index == 0 else None) for index, s in enumerate(scenarios)]
