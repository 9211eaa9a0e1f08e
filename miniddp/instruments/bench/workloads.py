"""The step benchmark's models, each rebuilt identically on every call, with one rank's batch
and its loss: an MLP of big tensors, a small transformer with a tied embedding, a deep stack
of 300 small tensors (where per-hook Python shows), and chapter 12's character-level GPT."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from miniddp.models.gpt import GPT, GPTConfig


@dataclass(frozen=True)
class Workload:
    """A model (rebuilt identically on every call) and one rank's batch, with its loss."""

    name: str
    what: str
    build: Callable[[], nn.Module]
    batch: tuple[torch.Tensor, ...]
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
    tokens: int = 0  # predicted per rank per step, for a language model's tokens per second


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def seeded_build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return build()

    return seeded_build


def _mean_square(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(batch[0]).square().mean()


class TiedTransformer(nn.Module):
    """A small language model whose output projection is its token embedding (one tensor)."""

    def __init__(self, vocab: int = 4096, width: int = 256, layers: int = 4, length: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(length, width))
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.blocks(self.embed(tokens) + self.position[: tokens.shape[1]])
        return self.norm(hidden) @ self.embed.weight.T  # tied: the embedding reads out too


def _next_token_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    tokens = batch[0]
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def workloads(rank: int) -> dict[str, Workload]:
    """The four models, each with this rank's own (seeded) batch."""
    generator = torch.Generator().manual_seed(1000 + rank)
    return {
        "mlp": Workload(
            "mlp",
            "10 Linear(1024, 1024) + ReLU: 10.5M parameters in 20 tensors, batch 32",
            _seeded(lambda: nn.Sequential(*[m for _ in range(10) for m in _linear_relu(1024)])),
            (torch.randn(32, 1024, generator=generator),),
            _mean_square,
        ),
        "transformer": Workload(
            "transformer",
            "4-layer transformer, width 256, tied 4096-token embedding: 52 tensors, 4 x 32 tokens",
            _seeded(TiedTransformer),
            (torch.randint(0, 4096, (4, 33), generator=generator),),
            _next_token_loss,
        ),
        "deep": Workload(
            "deep",
            "150 Linear(64, 64) + Tanh: 300 small tensors (0.6M parameters), batch 32",
            _seeded(lambda: nn.Sequential(*[m for _ in range(150) for m in _linear_tanh(64)])),
            (torch.randn(32, 64, generator=generator),),
            _mean_square,
        ),
        "gpt": Workload(
            "gpt",
            "chapter 12's GPT: 4 blocks, width 128, 98 characters, dropout 0.1: 0.8M parameters "
            "in 52 tensors, 16 x 64 characters",
            _seeded(lambda: GPT(GPTConfig(vocab_size=98))),
            (torch.randint(0, 98, (16, 65), generator=generator),),
            _next_token_loss,
            tokens=16 * 64,
        ),
    }


def _linear_relu(width: int) -> list[nn.Module]:
    return [nn.Linear(width, width), nn.ReLU()]


def _linear_tanh(width: int) -> list[nn.Module]:
    return [nn.Linear(width, width), nn.Tanh()]
