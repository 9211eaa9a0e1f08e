"""What the ranks of the test pool run for tests/test_all_to_all.py: MiniDDP's all-to-all and
torch's on the same pieces, and the autograd forms' gradients.

The pieces are a function of (seed, sender, receiver) alone: counts[s][d] rows go from rank s
to rank d, every value naming where it came from, so a piece that lands in the wrong place is
caught by any comparison.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as functional

from miniddp import collectives
from miniddp.collectives import traffic


def counts_for(seed: int, world_size: int) -> list[list[int]]:
    """counts[s][d]: rows rank s sends rank d, from 0 to 3 (zeros are common)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (world_size, world_size), generator=g).tolist()


def exchange(seed: int, dtype: torch.dtype, row_shape: tuple[int, ...]) -> dict[str, object]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    counts = counts_for(seed, world_size)
    sends = counts[rank]
    receives = [counts[s][rank] for s in range(world_size)]
    g = torch.Generator().manual_seed(seed * 31 + rank)
    input = (torch.randn((sum(sends), *row_shape), generator=g) * 100).to(dtype)
    ours = torch.full((sum(receives), *row_shape), -1).to(dtype)
    theirs = ours.clone()
    traffic.reset()
    collectives.all_to_all_single(ours, input, receives, sends)
    dist.all_to_all_single(theirs, input, receives, sends)
    row_bytes = input[0:1].numel() * input.element_size()
    own = sends[rank] * row_bytes
    return {
        "bitwise": torch.equal(ours, theirs) and ours.dtype == theirs.dtype,
        "bytes_sent": traffic.bytes_sent,
        "expected_bytes_sent": sum(sends) * row_bytes - own,
    }


def gradients(seed: int) -> dict[str, bool]:
    """Forward and backward of ours and of torch's all_to_all_single_autograd, the same."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    counts = counts_for(seed, world_size)
    sends = counts[rank]
    receives = [counts[s][rank] for s in range(world_size)]
    g = torch.Generator().manual_seed(seed + rank)
    input = torch.randn(sum(sends), 3, generator=g, dtype=torch.float64)
    weight = torch.randn(sum(receives), 3, generator=g, dtype=torch.float64)
    results = []
    for run in (collectives.all_to_all_single_autograd, functional.all_to_all_single_autograd):
        x = input.clone().requires_grad_()
        group = dist.group.WORLD
        y = run(x, receives, sends, group)
        y = functional.wait_tensor(y) if run is not collectives.all_to_all_single_autograd else y
        (y * weight).sum().backward()
        results.append((y.detach(), x.grad))
    (ours, our_grad), (theirs, their_grad) = results
    return {"output": torch.equal(ours, theirs), "gradient": torch.equal(our_grad, their_grad)}


def refused(output_rows: int, input_splits: list[int] | None) -> str:
    """The message of a refused all-to-all (the same on every rank, and before any message)."""
    try:
        collectives.all_to_all_single(
            torch.zeros(output_rows, 2), torch.zeros(4, 2), None, input_splits
        )
    except ValueError as error:
        return str(error)
    return "accepted"
