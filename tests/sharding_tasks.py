"""What the ranks of the test pool run for tests/test_sharding*.py: one model, one data stream,
trained with several optimizers or sharding stages in turn, so that their bits can be compared.

Everything is deterministic from a `ShardSpec`, so every rank builds the same model, and each
rank draws its own data from its rank.
"""

from __future__ import annotations

import copy
import io
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from miniddp import MiniDDP, ZeroRedundancyOptimizer
from miniddp.sharding import ddp_buckets, measure_memory, reduce_scatter_hook


@dataclass(frozen=True)
class ShardSpec:
    seed: int = 0
    widths: tuple[int, ...] = (5, 8, 3)  # input, hidden..., output
    steps: int = 3
    batch: int = 4
    lr: float = 0.01
    weight_decay: float = 0.01
    groups: int = 1  # 2 puts the last layer in a group of its own, with half the lr


def build_model(spec: ShardSpec) -> nn.Sequential:
    torch.manual_seed(spec.seed)
    layers: list[nn.Module] = []
    for a, b in zip(spec.widths, spec.widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def param_groups(model: nn.Module, spec: ShardSpec) -> list[dict]:
    params = list(model.parameters())
    if spec.groups == 1:
        return [{"params": params}]
    return [{"params": params[:-2]}, {"params": params[-2:], "lr": spec.lr / 2}]


def batch(spec: ShardSpec, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed * 7919 + rank * 101 + step)
    x = torch.randn(spec.batch, spec.widths[0], generator=g)
    return x, torch.randn(spec.batch, spec.widths[-1], generator=g)


def make_optimizer(kind: str, model: nn.Module, spec: ShardSpec) -> torch.optim.Optimizer:
    groups = param_groups(model, spec)
    options = {"lr": spec.lr, "weight_decay": spec.weight_decay}
    if kind == "plain":
        return torch.optim.AdamW(groups, **options)
    if kind in ("ours", "zero2"):
        return ZeroRedundancyOptimizer(groups, torch.optim.AdamW, **options)
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero  # slow import

    return TorchZero(groups, torch.optim.AdamW, **options)


def train(
    spec: ShardSpec, kind: str, model: nn.Module | None = None, optimizer=None, first_step: int = 0
) -> dict:
    """MiniDDP + the optimizer `kind` ("plain" AdamW, "ours" or "torch" ZeRO-1, "zero2" ours
    with the reduce-scatter hook); the gradients and parameters of every step, and the memory
    before the last step. A resumed run passes its model, optimizer and first step."""
    rank = dist.get_rank()
    model = build_model(spec) if model is None else model
    ddp = MiniDDP(model)
    optimizer = make_optimizer(kind, model, spec) if optimizer is None else optimizer
    if kind == "zero2":
        ddp.register_comm_hook(optimizer, reduce_scatter_hook)
    grads, params = [], []
    for step in range(first_step, first_step + spec.steps):
        x, y = batch(spec, rank, step)
        nn.functional.mse_loss(ddp(x), y).backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        memory = measure_memory(model.parameters(), optimizer, ddp_buckets(ddp))
        optimizer.step()
        optimizer.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
    return {
        "grads": grads,
        "params": params,
        "memory": memory,
        "model": model,
        "optimizer": optimizer,
    }


def zero1_against_torch_and_plain(spec: ShardSpec) -> dict:
    """The parameters after every step under each optimizer, and who owns what."""
    runs = {kind: train(spec, kind) for kind in ("plain", "ours", "torch")}
    ours, theirs = runs["ours"]["optimizer"], runs["torch"]["optimizer"]
    index_of = {p: i for i, p in enumerate(runs["ours"]["model"].parameters())}
    torch_index = {p: i for i, p in enumerate(runs["torch"]["model"].parameters())}
    return {
        "params": {kind: run["params"] for kind, run in runs.items()},
        "owned": sorted(index_of[p] for g in ours.optim.param_groups for p in g["params"]),
        "torch_owned": sorted(
            torch_index[p] for g in theirs.optim.param_groups for p in g["params"]
        ),
        "local_state_elements": sum(
            t.numel() for s in ours.optim.state.values() for t in s.values() if t.dim()
        ),
    }


def state_dicts_on_rank(spec: ShardSpec, to: int) -> dict:
    """Our consolidated state dict, torch's ZeRO's and plain AdamW's, on rank `to`."""
    dicts = {}
    for kind in ("ours", "torch"):
        optimizer = train(spec, kind)["optimizer"]
        optimizer.consolidate_state_dict(to=to)
        dicts[kind] = optimizer.state_dict() if dist.get_rank() == to else None
    dicts["plain"] = train(spec, "plain")["optimizer"].state_dict()
    return dicts


def zero1_resumes_bitwise(spec: ShardSpec) -> dict:
    """Train 2·steps straight; and train `steps`, save model and consolidated optimizer on rank
    0, load both on every rank into a fresh model, train `steps` more."""
    straight = train(replace(spec, steps=2 * spec.steps), "ours")
    first = train(spec, "ours")
    first["optimizer"].consolidate_state_dict(to=0)
    saved = [None]
    if dist.get_rank() == 0:
        buffer = io.BytesIO()
        torch.save(
            {"model": first["model"].state_dict(), "optimizer": first["optimizer"].state_dict()},
            buffer,
        )
        saved = [buffer.getvalue()]
    dist.broadcast_object_list(saved, src=0)
    checkpoint = torch.load(io.BytesIO(saved[0]), weights_only=True)
    model = build_model(replace(spec, seed=spec.seed + 1))
    model.load_state_dict(checkpoint["model"])
    optimizer = make_optimizer("ours", model, spec)
    optimizer.load_state_dict(checkpoint["optimizer"])
    resumed = train(spec, "ours", model, optimizer, first_step=spec.steps)
    return {"straight": straight["params"][-1], "resumed": resumed["params"][-1]}


def state_dict_unconsolidated() -> None:
    train(ShardSpec(steps=1), "ours")["optimizer"].state_dict()


def zero2_against_plain(spec: ShardSpec) -> dict:
    """ZeRO-2 and MiniDDP + AdamW: gradients after backward, parameters after each step; which
    parameters this rank owns."""
    ours, plain = train(spec, "zero2"), train(spec, "plain")
    optimizer = ours["optimizer"]
    owned = [optimizer.owner_of(p) == optimizer.rank for p in ours["model"].parameters()]
    return {
        "ours": ours["grads"],
        "plain": plain["grads"],
        "owned": owned,
        "ours_params": ours["params"],
        "plain_params": plain["params"],
    }


def memory_of_each_stage(spec: ShardSpec) -> dict:
    """Bytes before the last step, under DDP, ZeRO-1 and ZeRO-2, and what this rank owns."""
    measured = {kind: train(spec, kind) for kind in ("plain", "ours", "zero2")}
    optimizer = measured["ours"]["optimizer"]
    mine = [
        p for p in measured["ours"]["model"].parameters() if optimizer.owner_of(p) == optimizer.rank
    ]
    return {
        "memory": {kind: run["memory"] for kind, run in measured.items()},
        "owned_elements": sum(p.numel() for p in mine),
        "owned_tensors": len(mine),
    }


def single_process(spec: ShardSpec, world_size: int) -> list[list[torch.Tensor]]:
    """The reference without any distribution: one process, AdamW, each step on the global
    batch (every rank's batch, concatenated); the parameters after every step."""
    model = build_model(spec)
    optimizer = make_optimizer("plain", model, spec)
    params = []
    for step in range(spec.steps):
        pairs = [batch(spec, rank, step) for rank in range(world_size)]
        x, y = (torch.cat(parts) for parts in zip(*pairs))
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
    return params


def zero_with_mixed_dtypes() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW)


def zero1_resumes_through_save_checkpoint(spec: ShardSpec, path: str) -> dict:
    """Chapter 06's guarantee with ZeRO-1: consolidate on rank 0, save_checkpoint, and a fresh
    model and optimizer resumed by load_checkpoint continue like a run that never stopped."""
    from miniddp.checkpoint import Progress, load_checkpoint, save_checkpoint

    straight = train(replace(spec, steps=2 * spec.steps), "ours")["params"][-1]
    first = train(spec, "ours")
    first["optimizer"].consolidate_state_dict(to=0)
    save_checkpoint(path, first["model"], first["optimizer"], Progress(spec.steps, 0, spec.steps))
    model = build_model(replace(spec, seed=spec.seed + 1))
    optimizer = make_optimizer("ours", model, spec)
    progress = load_checkpoint(path, model, optimizer).progress
    resumed = train(spec, "ours", model, optimizer, first_step=progress.step)["params"][-1]
    return {"straight": straight, "resumed": resumed}


def zero_with_a_group_added_later(spec: ShardSpec) -> dict:
    """One step over all but the last layer, then `add_param_group` with it (half the lr), then
    `steps` more: ours and torch's ZeroRedundancyOptimizer, each under MiniDDP."""
    runs = {}
    for kind in ("ours", "torch"):
        model = build_model(spec)
        ddp, params = MiniDDP(model), list(model.parameters())
        if kind == "ours":
            optimizer = ZeroRedundancyOptimizer(params[:-2], torch.optim.AdamW, lr=spec.lr)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

            optimizer = TorchZero(params[:-2], torch.optim.AdamW, lr=spec.lr)
        after = []
        for step in range(1 + spec.steps):
            if step == 1:
                optimizer.add_param_group({"params": params[-2:], "lr": spec.lr / 2})
            x, y = batch(spec, dist.get_rank(), step)
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            after.append([p.detach().clone() for p in params])
        index = {p: i for i, p in enumerate(params)}
        owned = sorted(index[p] for g in optimizer.optim.param_groups for p in g["params"])
        runs[kind] = {"params": after, "owned": owned}
    return runs


def zero2_gradients_and_their_ring_order_reference(spec: ShardSpec) -> dict:
    """ZeRO-2's averaged gradients of the parameters this rank owns, and what the ring makes of
    every rank's local gradient times fl(1/W): the piece of owner o starts at rank o+1, and each
    next rank adds its own in (tests/test_collectives.py's ring_reduce), one step at a time."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = build_model(spec)
    ddp = MiniDDP(model)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=spec.lr)
    ddp.register_comm_hook(optimizer, reduce_scatter_hook)
    ours, expected, divided = [], [], []  # divided: gloo's order, then / W
    for step in range(spec.steps):
        x, y = batch(spec, rank, step)
        local = copy.deepcopy(model)
        nn.functional.mse_loss(local(x), y).backward()
        everyone: list = [None] * world
        dist.all_gather_object(everyone, [p.grad for p in local.parameters()])
        nn.functional.mse_loss(ddp(x), y).backward()
        for index, param in enumerate(model.parameters()):
            owner = optimizer.owner_of(param)
            if owner != rank:
                continue
            scaled = [everyone[r][index].mul(1.0 / world) for r in range(world)]
            total = scaled[(owner + 1) % world]
            for k in range(2, world + 1):
                total = scaled[(owner + k) % world] + total
            ours.append(param.grad.clone())
            expected.append(total)
            divided.append(sum(everyone[r][index] for r in range(world)) / world)
        optimizer.step()
        optimizer.zero_grad()
    return {"ours": ours, "expected": expected, "divided": divided}
