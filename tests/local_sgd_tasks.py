"""What the ranks of the test pool run for tests/test_local_sgd.py: one small model trained
with MiniDDP's LocalSGD and DiLoCo, each rank a replica with its own data, and the same runs
written with torch's PostLocalSGDOptimizer or by hand. tests/torchft_reference.py runs
torchft's DiLoCo on the same model and data."""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from miniddp.local_sgd import DiLoCo, LocalSGD


@dataclass(frozen=True)
class Spec:
    replicas: int = 2
    sync_every: int = 3
    outer_steps: int = 3
    fragments: int = 1  # Streaming DiLoCo's F: the model's Linear layers, split in F runs
    delay: int = 0
    widths: tuple[int, ...] = (5, 8, 3)
    seed: int = 0
    inner: str = "adamw"  # or "sgd"
    inner_lr: float = 0.01
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    exchange_dtype: str | None = None  # "bfloat16"
    algorithm: str = "gloo"  # or one of the course's all-reduces: "ring", ...

    @property
    def inner_steps(self) -> int:
        return self.sync_every * self.outer_steps


def build_model(spec: Spec) -> nn.Sequential:
    """The same initial weights on every replica (every rank seeds alike)."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(spec.seed)
    layers: list[nn.Module] = []
    for a, b in zip(spec.widths, spec.widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    torch.random.set_rng_state(generator_state)
    return nn.Sequential(*layers[:-1])


def fragments_of(model: nn.Sequential, count: int) -> list[nn.Module]:
    """The Linear layers, in `count` consecutive runs."""
    linears = [m for m in model if isinstance(m, nn.Linear)]
    per = len(linears) // count
    return [nn.ModuleList(linears[i * per : (i + 1) * per]) for i in range(count)]


def batch(spec: Spec, replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed * 7919 + replica * 101 + step * 13)
    return torch.randn(4, spec.widths[0], generator=g), torch.randn(4, spec.widths[-1], generator=g)


def inner_optimizer(spec: Spec, params) -> torch.optim.Optimizer:
    if spec.inner == "sgd":
        return torch.optim.SGD(params, lr=spec.inner_lr)
    return torch.optim.AdamW(params, lr=spec.inner_lr)


def outer_optimizer(spec: Spec, params) -> torch.optim.Optimizer:
    nesterov = spec.outer_momentum > 0
    return torch.optim.SGD(
        params, lr=spec.outer_lr, momentum=spec.outer_momentum, nesterov=nesterov
    )


def train(
    spec: Spec,
    model: nn.Module,
    inner: torch.optim.Optimizer,
    replica: int,
    steps: range | None = None,
    forward: nn.Module | None = None,
    clip: float | None = None,
) -> None:
    """Inner steps on this replica's batches (`forward`: a wrapper of `model`, e.g. MiniDDP)."""
    for step in steps or range(spec.inner_steps):
        x, y = batch(spec, replica, step)
        inner.zero_grad()
        nn.functional.mse_loss((forward or model)(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        inner.step()


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def diloco(spec: Spec, groups: list[list[int]] | None = None) -> dict:
    """Our DiLoCo on this rank's replica, over the whole job or, with `groups`, over the group
    that holds this rank (its replica number: its place in that group)."""
    group, replica = None, dist.get_rank()
    for ranks in groups or []:
        made = dist.new_group(ranks)  # every rank makes every group, in the same order
        if dist.get_rank() in ranks:
            group, replica = made, ranks.index(dist.get_rank())
    model = build_model(spec)
    inner = inner_optimizer(spec, model.parameters())
    outer = outer_optimizer(spec, model.parameters())
    dtype = getattr(torch, spec.exchange_dtype) if spec.exchange_dtype else None
    fragments = fragments_of(model, spec.fragments) if spec.fragments > 1 else None
    run = DiLoCo(
        model,
        inner,
        outer,
        spec.sync_every,
        process_group=group,
        fragments=fragments,
        fragment_sync_delay=spec.delay,
        exchange_dtype=dtype,
        algorithm=spec.algorithm,
    )
    with run:
        train(spec, model, inner, replica)
    return {
        "params": params_of(model),
        "sent_bytes": run.sent_bytes,
        "syncs_each": [f.syncs for f in run.fragments],
    }


def diloco_with_fragments_given(spec: Spec) -> list[torch.Tensor]:
    """DiLoCo with fragments=[the whole model]: Streaming DiLoCo with one fragment."""
    model = build_model(spec)
    inner = inner_optimizer(spec, model.parameters())
    outer = outer_optimizer(spec, model.parameters())
    with DiLoCo(model, inner, outer, spec.sync_every, fragments=[model]):
        train(spec, model, inner, dist.get_rank())
    return params_of(model)


def synchronous_data_parallel(spec: Spec) -> list[torch.Tensor]:
    """Inner SGD on the gradient averaged over the replicas every step: plain synchronous DP."""
    model = build_model(spec)
    inner = inner_optimizer(spec, model.parameters())
    world = dist.get_world_size()
    for step in range(spec.inner_steps):
        x, y = batch(spec, dist.get_rank(), step)
        inner.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        inner.step()
    return params_of(model)


def local_sgd_against_torch(spec: Spec) -> dict:
    """LocalSGD, and torch's PostLocalSGDOptimizer + PeriodicModelAverager with the warm-up
    that makes it average after the same steps (local_sgd.py's docstring says why H - 1)."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    ours = build_model(spec)
    inner = inner_optimizer(spec, ours.parameters())
    with LocalSGD(ours, spec.sync_every) as local_sgd:
        train(spec, ours, inner, dist.get_rank())
    theirs = build_model(spec)
    subgroup = dist.new_group(list(range(dist.get_world_size())))
    averager = PeriodicModelAverager(
        period=spec.sync_every, warmup_steps=spec.sync_every - 1, process_group=subgroup
    )
    optimizer = PostLocalSGDOptimizer(inner_optimizer(spec, theirs.parameters()), averager)
    train(spec, theirs, optimizer, dist.get_rank())
    return {"ours": params_of(ours), "theirs": params_of(theirs), "syncs": local_sgd.syncs}


def refused(build: str) -> None:
    """Build something DiLoCo or LocalSGD must refuse; the test reads the message."""
    from miniddp.placement import TensorShard, mark

    spec = Spec()
    model = build_model(spec)
    inner = inner_optimizer(spec, model.parameters())
    outer = outer_optimizer(spec, model.parameters())
    if build == "sync_every_0":
        DiLoCo(model, inner, outer, 0)
    elif build == "local_sgd_sync_every_0":
        LocalSGD(model, 0)
    elif build == "outer_over_other_params":
        other = build_model(spec)
        DiLoCo(model, inner, outer_optimizer(spec, other.parameters()), 2)
    elif build == "tensor_parallel_group":
        mark(model[0].weight, tensor=TensorShard(None, 0))
        DiLoCo(model, inner, outer, 2)
    elif build == "fragments_not_covering":
        DiLoCo(model, inner, outer, 2, fragments=[model[0]])
    elif build == "fragments_overlapping":
        DiLoCo(model, inner, outer, 2, fragments=[model, model[2]])
    elif build == "delay_too_long":
        DiLoCo(model, inner, outer, 4, fragments=[model[0], model[2]], fragment_sync_delay=2)
    elif build == "replicas_start_apart":
        with torch.no_grad():
            model[0].bias.add_(dist.get_rank())
        DiLoCo(model, inner, outer, 2)
    elif build == "step_outside_with":
        DiLoCo(model, inner, outer, 2)
        train(spec, model, inner, dist.get_rank())
    else:
        raise AssertionError(build)


def diloco_resumes_bitwise(spec: Spec) -> dict:
    """A run straight through, and one saved after half its outer steps, rebuilt from nothing,
    loaded and finished: the same bits."""
    half = spec.sync_every * (spec.outer_steps // 2)

    def build():
        model = build_model(spec)
        inner = inner_optimizer(spec, model.parameters())
        outer = outer_optimizer(spec, model.parameters())
        fragments = fragments_of(model, spec.fragments) if spec.fragments > 1 else None
        return model, inner, DiLoCo(model, inner, outer, spec.sync_every, fragments=fragments)

    rank = dist.get_rank()
    model, inner, run = build()
    with run:
        train(spec, model, inner, rank)
    straight = params_of(model)

    model, inner, run = build()
    with run:
        train(spec, model, inner, rank, range(half))
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "diloco": run.state_dict()}, saved)
    del model, inner, run
    model, inner, run = build()
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    model.load_state_dict(state["model"])
    run.load_state_dict(state["diloco"])
    with run:
        train(spec, model, inner, rank, range(half, spec.inner_steps))
    return {"straight": straight, "resumed": params_of(model)}


def diloco_across_ddp_replicas(
    spec: Spec, by_hand: bool, clip: float = 0.5, inside: str = "ddp"
) -> list:
    """A (diloco, dp) = (2, 2) mesh: MiniDDP (or fully_shard) inside each replica over "dp",
    DiLoCo across "diloco", inner gradients clipped; or the same run written by hand with
    all_reduce. Returns the full parameters."""
    from miniddp import MiniDDP, full_state_dict, fully_shard
    from miniddp.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("diloco", "dp"))
    replicas, dp = mesh["diloco"].get_group(), mesh["dp"].get_group()
    data = mesh["diloco"].get_local_rank() * 2 + mesh["dp"].get_local_rank()
    model = build_model(spec)
    inner = inner_optimizer(spec, model.parameters())
    outer = outer_optimizer(spec, model.parameters())
    if not by_hand and inside == "fully_shard":  # each rank of a replica holds a flat piece
        from miniddp.sharding.clipping import clip_grad_norm_

        fully_shard(model, process_group=dp)
        inner = inner_optimizer(spec, model.parameters())
        outer = outer_optimizer(spec, model.parameters())
        with DiLoCo(model, inner, outer, spec.sync_every, process_group=replicas):
            for step in range(spec.inner_steps):
                x, y = batch(spec, data, step)
                inner.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                clip_grad_norm_(model.parameters(), clip)
                inner.step()
        return list(full_state_dict(model).values())
    if not by_hand:
        ddp = MiniDDP(model, process_group=dp)
        with DiLoCo(model, inner, outer, spec.sync_every, process_group=replicas):
            train(spec, model, inner, data, forward=ddp, clip=clip)
        return params_of(model)
    global_params = params_of(model)
    for step in range(spec.inner_steps):
        x, y = batch(spec, data, step)
        inner.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():  # DDP: each gradient times 1/W, summed
            p.grad.mul_(1 / dist.get_world_size(dp))
            dist.all_reduce(p.grad, group=dp)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        inner.step()
        if (step + 1) % spec.sync_every:
            continue
        with torch.no_grad():  # DiLoCo: average θ_g − θ, restore θ_g, outer step on it
            for p, g in zip(model.parameters(), global_params):
                pseudo = g - p
                dist.all_reduce(pseudo, group=replicas)
                p.copy_(g)
                p.grad = pseudo / dist.get_world_size(replicas)
        outer.step()
        outer.zero_grad()
        global_params = params_of(model)
    return params_of(model)
