"""Cross-entropy over logits sharded by vocabulary, without ever gathering them (Megatron, §3).

A colwise output projection leaves rank r the logits z_v of its vocabulary slice V_r only. The
loss of a token with target t is

    loss = log sum_v exp(z_v) - z_t = log sum_v exp(z_v - m) - (z_t - m)

for any constant m; m = max_v z_v keeps exp from overflowing. Every term is a sum or a max over
v, and a sum over V is the sum over ranks of a sum over V_r. So three all-reduces of one number
per token replace gathering B x T x V logits:

    m    = all_reduce_max(max over V_r of z_v)
    S    = all_reduce_sum(sum over V_r of exp(z_v - m))
    z_t' = all_reduce_sum(z_t - m on the rank that owns t, 0 elsewhere)

Backward needs no talking at all: dloss/dz_v = softmax_v - [v = t], and each rank has its own
softmax slice exp(z_v - m) / S and knows whether it owns t.

A target equal to `ignore_index` (F.cross_entropy's -100: the padding of a batch of texts)
is owned by no rank on purpose: its token's loss and gradient are 0, and the mean is over the
tokens not ignored, as F.cross_entropy's. `reduction` is "mean", "sum" or "none", as there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from miniddp.tensor_parallel.layers import group_size_and_rank, refuse_ids_outside


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token losses from (N, V/W) local logits and (N,) global target ids."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: dist.ProcessGroup | None,
        ignore_index: int,
    ) -> torch.Tensor:
        world_size, rank = group_size_and_rank(group)
        ignored = target == ignore_index
        vocab = world_size * logits.shape[-1]
        hint = f" (or be ignore_index, {ignore_index}, to leave its token out of the loss)"
        refuse_ids_outside(target[~ignored], vocab, "target", hint)
        vocab_start = rank * logits.shape[-1]
        local_target = target - vocab_start
        elsewhere = (local_target < 0) | (local_target >= logits.shape[-1]) | ignored
        local_target = local_target.masked_fill(elsewhere, 0)

        largest = logits.max(dim=-1).values  # no gradient flows through m: it cancels
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - largest.unsqueeze(-1)
        total = shifted.exp().sum(dim=-1)
        dist.all_reduce(total, group=group)
        rows = torch.arange(logits.shape[0], device=logits.device)
        target_logit = shifted[rows, local_target].masked_fill(elsewhere, 0.0)
        dist.all_reduce(target_logit, group=group)

        log_total = total.log()
        # softmax as exp(log_softmax), not exp / S: torch's loss_parallel's order, so its bits
        softmax = (shifted - log_total.unsqueeze(-1)).exp()
        softmax = softmax.masked_fill(ignored.unsqueeze(-1), 0.0)  # no gradient where ignored
        ctx.save_for_backward(softmax, local_target, elsewhere)
        return (log_total - target_logit).masked_fill(ignored, 0.0)

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_target, elsewhere = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= (~elsewhere).to(grad.dtype)
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """The cross-entropy, as F.cross_entropy(full_logits, target, ignore_index=...,
    reduction=...) would give it, from this rank's vocabulary slice of the logits (..., V/W) and
    the global target ids (...)."""
    if local_logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits of shape {tuple(local_logits.shape)} need targets of shape "
            f"{tuple(local_logits.shape[:-1])}, got {tuple(target.shape)}"
        )
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(
            f'reduction is "mean", "sum" or "none", as F.cross_entropy; got {reduction!r}'
        )
    flat = local_logits.reshape(-1, local_logits.shape[-1])
    losses = _VocabParallelCrossEntropy.apply(flat, target.reshape(-1), group, ignore_index)
    if reduction == "none":
        return losses.view(target.shape)
    if reduction == "sum":
        return losses.sum()
    kept = (target != ignore_index).sum()
    return losses.mean() if kept == target.numel() else losses.sum() / kept
