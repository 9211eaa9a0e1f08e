"""Sending Python objects (not tensors) between ranks, with tensor collectives only.

torch.distributed has `all_gather_object` and `broadcast_object_list`, but in torch 2.13's CPU
build they need numpy, which MiniDDP does not otherwise depend on. These two do the same in a
few lines, and show how object collectives work: pickle the object into bytes, tell everyone how
many, pad to the longest, move the bytes as a uint8 tensor, unpickle.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """NCCL only moves GPU tensors; gloo moves CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_bytes_tensor(obj: Any, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _from_bytes_tensor(tensor: torch.Tensor, size: int) -> Any:
    return pickle.loads(bytes(tensor[:size].cpu().tolist()))


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `obj`, as a list indexed by rank (only pickle-able objects; only from
    processes you trust, since unpickling runs code)."""
    device = _device(group)
    payload = _to_bytes_tensor(obj, device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    return [_from_bytes_tensor(t, int(s)) for t, s in zip(gathered, sizes)]


def broadcast_object(obj: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """Global rank `src`'s `obj`, on every rank (the others' `obj` is ignored)."""
    device = _device(group)
    is_src = dist.get_rank() == src
    payload = _to_bytes_tensor(obj, device) if is_src else None
    size = torch.tensor([payload.numel() if is_src else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    if not is_src:
        payload = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=src, group=group)
    return _from_bytes_tensor(payload, int(size))
