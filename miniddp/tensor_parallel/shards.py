"""Which slice of a full tensor a rank keeps: torch's rule, `torch.chunk(t, W, dim)[rank]`.

Keeping torch's rule (not, say, an interleaved one) is what lets one test hold MiniDDP's tensor
parallelism and torch's side by side, shard for shard. Unlike torch's DTensor, a size that W does
not divide is refused: uneven chunks would give the ranks different shapes, and a module that
infers its heads from its projection's size would then compute nonsense on some rank.

The same holds for what indexes a vocabulary split by rows: a token id or target outside it is
owned by no rank, would be read as zeros by all, and is refused instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from miniddp.placement import TensorShard, mark

HOW_TO_LAUNCH = (
    "tensor parallelism needs a process group: start the script with torchrun (e.g. "
    "`torchrun --nproc_per_node=2 train.py`) and call miniddp.init_distributed() first"
)


def group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """W and this rank's place in the tensor-parallel group, or a clear error without one."""
    if not dist.is_initialized():
        raise RuntimeError(HOW_TO_LAUNCH)
    return dist.get_world_size(group), dist.get_rank(group)


def local_chunk(
    tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None, where: str
) -> torch.Tensor:
    """This rank's chunk of `tensor` along `dim`, as its own storage (the full one can go)."""
    world_size, rank = group_size_and_rank(group)
    size = tensor.shape[dim]
    if size % world_size:
        raise ValueError(
            f"cannot split {where} of shape {tuple(tensor.shape)} along dim {dim} over "
            f"{world_size} tensor-parallel ranks: {size} is not divisible by {world_size}. "
            f"Choose a size that is a multiple of {world_size}, or a tensor-parallel group "
            f"whose size divides {size}."
        )
    return torch.chunk(tensor.detach(), world_size, dim)[rank].clone()


def local_parameter(
    param: torch.nn.Parameter, dim: int, group: dist.ProcessGroup | None, where: str
) -> torch.nn.Parameter:
    """A plain nn.Parameter holding this rank's chunk (no DTensor: the shard is the tensor),
    marked as one (miniddp/placement.py): checkpoints, clipping and MiniDDP read the mark."""
    shard = torch.nn.Parameter(local_chunk(param, dim, group, where), param.requires_grad)
    mark(shard, tensor=TensorShard(group, dim))
    return shard


def refuse_ids_outside(ids: torch.Tensor, vocab_size: int, what: str) -> None:
    """An id no rank owns would be looked up by none, and read as zeros, silently: refuse it, as
    one process's nn.Embedding and cross-entropy would."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise IndexError(
            f"a {what} outside [0, {vocab_size}): got ids from {int(ids.min())} to "
            f"{int(ids.max())}. Every id must name a row of the vocabulary (ignore_index is "
            "not supported: drop those positions before the loss)"
        )
