"""Activation memory (miniddp/instruments/activation_memory.py) against the formula for chapter 12's
GPT (miniddp/models/gpt_activations.py), to the byte, and what checkpointing trades for it.

One process: the bytes autograd saves, per block and outside the blocks, at the chapter's size
(batch 16, context 64, width 128, 4 layers, 4 heads), fp32 and bf16, with the chapter's dropout
(the CPU's math attention, s x s tensors and all) and without (the flash kernel); checkpointing
per block and attention only, its bytes and its recomputed FLOPs, and gradients unchanged.
Two ranks: MiniDDP (in fp32 and in mixed precision) and fully_shard hold the activations the
formula says; MiniDDP and fully_shard train bitwise the same with checkpointing as without.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from miniddp.instruments.activation_memory import SavedActivations
from miniddp.models.gpt import GPT, GPTConfig, next_character_loss
from miniddp.models.gpt_activations import (
    Checkpointing,
    activation_bytes,
    block_layers,
    checkpoint_blocks,
    recompute_flops,
)
from tests import activation_memory_tasks

CONFIG = GPTConfig(vocab_size=96)  # chapter 12's sizes, its dropout 0.1 included
BATCH = 16  # chapter 12's windows per rank


def windows(seed: int = 1, batch: int = BATCH) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (batch, CONFIG.context + 1), generator=generator)


def build(config: GPTConfig, dtype: torch.dtype, checkpointing: Checkpointing) -> GPT:
    torch.manual_seed(0)
    return checkpoint_blocks(GPT(config).to(dtype), checkpointing)


def held(model: GPT, tokens: torch.Tensor) -> tuple[dict[str, int], torch.Tensor]:
    torch.manual_seed(5)  # the same dropout masks in every run
    with SavedActivations(model, block_layers(model)) as measured:
        loss = next_character_loss(model, tokens)
    return measured.by_layer, loss


@pytest.mark.parametrize("dropout", [0.1, 0.0], ids=["dropout (math attention)", "no dropout"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", list(Checkpointing), ids=lambda c: c.value)
def test_saved_bytes_per_layer_are_the_formulas_to_the_byte(dtype, dropout, checkpointing):
    config = replace(CONFIG, dropout=dropout)
    measured, _ = held(build(config, dtype, checkpointing), windows())
    assert measured == activation_bytes(config, BATCH, dtype, checkpointing)


def test_the_fp32_block_is_72sbh_plus_12as2b_plus_16sb():
    """The formula's headline at the chapter's size, written out: 12.0 MiB a block."""
    s, b, h, a = CONFIG.context, BATCH, CONFIG.width, CONFIG.heads
    per_block = activation_bytes(CONFIG, BATCH)["blocks.0"]
    assert per_block == 72 * s * b * h + 12 * a * s * s * b + 16 * s * b == 12_599_296


def test_parameters_a_linear_saves_are_not_activations():
    """A Linear saves its weight for the input's gradient: the model's memory, not the step's."""
    linear = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    with SavedActivations(linear) as measured:
        linear(x)
    assert measured.by_layer == {"other": x.nbytes}


def test_a_storage_saved_twice_is_counted_once():
    """log_softmax saves its output and nll_loss saves it again: one storage."""
    logits = torch.randn(5, 7, requires_grad=True)
    with SavedActivations(torch.nn.Module()) as measured:
        loss = torch.nn.functional.nll_loss(logits.log_softmax(-1), torch.arange(5))
    log_probs, target, total_weight = 5 * 7 * 4, 5 * 8, 4
    assert measured.total == log_probs + target + total_weight
    loss.backward()


@pytest.mark.parametrize("checkpointing", [Checkpointing.BLOCK, Checkpointing.ATTENTION])
def test_checkpointing_pays_the_formulas_flops_and_leaves_gradients_bitwise(checkpointing):
    """Backward's FLOPs with checkpointing minus without: the forward it runs again. The
    recompute draws the same dropout masks (checkpoint restores the generator's state), so the
    gradients are the same bits."""
    runs, batch = {}, 4  # FLOPs scale with the batch: a small one is quicker
    for each in (Checkpointing.NONE, checkpointing):
        model = build(CONFIG, torch.float32, each)
        _, loss = held(model, windows(batch=batch))
        with FlopCounterMode(display=False) as flops:
            loss.backward()
        runs[each] = flops.get_total_flops(), [p.grad for p in model.parameters()]
    extra = runs[checkpointing][0] - runs[Checkpointing.NONE][0]
    assert extra == recompute_flops(CONFIG, batch, checkpointing)
    for plain, checkpointed in zip(runs[Checkpointing.NONE][1], runs[checkpointing][1]):
        assert torch.equal(plain, checkpointed)


def test_checkpointing_a_block_twice_is_refused():
    model = build(CONFIG, torch.float32, Checkpointing.BLOCK)
    with pytest.raises(ValueError, match="already checkpointed"):
        checkpoint_blocks(model, Checkpointing.BLOCK)


def assert_same_training(runs: list[dict], kind: str) -> None:
    """Every rank: the activations the formula says without checkpointing (the layout does not
    change them), and each checkpointed run's gradients, every step, the plain run's bits."""
    config, batch = activation_memory_tasks.CONFIG, activation_memory_tasks.BATCH
    for rank, run in enumerate(runs):
        for checkpointing, trained in run.items():
            what = f"rank {rank}, {kind}, checkpointing {checkpointing.value}"
            assert trained["held"] == activation_bytes(config, batch, checkpointing=checkpointing)
            pairs = zip(run[Checkpointing.NONE]["gradients"], trained["gradients"], strict=True)
            for step, (plain, checkpointed) in enumerate(pairs):
                for index, (a, b) in enumerate(zip(plain, checkpointed, strict=True)):
                    assert torch.equal(a, b), f"{what}: gradient {index}, step {step}"


def test_minddp_trains_bitwise_the_same_with_checkpointing(pool2):
    """MiniDDP's hooks fire on the gradients of the original graph, which the recompute only
    refills with saved tensors: the same gradients, the same buckets, the same bits."""
    both = (Checkpointing.BLOCK, Checkpointing.ATTENTION)
    runs = pool2.run(activation_memory_tasks.with_and_without, "ddp", both)
    assert_same_training(runs, "MiniDDP")


def test_fully_shard_trains_bitwise_the_same_with_checkpointing(pool2):
    runs = pool2.run(activation_memory_tasks.with_and_without, "fsdp", (Checkpointing.BLOCK,))
    assert_same_training(runs, "fully_shard")


def test_mixed_precision_compute_copies_are_parameters_not_activations(pool2):
    """Under MiniDDP's mixed precision the module computes with bf16 copies of its fp32
    masters; the Linears save those copies. Read as the model's forward begins, they are the
    parameters then, and the activations are a bf16 model's."""
    runs = pool2.run(activation_memory_tasks.train, "ddp-bf16", Checkpointing.NONE)
    config, batch = activation_memory_tasks.CONFIG, activation_memory_tasks.BATCH
    for rank, run in enumerate(runs):
        assert run["held"] == activation_bytes(config, batch, torch.bfloat16), f"rank {rank}"


def test_fully_shard_holds_the_same_activations_as_one_process(pool2):
    """The full parameters a unit gathers for its forward are saved by autograd, then freed
    after it (storage resized to 0): counted at the forward's end, they hold nothing."""
    runs = pool2.run(activation_memory_tasks.train, "fsdp", Checkpointing.NONE)
    for rank, run in enumerate(runs):
        expected = activation_bytes(activation_memory_tasks.CONFIG, activation_memory_tasks.BATCH)
        assert run["held"] == expected, f"rank {rank}"
