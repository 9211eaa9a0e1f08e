"""The block kernel ring attention calls: attention of some queries against one K/V block, with
the log-sum-exp the merge needs, and its backward given the merged (out, lse).

`F.scaled_dot_product_attention` returns only the output, so ring attention calls the kernel
underneath it, the one that also returns lse = log Z. Which kernel that is depends on the device,
as in torch's own ring attention (torch.distributed.tensor.experimental's context_parallel):

    cpu    _scaled_dot_product_flash_attention_for_cpu         every float dtype
    cuda   _scaled_dot_product_flash_attention                 float16 and bfloat16 only
           _scaled_dot_product_efficient_attention             float32 too (and other head dims)
           the attention written out (`_math_forward`)         float64, which neither CUDA
                                                               kernel takes

Each is called with dropout 0 and no mask but `causal`, so the backward needs no random state:
the CUDA kernels' philox seed and offset are placeholders, and the dense (not nested) flash
kernel's cumulative sequence lengths are absent. The efficient kernel pads its lse to a multiple
of 32 positions; the padding is cut after the forward and put back, as zeros, for the backward.

Only the CPU kernel and the written-out one run on this project's machines (tests check the
second against the first); scripts/gpu_check.sh runs ring attention against
F.scaled_dot_product_attention on a GPU to check the CUDA ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

aten = torch.ops.aten
EFFICIENT_LSE_ALIGN = 32  # the efficient kernel's lse is padded to a multiple of this

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class BlockKernel:
    """forward(q, k, v, causal, scale) -> (out, lse), lse shaped (B, H, Lq) in float32 (float64
    for float64 input); backward(grad_out, q, k, v, out, lse, causal, scale) ->
    (dq, dk, dv), where out and lse are the merged ones (FlashAttention-2's recomputation)."""

    name: str
    forward: Forward
    backward: Backward


def _cpu_forward(q, k, v, causal: bool, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_backward(grad_out, q, k, v, out, lse, causal: bool, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def _no_dropout_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The philox (seed, offset) pair a CUDA kernel's backward takes; unread at dropout 0."""
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.zeros(
        (), dtype=torch.uint64, device=device
    )


def _flash_forward(q, k, v, causal: bool, scale):
    out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def _flash_backward(grad_out, q, k, v, out, lse, causal: bool, scale):
    seed, offset = _no_dropout_state(q.device)
    return aten._scaled_dot_product_flash_attention_backward(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        None,
        None,
        q.shape[2],
        k.shape[2],
        0.0,
        causal,
        seed,
        offset,
        scale=scale,
    )


def _efficient_forward(q, k, v, causal: bool, scale):
    out, lse, *_ = aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]]


def _efficient_backward(grad_out, q, k, v, out, lse, causal: bool, scale):
    padding = -q.shape[2] % EFFICIENT_LSE_ALIGN
    seed, offset = _no_dropout_state(q.device)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        grad_out,
        q,
        k,
        v,
        None,
        out,
        F.pad(lse, (0, padding)).contiguous(),
        seed,
        offset,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return dq, dk, dv


def _scores(q, k, causal: bool, scale) -> tuple[torch.Tensor, float]:
    """S = Q Kᵀ · scale, the future masked out as SDPA's is_causal does (query i sees keys
    0..i)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores, scale


def _math_forward(q, k, v, causal: bool, scale):
    scores, _ = _scores(q, k, causal, scale)
    lse = scores.logsumexp(-1)
    return (scores - lse.unsqueeze(-1)).exp() @ v, lse


def _math_backward(grad_out, q, k, v, out, lse, causal: bool, scale):
    """FlashAttention-2's backward, written out. With P = exp(S - lse) the merged probabilities
    of this block's keys: dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP - rowsum(dO ∘ O)), dQ = dS K ·
    scale, dK = dSᵀ Q · scale."""
    scores, scale = _scores(q, k, causal, scale)
    p = (scores - lse.unsqueeze(-1)).exp()
    ds = p * (grad_out @ v.transpose(-1, -2) - (grad_out * out).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ grad_out


CPU_FLASH = BlockKernel("cpu flash", _cpu_forward, _cpu_backward)
CUDA_FLASH = BlockKernel("cuda flash", _flash_forward, _flash_backward)
CUDA_EFFICIENT = BlockKernel("cuda efficient", _efficient_forward, _efficient_backward)
MATH = BlockKernel("math", _math_forward, _math_backward)


def kernel_for(device: torch.device | str, dtype: torch.dtype) -> BlockKernel:
    """The kernel for blocks of this device and dtype: flash where it runs (CPU, any float;
    CUDA, half precision), the memory-efficient kernel for CUDA's float32, and the attention
    written out for CUDA's float64."""
    kind = torch.device(device).type
    if kind == "cpu":
        return CPU_FLASH
    if kind == "cuda":
        if dtype == torch.float64:
            return MATH
        return CUDA_FLASH if dtype in (torch.float16, torch.bfloat16) else CUDA_EFFICIENT
    raise NotImplementedError(
        f"ring_attention has no block kernel for {kind} tensors: it runs on cpu and cuda "
        "(miniddp/context_parallel/kernels.py lists them; add the device's kernel there)"
    )
