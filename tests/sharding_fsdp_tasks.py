"""What the ranks of the test pool run for tests/test_sharding_fsdp.py: one model trained with
miniddp.fully_shard, torch's fully_shard (FSDP2) and MiniDDP, all with AdamW, on the same data.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from miniddp import MiniDDP, full_state_dict, fully_shard
from miniddp.collectives import record_messages, traffic
from miniddp.sharding import measure_memory
from miniddp.sharding.sharded_parameters import cut


@dataclass(frozen=True)
class FsdpSpec:
    seed: int = 0
    widths: tuple[int, ...] = (5, 8, 7, 3)  # input, hidden..., output; sizes rarely divide W
    steps: int = 3
    batch: int = 4
    accumulation: int = 1  # micro-steps per step; all but the last without gradient sync
    reshard_after_forward: bool = True
    lr: float = 0.01
    twice: bool = False  # one more square layer, called twice in every forward


def build_model(spec: FsdpSpec) -> nn.Sequential:
    torch.manual_seed(spec.seed)
    layers: list[nn.Module] = []
    for a, b in zip(spec.widths, spec.widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    if spec.twice:
        square = nn.Linear(spec.widths[-1], spec.widths[-1])
        layers += [nn.Tanh(), square, nn.Tanh(), square]
    return nn.Sequential(*layers[:-1] if not spec.twice else layers)


def batch(spec: FsdpSpec, rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed * 7919 + rank * 101 + step * 13 + micro)
    x = torch.randn(spec.batch, spec.widths[0], generator=g)
    return x, torch.randn(spec.batch, spec.widths[-1], generator=g)


def shard(kind: str, model: nn.Sequential, spec: FsdpSpec) -> nn.Module:
    """Every Linear, then the root: FSDP2's usage."""
    if kind == "ddp":
        return MiniDDP(model)
    if kind == "ours":
        apply = fully_shard
    else:
        from torch.distributed.fsdp import fully_shard as apply  # slow import
    for layer in dict.fromkeys(model):  # a layer called twice is sharded once
        if isinstance(layer, nn.Linear):
            apply(layer, reshard_after_forward=spec.reshard_after_forward)
    return apply(model, reshard_after_forward=spec.reshard_after_forward)


def full_parameters(kind: str, model: nn.Module) -> list[torch.Tensor]:
    """In state_dict order: a layer reachable by two names appears twice."""
    if kind == "ours":
        return [t.clone() for t in full_state_dict(model).values()]
    if kind == "torch":
        return [gathered_on_the_host(t) for t in model.state_dict().values()]
    return [t.detach().clone() for t in model.state_dict().values()]


def gathered_on_the_host(shard) -> torch.Tensor:
    """A torch FSDP parameter (a DTensor, Shard(0) on one mesh dimension, replicated on any
    other: HSDP's) whole: the rows of the ranks it is sharded over, gathered as host tensors.
    Not DTensor.full_tensor(): on GPU shards over gloo (one GPU shared by two ranks,
    scripts/gpu_check.sh) its functional all-gather crashes the process."""
    local = shard.to_local().detach().cpu()
    dims = [d for d, placement in enumerate(shard.placements) if placement.is_shard()]
    if not dims:
        return local.to(shard.device)
    pieces = [None] * shard.device_mesh.size(dims[0])
    dist.all_gather_object(pieces, local, group=shard.device_mesh.get_group(dims[0]))
    return torch.cat(pieces).to(shard.device)


def train(kind: str, spec: FsdpSpec, model=None, optimizer=None, first_step: int = 0) -> dict:
    """kind: "ours", "torch" (FSDP2) or "ddp" (MiniDDP). The full parameters after every step,
    the memory before the last step, and the bytes sent in each micro-step."""
    rank = dist.get_rank()
    model = shard(kind, build_model(spec), spec) if model is None else model
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    params, sent, collectives_run = [], [], []
    for step in range(first_step, first_step + spec.steps):
        for micro in range(spec.accumulation):
            synced = micro == spec.accumulation - 1
            if kind != "ddp":
                model.set_requires_gradient_sync(synced)
            traffic.reset()
            with record_messages() as messages:
                x, y = batch(spec, rank, step, micro)
                context = model.no_sync() if kind == "ddp" and not synced else _nothing()
                with context:
                    loss = nn.functional.mse_loss(model(x), y) / spec.accumulation
                    loss.backward()
            sent.append(traffic.bytes_sent)
            collectives_run.append(sorted({m.collective for m in messages}))
        memory = measure_memory(model.parameters(), optimizer)
        optimizer.step()
        optimizer.zero_grad()
        params.append(full_parameters(kind, model))
    return {
        "params": params,
        "memory": memory,
        "sent": sent,
        "collectives": collectives_run,
        "model": model,
        "optimizer": optimizer,
    }


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def against_torch_and_ddp(
    spec: FsdpSpec, kinds: tuple[str, ...] = ("ours", "torch", "ddp")
) -> dict:
    runs = {kind: train(kind, spec) for kind in kinds}
    ours = runs["ours"]
    return {
        "params": {kind: run["params"] for kind, run in runs.items()},
        "memory": ours["memory"],
        "sent": ours["sent"],
        "collectives": ours["collectives"],
        "shard_elements": sum(p.numel() for p in ours["model"].parameters()),
        "shard_tensors": len(list(ours["model"].parameters())),
    }


def resumes_bitwise(spec: FsdpSpec) -> dict:
    """2·steps straight, against `steps`, a per-rank save of the sharded model and optimizer, a
    load into a fresh sharded model, and `steps` more."""
    straight = train("ours", replace(spec, steps=2 * spec.steps))["params"][-1]
    first = train("ours", spec)
    buffer = io.BytesIO()
    torch.save(
        {"model": first["model"].state_dict(), "optimizer": first["optimizer"].state_dict()}, buffer
    )
    checkpoint = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    model = shard("ours", build_model(replace(spec, seed=spec.seed + 1)), spec)
    model.load_state_dict(checkpoint["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    optimizer.load_state_dict(checkpoint["optimizer"])
    resumed = train("ours", spec, model, optimizer, first_step=spec.steps)["params"][-1]
    return {"straight": straight, "resumed": resumed}


def shard_twice() -> None:
    model = build_model(FsdpSpec())
    fully_shard(model)
    fully_shard(model)


def shard_different_models() -> None:
    """Rank 1 builds a wider hidden layer: its shards would not match rank 0's."""
    widths = (5, 8, 3) if dist.get_rank() == 0 else (5, 9, 3)
    fully_shard(build_model(FsdpSpec(widths=widths)))


def shard_mixed_dtypes() -> None:
    fully_shard(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()))


def evaluation_between_steps(spec: FsdpSpec) -> dict:
    """A no_grad forward after every step (evaluation): ours and MiniDDP's outputs."""
    outputs = {}
    for kind in ("ours", "ddp"):
        model = shard(kind, build_model(spec), spec)
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
        outputs[kind] = []
        for step in range(spec.steps):
            x, y = batch(spec, dist.get_rank(), step, 0)
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                outputs[kind].append(model(x))
    return outputs


def resumes_through_save_checkpoint(spec: FsdpSpec, path: str) -> dict:
    """The issue's repro, through miniddp.checkpoint: `steps` steps, save_checkpoint on every
    rank, a fresh sharded model (other weights) resumed by load_checkpoint, `steps` more; and
    2·steps straight. Also the full parameters just before the save and just after the load."""
    from miniddp.checkpoint import Progress, load_checkpoint, save_checkpoint

    straight = train("ours", replace(spec, steps=2 * spec.steps))["params"][-1]
    first = train("ours", spec)
    before = full_parameters("ours", first["model"])
    save_checkpoint(path, first["model"], first["optimizer"], Progress(spec.steps, 0, spec.steps))
    model = shard("ours", build_model(replace(spec, seed=spec.seed + 1)), spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    step = load_checkpoint(path, model, optimizer).progress.step
    after = full_parameters("ours", model)
    resumed = train("ours", spec, model, optimizer, first_step=step)["params"][-1]
    return {"straight": straight, "resumed": resumed, "before": before, "after": after}


def resume_at_this_world_size(spec: FsdpSpec, path: str) -> dict:
    """Load a checkpoint saved at another world size into a model sharded for this one, and
    train on: the full parameters after the load and after `steps` more."""
    from miniddp.checkpoint import load_checkpoint

    model = shard("ours", build_model(replace(spec, seed=spec.seed + 1)), spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    loaded = load_checkpoint(path, model, optimizer, allow_world_size_change=True)
    after = full_parameters("ours", model)
    state = optimizer.state_dict()["state"]
    resumed = train("ours", spec, model, optimizer, first_step=loaded.progress.step)
    return {
        "after": after,
        "resumed": resumed["params"][-1],
        "steps": [s["step"] for s in state.values()],
    }


def tied_across_units(library: str) -> None:
    """The issue's repro: m[1] shares m[0]'s weight, m[1] sharded alone, then the root."""
    if library == "ours":
        apply = fully_shard
    else:
        from torch.distributed.fsdp import fully_shard as apply
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    apply(model[1])
    apply(model)
    model(torch.randn(2, 4)).sum().backward()  # torch refuses at its first forward


def child_after_root() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    fully_shard(model)
    fully_shard(model[0])


def child_called_on_its_own() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    fully_shard(model)
    model[0](torch.randn(2, 4))


def skip_a_unit_on_rank_1() -> None:
    """Rank 0 runs the whole model; rank 1 only its last unit (a branch in the forward)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    if dist.get_rank() == 0:
        model(torch.randn(3, 4)).sum().backward()
    else:
        model[2](torch.randn(3, 8)).sum().backward()


def optimizer_in_backward(kind: str, spec: FsdpSpec) -> dict:
    """Each parameter steps with its own SGD in a post-accumulate-grad hook, the moment its
    gradient is complete (torch's optimizer-in-backward recipe); "plain" steps after backward.
    fully_shard writes each shard's `.grad` itself, so it must run the hooks itself."""
    library = "torch" if kind == "torch" else "ours"
    model = shard(library, build_model(spec), spec)
    calls = []
    if kind == "plain":
        whole = torch.optim.SGD(model.parameters(), lr=spec.lr)
    else:
        for param in model.parameters():
            optimizer = torch.optim.SGD([param], lr=spec.lr)

            def step_now(param: torch.Tensor, optimizer=optimizer) -> None:
                calls.append(param.grad is not None)
                optimizer.step()
                optimizer.zero_grad()

            param.register_post_accumulate_grad_hook(step_now)
    for step in range(spec.steps):
        x, y = batch(spec, dist.get_rank(), step, 0)
        nn.functional.mse_loss(model(x), y).backward()
        if kind == "plain":
            whole.step()
            whole.zero_grad()
    return {"params": full_parameters(library, model), "calls": calls}


def divided_by_a_factor(factor: float) -> bool:
    """fully_shard with set_gradient_divide_factor(factor) against the same sum by hand: the
    ranks' full gradients all-reduced (summed), divided by `factor`, cut as the shards are."""
    torch.manual_seed(0)
    model, reference = nn.Linear(5, 3), nn.Linear(5, 3)
    reference.load_state_dict(model.state_dict())
    fully_shard(model).set_gradient_divide_factor(factor)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    same = []
    for shard, full in zip(model.parameters(), reference.parameters()):
        dist.all_reduce(full.grad)
        expected = cut(full.grad / factor, dist.get_rank(), dist.get_world_size())
        same.append(torch.equal(shard.grad.reshape(-1), expected))
    return all(same) and len(same) == 2
