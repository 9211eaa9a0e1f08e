"""The standard blocks, written as plain one-process modules, and the plans that split them.

Nothing here knows about tensor parallelism: the attention infers how many heads it holds from
its q projection's output (`view(B, T, -1, head_dim)`), so after q, k and v are split colwise it
computes its H/W local heads unchanged. Heads are independent, so splitting by heads needs no
talking until the output projection, which is rowwise:

    block:  x + attention(LN(x)), then + MLP(LN(x))
            attention: q, k, v colwise (whole heads) -> per-head softmax -> out rowwise (g)
            MLP:       up colwise -> GELU (elementwise) -> down rowwise (g)

Each colwise layer enters through its own f, so three separate q, k, v projections all-reduce
three gradients of x in backward where one would do. `fused_qkv=True` is Megatron's answer: one
projection `qkv` whose rows go head by head (q, k, v of head 0, then of head 1, ...), so that
torch.chunk's block of rows is whole heads with their q, k and v, and x enters once. A block then
costs exactly two all-reduces forward and two backward.

`plan_for` gives the plan for any of these (torch's styles take the same names).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from miniddp.tensor_parallel.plan import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int, bias: bool = True) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden, bias)
        self.down = nn.Linear(hidden, width, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, bias: bool = True, fused_qkv: bool = False):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a whole number of heads ({heads})")
        self.head_dim = width // heads
        if fused_qkv:
            self.qkv = nn.Linear(width, 3 * width, bias)  # rows: (head, q/k/v, head_dim)
        else:
            self.q, self.k, self.v = (nn.Linear(width, width, bias) for _ in range(3))
        self.out = nn.Linear(width, width, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x)  # each (B, T, local heads, head_dim); T: all positions
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(2))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        fused = hasattr(self, "qkv")
        outputs = [self.qkv(x)] if fused else [self.q(x), self.k(x), self.v(x)]
        per_head = 3 * self.head_dim if fused else self.head_dim
        features = outputs[0].shape[-1]
        if features % per_head:
            raise ValueError(
                f"the q projection gives {features} features a token, not whole heads of "
                f"{per_head}: split attention over a number of ranks that divides its heads"
            )
        # The lengths are the projections' own: under sequence parallelism x holds S/W positions
        # and a colwise projection gathered all S before multiplying.
        if fused:
            return outputs[0].unflatten(-1, (-1, 3, self.head_dim)).unbind(3)
        return tuple(t.unflatten(-1, (-1, self.head_dim)) for t in outputs)


class TransformerBlock(nn.Module):
    def __init__(self, width: int, heads: int, bias: bool = True, fused_qkv: bool = False):
        super().__init__()
        self.attention_norm = nn.LayerNorm(width)  # replicated: every rank keeps it whole
        self.attention = CausalSelfAttention(width, heads, bias, fused_qkv)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = MLP(width, 4 * width, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """Token embedding (vocabulary-parallel), blocks, and a colwise output projection whose
    sharded logits go to `vocab_parallel_cross_entropy` ungathered."""

    def __init__(
        self,
        vocab: int,
        width: int,
        heads: int,
        layers: int,
        length: int,
        bias: bool = True,
        fused_qkv: bool = False,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(length, width)  # replicated
        self.blocks = nn.ModuleList(
            TransformerBlock(width, heads, bias, fused_qkv) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (B, T, V) in one process, (B, T, V/W) under TP


def plan_for(
    model: nn.Module, prefix: str = "", sequence_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """The Megatron plan for one of the modules above: {submodule name: style}. With
    sequence_parallel, Megatron-SP's (layers.py): a block takes and returns this rank's
    positions [B, S/W, H], its LayerNorms run on them (SequenceParallel), the linear layers
    gather and scatter the sequence."""
    at = f"{prefix}." if prefix else ""
    sp = sequence_parallel
    if isinstance(model, MLP):
        return {
            f"{at}up": ColwiseParallel(sequence_parallel=sp),
            f"{at}down": RowwiseParallel(sequence_parallel=sp),
        }
    if isinstance(model, CausalSelfAttention):
        projections = ("qkv",) if hasattr(model, "qkv") else ("q", "k", "v")
        columns = {f"{at}{name}": ColwiseParallel(sequence_parallel=sp) for name in projections}
        return columns | {f"{at}out": RowwiseParallel(sequence_parallel=sp)}
    if isinstance(model, TransformerBlock):
        norms: dict[str, ParallelStyle] = {}
        if sp:
            norms = {f"{at}attention_norm": SequenceParallel(), f"{at}mlp_norm": SequenceParallel()}
        attention = plan_for(model.attention, f"{at}attention", sp)
        return norms | attention | plan_for(model.mlp, f"{at}mlp", sp)
    if isinstance(model, TinyGPT) and sp:
        raise ValueError(
            "plan_for(TinyGPT, sequence_parallel=True): its position embedding is added to the "
            "whole sequence before the blocks, and its head reads all positions. Plan its "
            "blocks with sequence_parallel=True and shard the sequence between them yourself"
        )
    if isinstance(model, TinyGPT):
        plan: dict[str, ParallelStyle] = {f"{at}embed": RowwiseParallel()}
        for index, block in enumerate(model.blocks):
            plan |= plan_for(block, f"{at}blocks.{index}")
        return plan | {f"{at}head": ColwiseParallel()}
    raise TypeError(f"no plan for a {type(model).__name__}; write one as a dict of styles")
