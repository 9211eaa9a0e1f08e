"""What the ranks of the test pool run for tests/test_sharding_hsdp.py: the model of
tests/sharding_fsdp_tasks.py under HSDP (fully_shard over a 2-D mesh), with miniddp's
fully_shard and torch's, and with MiniDDP over every rank, all with AdamW, on the same data.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from miniddp import MiniDDP, fully_shard
from miniddp.mesh import init_device_mesh
from miniddp.parallelize import HSDP_AXES, parallelize
from miniddp.sharding import MixedPrecisionPolicy, clip_grad_norm_
from tests import parallelize_tasks
from tests.mesh_tasks import mesh_once
from tests.sharding_fsdp_tasks import FsdpSpec, batch, build_model, full_parameters, train

NAMES = ("replicate", "shard")


def mesh_of(library: str, shape: tuple[int, ...]):
    """One mesh per library and shape per process: init_device_mesh makes new groups."""
    names = NAMES[-len(shape) :]
    return mesh_once(shape, names) if library == "ours" else _torchs_mesh(shape, names)


@functools.cache
def _torchs_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def shard(kind: str, spec: FsdpSpec, shape: tuple[int, ...], policy: dict | None = None):
    """Every Linear, then the root, over the mesh of `shape`: FSDP2's usage. "ddp": MiniDDP
    over every rank, the reference a replicated model gives."""
    model = build_model(spec)
    if kind == "ddp":
        return MiniDDP(model)
    options: dict = {"mesh": mesh_of(kind, shape)}
    if kind == "ours":
        apply = fully_shard
        if policy is not None:
            options["mp_policy"] = MixedPrecisionPolicy(**policy)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        from torch.distributed.fsdp import fully_shard as apply

        if policy is not None:
            options["mp_policy"] = TorchPolicy(**policy)
    for layer in model:
        if isinstance(layer, nn.Linear):
            apply(layer, **options)
    return apply(model, **options)


def against_torch(
    spec: FsdpSpec,
    shape: tuple[int, ...] = (2, 2),
    policy: dict | None = None,
    kinds: tuple[str, ...] = ("ours", "torch", "ddp"),
) -> dict:
    """The full parameters after every step, per kind; our bytes sent and collectives run.
    Kind "unprefetched": ours with set_prefetch(False), every collective waited for at once."""
    runs = {}
    for kind in kinds:
        library = "ours" if kind == "unprefetched" else kind
        model = shard(library, spec, shape, policy)
        if kind == "unprefetched":
            model.set_prefetch(False)
        runs[kind] = train(library, spec, model)
    ours = runs["ours"]
    return {
        "params": {kind: run["params"] for kind, run in runs.items()},
        "sent": {kind: run["sent"] for kind, run in runs.items()},
        "collectives": ours["collectives"],
        "shard_elements": sum(p.numel() for p in ours["model"].parameters()),
    }


def clipped_norms(spec: FsdpSpec, max_norm: float) -> dict:
    """One backward under HSDP and under MiniDDP over every rank, then each clip: ours over
    the shards, torch's over MiniDDP's full averaged gradients (the true norm)."""
    norms, grads = {}, {}
    for kind in ("ours", "ddp"):
        model = shard(kind, spec, (2, 2))
        x, y = batch(spec, dist.get_rank(), 0, 0)
        nn.functional.mse_loss(model(x), y).backward()
        clip = clip_grad_norm_ if kind == "ours" else torch.nn.utils.clip_grad_norm_
        norms[kind] = clip(model.parameters(), max_norm)
        grads[kind] = [p.grad.clone() for p in model.parameters()]
    shard_elements = sum(g.numel() for g in grads["ours"])
    return {"norms": norms, "shard_elements": shard_elements}


def resumes_at_another_mesh(spec: FsdpSpec, path: str, shape: tuple[int, ...]) -> dict:
    """`steps` steps on a 2 x 2 mesh, save_checkpoint; a fresh model (other weights) on a mesh
    of `shape` loads it and trains `steps` more; against 2·steps straight on 2 x 2. Also the
    full parameters just before the save and just after the load."""
    from miniddp.checkpoint import Progress, load_checkpoint, save_checkpoint

    straight = train("ours", replace(spec, steps=2 * spec.steps), shard("ours", spec, (2, 2)))
    first = train("ours", spec, shard("ours", spec, (2, 2)))
    before = full_parameters("ours", first["model"])
    save_checkpoint(path, first["model"], first["optimizer"], Progress(spec.steps, 0, spec.steps))
    model = shard("ours", replace(spec, seed=spec.seed + 1), shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    step = load_checkpoint(path, model, optimizer).progress.step
    after = full_parameters("ours", model)
    resumed = train("ours", spec, model, optimizer, first_step=step)["params"][-1]
    return {
        "straight": straight["params"][-1],
        "resumed": resumed,
        "before": before,
        "after": after,
        "shard_elements": sum(p.numel() for p in model.parameters()),
    }


def shard_over_a_mesh_of(shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    fully_shard(build_model(FsdpSpec()), mesh=init_device_mesh("cpu", shape, mesh_dim_names=names))


def shard_over_a_mesh_and_a_group() -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    fully_shard(build_model(FsdpSpec()), mesh=mesh, process_group=mesh.get_group())


def shard_over_torchs_mesh() -> None:
    from torch.distributed.device_mesh import init_device_mesh as torchs

    fully_shard(build_model(FsdpSpec()), mesh=torchs("cpu", (dist.get_world_size(),)))


def parallel_gpt_over_hsdp(shape: tuple[int, int, int, int]) -> dict:
    """tests/parallelize_tasks.py's GPT through parallelize, on a (pp, dp_replicate, dp_shard,
    tp) mesh: its losses and full parameters after each step, as train_parallel's."""
    mesh = mesh_once(shape, HSDP_AXES)
    parts = parallelize(parallelize_tasks.build_gpt(), mesh, data_parallel="fsdp")
    optimizer = torch.optim.AdamW(parts.parameters(), lr=1e-2)
    shards = mesh["dp_shard"].size()
    replicas = mesh["dp_replicate"].size() * shards
    replica = mesh["dp_replicate"].get_local_rank() * shards + mesh["dp_shard"].get_local_rank()
    losses = []
    for step in range(parallelize_tasks.STEPS):
        windows = parallelize_tasks.windows(step, replicas).tensor_split(replicas)[replica]
        losses.append(parts.train_step(windows).item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "params": parallelize_tasks.full_tensors(parts.model, mesh, True)}


def parallelize_hsdp_with_ddp() -> None:
    mesh = mesh_once((1, 1, dist.get_world_size(), 1), HSDP_AXES)
    parallelize(parallelize_tasks.build_gpt(), mesh)
