"""Context parallelism on a whole model: its attention calls routed onto the ring, the rest as is.

A transformer's every layer but attention acts on each position alone (embeddings, LayerNorm,
the MLP, the residual additions, the loss), so it runs unchanged on this rank's S/W positions.
Only attention needs every key. So a model need not be rewritten for context parallelism: while
inside `sdpa_on_the_ring(group)`, each call of `F.scaled_dot_product_attention` runs as
`ring_attention` over `group` (torch's context_parallel swaps the same call, by its dispatcher).

    cp = mesh["cp"].get_group()
    local = [shard_sequence(t, 1, cp, load_balance=True) for t in (inputs, targets, positions)]
    with sdpa_on_the_ring(cp, load_balance=True):
        logits = model(local[0], positions=local[2])   # global positions: position embeddings
    loss = F.cross_entropy(logits.flatten(0, 1), local[1].flatten())   # this rank's mean
    loss.backward()

Two things a model must get right, and neither is attention's:
- **Positions are global.** A rank's tokens are not positions 0..S/W-1: a position embedding
  (or RoPE) must be given the positions `shard_sequence` gave the rank, sharded the same way.
- **Gradients are averaged over CP x DP.** Each rank's loss is the mean over its own S/W
  positions, and the whole sequence's mean loss is the mean of the W equal-sized parts. Ring
  attention's backward already sends dK and dV to the rank that owns them, so rank r's parameter
  gradient is that of its own part of the computation, for every rank's loss; the sum over the
  CP ranks is the gradient of the sum of their losses, and the mean loss's gradient is the sum
  / W: an average over the CP group, exactly what a DDP all-reduce over CP x DP does with each
  replica's 1/W. The trap is the other normalisation: a loss summed over local tokens and
  divided by the *global* token count needs a sum over CP, and an average only over DP.

Attention dropout is refused: each rank would draw its own masks for blocks the one-process
model draws in another order, and ring attention has none. Use dropout 0 in attention, or
eval().

`ContextParallel(group, replica)` does all of the above around a training step, as torchtitan's
context_parallel does around its train step: `parallelize(gpt, mesh)` holds one when the mesh
has a "cp" axis, and takes the replica's whole windows on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from miniddp.context_parallel.attention import ring_attention
from miniddp.context_parallel.sequence import group_size_and_rank, shard_sequence
from miniddp.job.faults import wait_for

SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


class sdpa_on_the_ring(TorchFunctionMode):  # noqa: N801 (a context manager, named as torch's)
    """While inside, `F.scaled_dot_product_attention(q, k, v, ...)` on this rank's [B, H, S/W, D]
    parts is `ring_attention(q, k, v, group, is_causal, load_balance, scale)`: this rank's part of
    attention over the whole sequence. Every other call runs as it would."""

    def __init__(self, group: dist.ProcessGroup | None = None, load_balance: bool = False):
        super().__init__()
        group_size_and_rank(group)  # a clear error now, not at the first attention
        self.group, self.load_balance = group, load_balance

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        given = dict(zip(SDPA_ARGUMENTS, args)) | kwargs
        if given.get("dropout_p", 0.0) > 0.0:
            raise ValueError(
                f"scaled_dot_product_attention(dropout_p={given['dropout_p']}) inside "
                "sdpa_on_the_ring: ring attention has no attention dropout (each rank would "
                "draw masks the whole sequence never would). Build the model with attention "
                "dropout 0.0, or call model.eval()."
            )
        if given.get("enable_gqa"):
            raise ValueError("sdpa_on_the_ring: enable_gqa is not supported; repeat K and V")
        return ring_attention(
            given["query"],
            given["key"],
            given["value"],
            self.group,
            is_causal=given.get("is_causal", False),
            load_balance=self.load_balance,
            scale=given.get("scale"),
            attn_mask=given.get("attn_mask"),
        )


class ContextParallel:
    """A model's sequence over the context-parallel `group`, load-balanced: the windows cut, the
    positions global, attention on the ring, the loss's mean over the whole sequence.

    `replica` is every rank given the same windows (the cp group, and in a bigger mesh its
    pipeline and tensor-parallel peers too): `cut` checks, with one all-reduce of four numbers,
    that they were, so windows of different shapes are refused on every rank at once instead of
    hanging (or mis-shaping) a collective later."""

    def __init__(
        self, group: dist.ProcessGroup | None, replica: dist.ProcessGroup | None = None
    ) -> None:
        self.size, self.rank = group_size_and_rank(group)
        self.group, self.replica = group, replica

    def cut(self, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's inputs and targets, (B, T / cp) each, from the replica's windows
        (B, T + 1): its head and tail chunks of each, at the same positions."""
        self._refuse_other_shapes(windows)
        length = windows.shape[-1] - 1
        if windows.dim() != 2 or length % (2 * self.size):
            raise ValueError(
                f"windows of shape {tuple(windows.shape)}: context parallelism over "
                f"{self.size} ranks, load-balanced, cuts the T = {length} inputs of each window "
                f"into 2 x {self.size} equal chunks, so T must be a multiple of "
                f"{2 * self.size}. Give windows (B, T + 1) with T a multiple of {2 * self.size}."
            )
        inputs, targets = windows[:, :-1], windows[:, 1:]
        return (
            shard_sequence(inputs, 1, self.group, load_balance=True),
            shard_sequence(targets, 1, self.group, load_balance=True),
        )

    def positions(self, local_length: int, device: torch.device) -> torch.Tensor:
        """The global positions of this rank's `local_length` tokens: its two chunks'."""
        return positions_of(local_length * self.size, self.group, load_balance=True).to(device)

    def attention(self) -> sdpa_on_the_ring:
        """The block inside which the model's attention runs on the ring."""
        return sdpa_on_the_ring(self.group, load_balance=True)

    def mean(self, loss: torch.Tensor) -> torch.Tensor:
        """The whole sequence's mean loss, from this rank's mean over its B·T/cp tokens: every
        rank holds as many, so it is the mean of the ranks' means (a report, detached: the
        gradients are the data-parallel wrapper's to average, over dp x cp)."""
        total = loss.detach().clone()
        work = dist.all_reduce(total, group=self.group, async_op=True)
        wait_for(work, "all-reduce of the context-parallel ranks' losses", self.group)
        return total / self.size

    def _refuse_other_shapes(self, windows: torch.Tensor) -> None:
        given = tuple(windows.shape) if windows.dim() == 2 else (-1, windows.dim())
        # the largest and the smallest, on the windows' device (NCCL reduces only GPU tensors)
        shape = torch.tensor([*given, *(-s for s in given)], device=windows.device)
        work = dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=self.replica, async_op=True)
        wait_for(work, "all-reduce of the windows' shapes over the replica", self.replica)
        largest, smallest = shape[:2].tolist(), (-shape[2:]).tolist()
        if largest != smallest:
            raise ValueError(
                f"the ranks of one replica were given windows of different shapes (B from "
                f"{smallest[0]} to {largest[0]}, T + 1 from {smallest[1]} to {largest[1]}; "
                f"this rank's {tuple(windows.shape)}): every rank of a replica, its pipeline, "
                "context- and tensor-parallel ranks alike, takes the replica's whole windows "
                "(B, T + 1), and parallelize cuts the sequence itself."
            )


def positions_of(
    length: int, group: dist.ProcessGroup | None = None, load_balance: bool = False
) -> torch.Tensor:
    """The global positions of this rank's part of a sequence of `length`: what its position
    embedding must read (the same layout as shard_sequence's)."""
    return shard_sequence(torch.arange(length), 0, group, load_balance)
