"""A GPT, small enough to train on a CPU: the decoder-only transformer of GPT-2, as nanoGPT
writes it, character by character.

    tokens (B, T) -> token embedding + position embedding -> dropout
                  -> N blocks:  x = x + attention(LayerNorm(x))      (pre-LayerNorm, GPT-2)
                                x = x + MLP(LayerNorm(x))
                  -> LayerNorm -> head, whose weight IS the token embedding (tied)
                  -> logits (B, T, vocab)

Attention is causal: the token at position t sees positions 0..t only, so one window of T + 1
characters gives T next-character predictions at once. `scaled_dot_product_attention` does
softmax(q·kᵀ/√d)·v with that mask, and its own dropout on the attention weights.

With `moe=MoEConfig(num_experts, top_k)` the MLP of every `every`-th block (the second, the
fourth, ... as GShard and Switch place them) is a mixture of SwiGLU experts instead
(miniddp/expert_parallel/moe.py), each expert as wide as the dense MLP; `moe_aux_loss(model)`
is the load-balancing loss to add to the training loss. Its experts split over ranks with
`parallelize_module(block.mlp.experts, mesh["ep"], ExpertParallel())`.

Dropout draws from torch's global generator, in a fixed order within a forward: two replicas
seeded alike draw the same masks, which is what lets chapter 12 compare MiniDDP with torch's
DDP bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from miniddp.expert_parallel import GroupedExperts, MoE


@dataclass(frozen=True)
class MoEConfig:
    """Which blocks get experts, how many, and how they route (MoE's arguments)."""

    num_experts: int
    top_k: int = 2
    every: int = 2  # blocks every-1, 2 every-1, ...: every other block by default
    hidden_dim: int | None = None  # each expert's; None: the dense MLP's 4 x width
    capacity_factor: float | None = None  # None: dropless
    aux_loss_coef: float = 0.01  # Switch's

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be >= 1 (1: every block has experts); got {self.every}")

    def in_block(self, index: int) -> bool:
        return index % self.every == self.every - 1


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    context: int = 64  # T: the longest window the model reads (position embeddings)
    width: int = 128  # C: every token's vector
    layers: int = 4  # N blocks
    heads: int = 4  # C / heads dimensions per head
    dropout: float = 0.1
    moe: MoEConfig | None = None  # None: every block's MLP is dense

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(
                f"width {self.width} must be a multiple of heads {self.heads}: each head gets "
                "width / heads dimensions. Change one of them."
            )


def refuse_a_window_longer_than_the_context(length: int, context: int) -> None:
    """There are `context` position embeddings: a longer window has positions with none."""
    if length > context:
        raise ValueError(
            f"a window of {length} tokens is longer than the model's context {context}: crop "
            "it, or build the model with a longer context"
        )


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.width // config.heads
        self.dropout = config.dropout
        # q, k and v in one matmul, its 3C output rows head by head: (head, q/k/v, C / heads).
        # Tensor parallelism cuts these rows into W contiguous blocks: whole heads, each with
        # its q, k and v (Megatron's layout), so a rank computes its heads without talking.
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.residual_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # (B, T, 3C) -> three (B, heads, T, C / heads): each head attends on its own slice.
        # The head count comes from the size (-1): under TP a rank holds H / W of them.
        q, k, v = self.qkv(x).view(batch, length, -1, 3, self.head_dim).unbind(3)
        q, k, v = (part.transpose(1, 2) for part in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, length, -1)  # the heads side by side again
        return self.residual_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.width, 4 * config.width)
        self.down = nn.Linear(4 * config.width, config.width)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    """Pre-LayerNorm: the residual stream x itself is never normalized, only what each branch
    reads, so gradients reach the first block through the additions undamped."""

    def __init__(self, config: GPTConfig, experts: bool = False) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.width)
        self.attention = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.width)
        self.mlp = MLP(config) if not experts else moe_layer(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def moe_layer(config: GPTConfig) -> MoE:
    """An MoE in place of the MLP (no dropout on its output: Switch drops inside experts, if
    at all, and a mask drawn per rank would break the comparison with one process)."""
    moe = config.moe
    assert moe is not None
    hidden = moe.hidden_dim or 4 * config.width
    return MoE(
        config.width,
        hidden,
        moe.num_experts,
        moe.top_k,
        capacity_factor=moe.capacity_factor,
        aux_loss_coef=moe.aux_loss_coef,
    )


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token = nn.Embedding(config.vocab_size, config.width)
        self.position = nn.Embedding(config.context, config.width)
        self.dropout = nn.Dropout(config.dropout)
        moe = config.moe
        self.blocks = nn.ModuleList(
            Block(config, experts=moe is not None and moe.in_block(i)) for i in range(config.layers)
        )
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab_size, bias=False)
        # Tied: reading a character in and writing it out share one matrix (Press & Wolf,
        # 2017). It is one parameter, so DDP sees it once and sums both uses' gradients.
        self.head.weight = self.token.weight
        self.apply(self._init_weights)
        # GPT-2: each block adds two branches to the residual stream, so scale the last
        # projection of each by 1/√(2N) to keep the stream's variance from growing with depth.
        for name, param in self.named_parameters():
            if name.endswith(("attention.proj.weight", "mlp.down.weight", "experts.w2")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, GroupedExperts):
            for weight in (module.w1, module.w2, module.w3):
                nn.init.normal_(weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) for the next character after each of `tokens` (B, T).

        `positions` (T,): where each token sits in its window, 0..T-1 unless given. Context
        parallelism gives a rank a part of each window, so it passes that part's positions
        (miniddp.context_parallel.positions_of; on the host, they follow the tokens)."""
        length = tokens.shape[1]
        if positions is None:
            refuse_a_window_longer_than_the_context(length, self.config.context)
        if positions is None:
            positions = torch.arange(length, device=tokens.device)
        x = self.dropout(self.token(tokens) + self.position(positions.to(tokens.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    @torch.no_grad()
    def generate(
        self, prompt: torch.Tensor, count: int, generator: torch.Generator, top_k: int = 10
    ) -> torch.Tensor:
        """`prompt` (1, T) followed by `count` sampled tokens: each drawn from the `top_k` most
        likely next characters, the window cropped to the last `context` tokens."""
        was_training = self.training
        self.eval()
        tokens = prompt
        for _ in range(count):
            logits = self(tokens[:, -self.config.context :])[:, -1, :]
            best, where = logits.topk(min(top_k, logits.shape[-1]))
            choice = torch.multinomial(F.softmax(best, dim=-1), 1, generator=generator)
            tokens = torch.cat([tokens, where.gather(-1, choice)], dim=1)
        self.train(was_training)
        return tokens


def next_character_loss(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each next character, in nats per character: `windows` (B, T + 1) hold
    the inputs (the first T) and, shifted by one, the targets."""
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of every MoE layer's aux_loss from the last forward (zero without experts): add
    it to the loss. It looks through any wrapper (MiniDDP, fully_shard) by `modules()`."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE)]
    return sum(losses, torch.zeros(()))


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's two groups, as nanoGPT's: weight decay on the matrices (the Linear weights and
    the embeddings) and none on biases and LayerNorm gains, which only shift and scale and gain
    nothing from being pulled towards zero. Decided by name, not by shape, so that it holds for
    fully_shard's flat 1-D shards too."""
    named = dict(model.named_parameters())  # the tied weight once, as "token.weight"
    matrices = ("weight", ".experts.w1", ".experts.w2", ".experts.w3")  # the experts' too
    decayed = {n for n in named if n.endswith(matrices) and not n.endswith("norm.weight")}
    return [
        {"params": [p for n, p in named.items() if n in decayed], "weight_decay": weight_decay},
        {"params": [p for n, p in named.items() if n not in decayed], "weight_decay": 0.0},
    ]
