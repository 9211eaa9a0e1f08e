"""What the ranks of the test pool run for tests/test_activation_memory.py: chapter 12's GPT
trained under MiniDDP or miniddp.fully_shard, with and without activation checkpointing."""

from __future__ import annotations

import torch
import torch.distributed as dist

from miniddp import MiniDDP, MixedPrecision, fully_shard
from miniddp.instruments.activation_memory import SavedActivations
from miniddp.models.gpt import GPT, GPTConfig, next_character_loss
from miniddp.models.gpt_activations import Checkpointing, block_layers, checkpoint_blocks

# Chapter 12's GPT, dropout 0.1 included, at half its context, width and depth: two ranks train
# it three times in seconds (tests/test_activation_memory.py measures the full size alone).
CONFIG = GPTConfig(vocab_size=96, context=32, width=64, layers=2, heads=4)
BATCH = 4
STEPS = 2


def wrap(kind: str, model: GPT) -> torch.nn.Module:
    if kind == "ddp":
        return MiniDDP(model)
    if kind == "ddp-bf16":  # fp32 masters, bf16 copies in the module for forward and backward
        return MiniDDP(model, mixed_precision=MixedPrecision(torch.bfloat16))
    for block in model.blocks:  # the blocks first, then the root: FSDP2's usage
        fully_shard(block)
    return fully_shard(model)


def train(kind: str, checkpointing: Checkpointing) -> dict:
    """kind "ddp" (MiniDDP), "ddp-bf16" (its mixed precision) or "fsdp" (fully_shard); STEPS
    SGD steps. Every step's gradients
    as this rank holds them (full, or its shards), and the first forward's saved bytes."""
    torch.manual_seed(0)
    model = checkpoint_blocks(GPT(CONFIG), checkpointing)  # before sharding: torchtitan's order
    wrapped = wrap(kind, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # step 2 starts where step 1 left
    data = torch.Generator().manual_seed(dist.get_rank())
    torch.manual_seed(100 + dist.get_rank())  # each rank its own dropout masks
    gradients, held = [], None
    for _ in range(STEPS):
        windows = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.context + 1), generator=data)
        with SavedActivations(model, block_layers(model)) as measured:
            loss = next_character_loss(wrapped, windows)
        held = held or measured.by_layer
        loss.backward()
        gradients.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    return {"gradients": gradients, "held": held}


def with_and_without(kind: str, checkpointings: tuple[Checkpointing, ...]) -> dict:
    """Trained without checkpointing, then with each of `checkpointings`, from the same start."""
    return {each: train(kind, each) for each in (Checkpointing.NONE, *checkpointings)}
