"""What the ranks run for tests/test_parallelize.py: chapter 12's GPT, small and in float64,
through `miniddp.parallelize.parallelize` on a (pp, dp, tp) mesh, against one process."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from miniddp.models.gpt import GPT, GPTConfig
from miniddp.parallelize import parallelize
from miniddp.sharding import full_state_dict
from tests.mesh_tasks import mesh_once

CONFIG = GPTConfig(vocab_size=16, context=8, width=16, layers=2, heads=4, dropout=0.0)
WINDOWS_PER_REPLICA, STEPS = 4, 3
SPLIT_DIM = {  # what the plan cuts, along which dim (the rest is replicated)
    "token.weight": 0,
    "attention.qkv.weight": 0,
    "attention.qkv.bias": 0,
    "attention.proj.weight": 1,
    "mlp.up.weight": 0,
    "mlp.up.bias": 0,
    "mlp.down.weight": 1,
}


def build_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG).double()


def windows(step: int, replicas: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    shape = (replicas * WINDOWS_PER_REPLICA, CONFIG.context + 1)
    return torch.randint(CONFIG.vocab_size, shape, generator=generator)


def one_process(replicas: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        batch = windows(step, replicas)
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_parallel(shape: tuple[int, int, int], data_parallel: str) -> dict:
    mesh = mesh_once(shape, ("pp", "dp", "tp"))
    parts = parallelize(build_gpt(), mesh, n_microbatches=2, data_parallel=data_parallel)
    optimizer = torch.optim.AdamW(parts.parameters(), lr=1e-2)
    replica = mesh["dp"].get_local_rank()
    losses = []
    for step in range(STEPS):
        loss = parts.train_step(windows(step, shape[1]).tensor_split(shape[1])[replica])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(None if loss is None else loss.item())
    sharded = data_parallel == "fsdp" and shape[1] > 1
    return {"losses": losses, "params": full_tensors(parts.model, mesh, sharded)}


def full_tensors(part, mesh, sharded: bool) -> dict[str, torch.Tensor]:
    state = full_state_dict(part) if sharded else dict(part.named_parameters())
    tp = mesh["tp"].size()
    full = {}
    for name, tensor in state.items():
        dim = next((d for suffix, d in SPLIT_DIM.items() if name.endswith(suffix)), None)
        tensor = tensor.detach()
        if name == "head.weight":
            dim = 0  # the tied copy on the last stage: cut as the embedding is
        if tp > 1 and dim is not None:
            pieces = [torch.empty_like(tensor) for _ in range(tp)]
            dist.all_gather(pieces, tensor.contiguous(), group=mesh["tp"].get_group())
            tensor = torch.cat(pieces, dim)
        full[name] = tensor.clone()
    return full


def what_parallelize_says(mistake: str) -> str:
    """The error a mistake gets, on this rank, or 'accepted' (shape (pp, dp, tp) per mistake):

    heads    3 heads over tp = 2 (width 12: qkv's 36 rows split evenly, heads do not)
    window   windows of 9 + 1 tokens for a context of 8, under a two-stage pipeline"""
    if mistake == "heads":
        mesh = mesh_once((1, 1, 2), ("pp", "dp", "tp"))
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=16, context=8, width=12, layers=2, heads=3, dropout=0))
        windows_given = torch.randint(16, (2, 9))
    else:
        mesh = mesh_once((2, 1, 1), ("pp", "dp", "tp"))
        model = build_gpt()
        windows_given = torch.randint(16, (2, CONFIG.context + 2))
    try:
        parts = parallelize(model.double(), mesh, n_microbatches=2)
        parts.train_step(windows_given)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "accepted"


@dataclass(frozen=True)
class MeshScenario:
    """One composition on a (pp, dp, THIRD, tp) mesh (THIRD: cp or ep), MiniDDP or fully_shard,
    float64 or bf16 on fp32 masters, and how many train_step calls make one optimizer step."""

    THIRD: ClassVar[str]
    shape: tuple[int, int, int, int]
    data_parallel: str = "ddp"
    precision: str = "fp64"
    accumulate: int = 1

    @property
    def name(self) -> str:
        pp, dp, third, tp = self.shape
        extra = f"-accumulate{self.accumulate}" if self.accumulate > 1 else ""
        axes = f"pp{pp}-dp{dp}-{self.THIRD}{third}-tp{tp}"
        return f"{axes}-{self.data_parallel}-{self.precision}{extra}"


def pooled_runs(
    rank_pools, groups: list[list], run, checkpoint_group: list, path: str, *args, timeout: float
):
    """`results(scenario)`: every rank's result of `scenario`. Each group of scenarios (one
    world size) runs together, `run(group, checkpoint, *args)` in one pool run (a pool's start
    is what costs), the first time one of them is asked for; the checkpoint `path` goes to
    `checkpoint_group`'s run alone."""
    done: dict = {}

    def results(scenario) -> list[dict]:
        if scenario not in done:
            group = next(g for g in groups if scenario in g)
            checkpoint = path if group is checkpoint_group else None
            per_rank = rank_pools(math.prod(scenario.shape)).run(
                run, group, checkpoint, *args, timeout=timeout
            )
            done.update({s: [rank[i] for rank in per_rank] for i, s in enumerate(group)})
        return done[scenario]

    return results
