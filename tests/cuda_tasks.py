"""Task functions for tests/test_cuda.py, run by the rank pool's workers on CPU or on a GPU.

Each builds its tensors on `device` ("cpu", or "cuda": rank r on GPU r mod the GPU count, so two
ranks share one GPU when there is only one) and compares with a reference computed by torch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp import MiniDDP, collectives

STEPS = 3


def rank_device(kind: str) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    index = dist.get_rank() % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)]
    return nn.Sequential(*layers).to(device)


def _train(model: nn.Module, device: torch.device) -> list[torch.Tensor]:
    """A few SGD steps on this rank's own batches; returns the last gradients, then the weights."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(STEPS):
        optimizer.zero_grad()
        inputs = torch.randn(16, 8, generator=generator).to(device)
        model(inputs).square().mean().backward()
        optimizer.step()
    grads = [p.grad.detach().cpu() for p in model.parameters()]
    return grads + [p.detach().cpu() for p in model.parameters()]


def miniddp_and_torch_ddp(kind: str, backend: str | None) -> dict[str, object]:
    """Train MiniDDP and torch's DDP side by side over a group of `backend` (None: the pool's
    own gloo group); return where they ran and whether every gradient and weight is equal."""
    device = rank_device(kind)
    group = dist.new_group(backend=backend) if backend else None
    try:
        ours = _train(MiniDDP(_model(device), process_group=group, bucket_cap_mb=0.001), device)
        device_ids = [device] if device.type == "cuda" else None
        wrapped = DistributedDataParallel(
            _model(device), device_ids=device_ids, process_group=group, bucket_cap_mb=0.001
        )
        theirs = _train(wrapped, device)
        backend_used = dist.get_backend(group)
    finally:
        if group is not None:
            dist.destroy_process_group(group)
    return {
        "device": str(device),
        "backend": backend_used,
        "equal": all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)),
    }


def collectives_against_torch(kind: str, numel: int = 1000) -> dict[str, bool]:
    """Every send/recv algorithm of miniddp.collectives on `kind` tensors, against
    torch.distributed on CPU copies. Integer-valued floats: every order of addition is exact."""
    device, rank, world_size = rank_device(kind), dist.get_rank(), dist.get_world_size()
    values = torch.arange(numel, dtype=torch.float32) * (rank + 1)
    results = {}
    for algorithm in collectives.BROADCAST_ALGORITHMS:
        ours, theirs = values.to(device), values.clone()
        collectives.broadcast(ours, 0, algorithm=algorithm)
        dist.broadcast(theirs, 0)
        results[f"broadcast {algorithm}"] = torch.equal(ours.cpu(), theirs)
    for algorithm in collectives.REDUCE_ALGORITHMS:
        ours, theirs = values.to(device), values.clone()
        collectives.reduce(ours, 0, algorithm=algorithm)
        dist.reduce(theirs, 0)
        results[f"reduce {algorithm}"] = rank != 0 or torch.equal(ours.cpu(), theirs)  # root's
    for algorithm in collectives.ALL_REDUCE_ALGORITHMS:
        ours, theirs = values.to(device), values.clone()
        collectives.all_reduce(ours, algorithm=algorithm)
        dist.all_reduce(theirs)
        results[f"all_reduce {algorithm}"] = torch.equal(ours.cpu(), theirs)
    pieces = values.repeat(world_size)
    ours, theirs = torch.zeros(numel, device=device), torch.zeros(numel)
    collectives.reduce_scatter_tensor(ours, pieces.to(device))
    dist.reduce_scatter(theirs, list(pieces.clone().chunk(world_size)))
    results["reduce_scatter ring"] = torch.equal(ours.cpu(), theirs)
    ours, theirs = torch.zeros(world_size * numel, device=device), torch.zeros(world_size * numel)
    collectives.all_gather_into_tensor(ours, values.to(device))
    dist.all_gather(list(theirs.chunk(world_size)), values.clone())
    results["all_gather ring"] = torch.equal(ours.cpu(), theirs)
    return results
