"""Chapter 11c: the memory of a real step. A small GPT, every byte one rank holds.

    torchrun --nproc_per_node=2 tutorials/11c_memory.py [--plot DIR]

Chapter 11 counted a toy MLP's parameters, gradients, buckets and optimizer state. A real step
holds one thing more, and for a real model it is the largest: the activations, what the forward
leaves behind for the backward. The model here is real: GPT-2's decoder-only transformer as
nanoGPT writes it (miniddp/models/gpt.py), at the size a CPU trains. It reads a window of s
characters of text (Python's own standard library: tutorials/char_corpus.py), gives each a
vector of h numbers (a token plus a position embedding), passes them through 4 blocks, each
causal self-attention over 4 heads then an MLP, both around a LayerNorm and a residual add, and
scores every next character with a head that shares the token embedding's weight. This chapter
takes one AdamW step of it under DDP and the three ZeRO stages, and counts every term on one
rank against its formula:

    1. the model's states     parameters, gradients, buckets, Adam: 20Ψ under DDP, fp32
    2. the activations        what autograd saves, block by block, op by op; Korthikanti's count
    3. checkpointing          per block and attention only: the bytes saved, the FLOPs and time
                              paid, the gradients unchanged
    4. the whole step         every term per layout, side by side (the figure)
    5. mixed precision        bf16 compute with fp32 masters under each layout; what a bf16
                              reduction costs in accuracy; 16Ψ or 20Ψ, answered

The library: miniddp/instruments/activation_memory.py measures, miniddp/models/gpt_activations.py
derives the formula term by term, miniddp/sharding/memory.py counts the model's states.
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from char_corpus import Windows, load_corpus
from common import add_plot_option, end_chapter, fmt_bytes, say, say_prose, section
from torch.utils.flop_counter import FlopCounterMode

from miniddp import MiniDDP, MixedPrecision, ZeroRedundancyOptimizer, fully_shard
from miniddp.instruments.activation_memory import SavedActivations
from miniddp.instruments.figures.memory_per_rank import step_memory
from miniddp.job.env import init_distributed
from miniddp.models.gpt import GPT, GPTConfig, next_character_loss, parameter_groups
from miniddp.models.gpt_activations import (
    Checkpointing,
    activation_bytes,
    block_bytes,
    block_layers,
    checkpoint_blocks,
    korthikanti_bytes,
    recompute_flops,
)
from miniddp.sharding import (
    Formula,
    MixedPrecisionPolicy,
    ddp_buckets,
    ddp_compute_copies,
    measure_memory,
    reduce_scatter_hook,
)

# The GPT at miniddp.models.gpt's defaults: context 64, width 128, 4 blocks, 4 heads, dropout 0.1.
BATCH = 16  # windows a rank per step
SEED = 0
LR, WEIGHT_DECAY = 3e-3, 0.1  # AdamW's: the step's memory depends on neither
# bf16 matmuls run several times slower than fp32 on a CPU without bf16 units: section 5 reads
# a smaller batch. The model's states do not depend on it; the activations scale with it.
MIXED_BATCH = 4
LAYOUTS = ("ddp", "zero1", "zero2", "zero3")
NAMES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
STATES = ("parameters", "gradients", "buckets", "optimizer_state")
CHECKPOINTED = (Checkpointing.BLOCK, Checkpointing.ATTENTION)
BF16 = MixedPrecision(torch.bfloat16)  # bf16 copies to compute with, fp32 masters and buckets
BF16_REDUCE = MixedPrecision(torch.bfloat16, reduce_dtype=torch.bfloat16)


def wrap(
    layout: str, model: GPT, mixed: MixedPrecision | None
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model under `layout` (in `mixed` precision, if given), and its AdamW (two groups:
    decay on the matrices, none on biases and gains)."""
    if layout == "zero3":
        policy = mixed and MixedPrecisionPolicy(mixed.param_dtype, mixed.reduce_dtype)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)  # the blocks first, then the root: FSDP2's
        module = fully_shard(model, mp_policy=policy)  # its parameters are now the shards
        groups = parameter_groups(model, WEIGHT_DECAY)
        return module, torch.optim.AdamW(groups, lr=LR)
    module = MiniDDP(model, mixed_precision=mixed)
    groups = parameter_groups(model, WEIGHT_DECAY)
    if layout == "ddp":
        return module, torch.optim.AdamW(groups, lr=LR)
    optimizer = ZeroRedundancyOptimizer(groups, torch.optim.AdamW, lr=LR)
    if layout == "zero2":
        module.register_comm_hook(optimizer, reduce_scatter_hook)
    return module, optimizer


def train(
    config: GPTConfig,
    windows: Windows,
    layout: str,
    checkpointing: Checkpointing = Checkpointing.NONE,
    mixed: MixedPrecision | None = None,
    count_flops: bool = False,
    batch: int = BATCH,
) -> dict:
    """One step of the GPT under `layout`, `batch` windows a rank: the activations held
    after the forward, the backward's time, the model's states after the optimizer step (the
    gradients not yet zeroed: every term at once). With `count_flops`, a first step before it
    counts the backward's FLOPs (the counter slows every op it sees, so it is not timed). Every
    step's gradients on this rank (under ZeRO-2, those it owns)."""
    torch.manual_seed(SEED)
    model = checkpoint_blocks(GPT(config), checkpointing)
    module, optimizer = wrap(layout, model, mixed)
    rank, world = dist.get_rank(), dist.get_world_size()
    run: dict = {"gradients": []}
    steps = 1 + count_flops
    for step in range(steps):
        torch.manual_seed(1000 * step + rank)  # the same dropout masks in every run
        windows_of_rank = windows[[(step * world + rank) * batch + i for i in range(batch)]]
        with SavedActivations(model, block_layers(model)) as held:
            loss = next_character_loss(module, windows_of_rank)
        counter = FlopCounterMode(display=False) if step < steps - 1 else nullcontext()
        started = time.perf_counter()
        with counter:
            loss.backward()
        run["backward_s"] = time.perf_counter() - started
        if isinstance(counter, FlopCounterMode):
            run["backward_flops"] = counter.get_total_flops()
        run["gradients"].append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        optimizer.step()
        run["activations"] = held.by_layer
        copies = ddp_compute_copies(module)
        run["memory"] = measure_memory(model.parameters(), optimizer, ddp_buckets(module), copies)
        optimizer.zero_grad()
    mine = list(model.parameters())
    if layout in ("zero1", "zero2"):
        mine = [p for p in mine if optimizer.owner_of(p) == rank]
    run["owned"], run["owned_tensors"] = sum(p.numel() for p in mine), len(mine)
    return run


def formula(layout: str, run: dict, psi: int, world: int, mixed: MixedPrecision | None = None):
    """Chapter 11's formula for this rank. Under fully_shard's policy the states are fp32
    ZeRO-3's: its bf16 parameters exist only while a unit computes, freed after."""
    dtypes = {}
    if mixed is not None and layout != "zero3":
        dtypes = {"param_dtype": mixed.param_dtype, "reduce_dtype": mixed.reduce_dtype}
    expected = Formula(layout, psi, run["owned_tensors"], world, **dtypes)
    return expected.expected(run["owned"])


@dataclass(frozen=True)
class Setup:
    """What every section reads: the model's settings, the text, and the sizes named s, b, h, a."""

    config: GPTConfig
    windows: Windows
    psi: int  # parameter elements, the tied embedding once
    world: int

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """(s, b, h, a): context, windows a rank, width, heads."""
        c = self.config
        return c.context, BATCH, c.width, c.heads


def section_states(setup: Setup, checks: dict[str, bool]) -> dict[str, dict]:
    section("1. The model's states")
    say_prose("""\
        As in chapter 11, counted from the storages on rank 0, after the optimizer step (the
        gradients not yet zeroed, so every term is there at once): parameters 4Ψ, gradients
        4Ψ, MiniDDP's buckets 4Ψ, AdamW's two moments 8Ψ and a 4-byte step per tensor. This is
        the accounting of fp32 everything, 20Ψ a rank under DDP; ZeRO shards Adam's state (1),
        then the gradients (2), then the parameters (3).""")
    runs = {
        layout: train(setup.config, setup.windows, layout, count_flops=layout == "ddp")
        for layout in LAYOUTS
    }
    say(f"  {'':<8}" + "".join(f"{k.replace('_', ' '):>17}" for k in STATES) + f"{'total':>11}")
    for layout, run in runs.items():
        expected = formula(layout, run, setup.psi, setup.world)
        cells = "".join(f"{fmt_bytes(getattr(run['memory'], k)):>17}" for k in STATES)
        say(f"  {NAMES[layout]:<8}{cells}{fmt_bytes(run['memory'].total):>11}")
        checks[f"{layout}: the model's states are the formula's"] = run["memory"] == expected
    say("  (each equal to chapter 11's formula, to the byte)")
    return runs


def section_activations(setup: Setup, runs: dict[str, dict], checks: dict[str, bool]) -> None:
    section("2. The activations")
    config, (s, b, h, a) = setup.config, setup.sizes
    blocks = runs["ddp"]["activations"]
    say_prose(f"""\
        What autograd saves between forward and backward, counted by its saved-tensor hooks
        (miniddp.instruments.activation_memory): each storage once, the parameters a Linear saves
        left out. Every block keeps the same, {fmt_bytes(blocks["blocks.0"])}: with s·b·h =
        {s * b * h:,} and a·s²·b = {a * s * s * b:,},

            72sbh + 12as²b + 16sb = {72 * s * b * h + 12 * a * s * s * b + 16 * s * b:,} bytes

        Term by term (miniddp/models/gpt_activations.py derives each from the saved tensors):
        each LayerNorm's input and mean and 1/std, the next Linear's input (the norm's output),
        q and k scaled and v (3·4sbh), the softmax, its dropout mask and the dropped
        probabilities (3·4as²b), the projection's input and its dropout mask, then the MLP's
        4sbh, 16sbh before GELU, 16sbh after it, and its mask. Outside the blocks (the
        embedding's ids and mask, the final norm, the head, the loss's log-softmax over the
        vocabulary): {fmt_bytes(blocks["other"])}. Per layer, on rank 0:""")
    expected = activation_bytes(config, b)
    for layer, measured in blocks.items():
        say(f"  {layer:<10} {measured:>12,} bytes   formula {expected[layer]:>12,}")
    for layout, run in runs.items():
        checks[f"{layout}: activations are the formula's"] = run["activations"] == expected
    no_dropout = GPTConfig(config.vocab_size, dropout=0.0)
    say_prose(f"""\
        The same under every layout: sharding splits the model, not the batch's activations
        (ZeRO-3's gathered parameters, saved by autograd, are freed after each forward).
        Korthikanti et al. count s·b·h·(34 + 5as/h) bytes a layer at 16 bits,
        {fmt_bytes(korthikanti_bytes(config, b, torch.bfloat16))} here. This block in bf16
        keeps 42sbh + 12as²b + 8sb = {fmt_bytes(block_bytes(config, b, torch.bfloat16))}
        (section 5 measures it): the CPU's dropout keeps its masks in the input's dtype, not
        as 1-byte booleans, and its attention with dropout runs in fp32 even for bf16 inputs.
        In fp32 their count gives 66sbh + 9as²b (their masks stay 1 byte), ours 72sbh +
        12as²b. Without dropout the flash kernel runs instead and keeps no s x s tensor at
        all: {fmt_bytes(block_bytes(no_dropout, b))} a block.""")


def section_checkpointing(
    setup: Setup, runs: dict[str, dict], checks: dict[str, bool]
) -> dict[Checkpointing, dict]:
    section("3. Checkpointing: bytes for FLOPs")
    config, (s, b, h, _) = setup.config, setup.sizes
    say_prose("""\
        torch.utils.checkpoint(use_reentrant=False) keeps only a region's inputs, then runs the
        region's forward again in backward, from the same generator state, so that dropout
        draws the same masks. Per block (the whole block's forward) or selective (attention
        only, where the s² terms live), under MiniDDP; the bytes a block, the FLOPs recomputed
        and the time for the whole backward:""")
    plain = runs["ddp"]
    trade = {Checkpointing.NONE: plain}
    for each in CHECKPOINTED:
        trade[each] = train(config, setup.windows, "ddp", each, count_flops=True)
    header = ("a block keeps", "formula", "recomputed", "formula", "backward")
    say(f"  {'':<10}" + "".join(f"{cell:>14}" for cell in header))
    for each, run in trade.items():
        extra = run["backward_flops"] - plain["backward_flops"]
        cells = (
            fmt_bytes(run["activations"]["blocks.0"]),
            fmt_bytes(block_bytes(config, b, checkpointing=each)),
            f"{extra / 1e9:.2f} GFLOP",
            f"{recompute_flops(config, b, each) / 1e9:.2f} GFLOP",
            f"{run['backward_s'] * 1e3:.0f} ms",
        )
        say(f"  {each.value:<10}" + "".join(f"{cell:>14}" for cell in cells))
        expected = activation_bytes(config, b, checkpointing=each)
        checks[f"{each.value}: activations are the formula's"] = run["activations"] == expected
        flops = recompute_flops(config, b, each)
        checks[f"{each.value}: FLOPs recomputed are the formula's"] = extra == flops
        checks[f"{each.value}: the gradients are the plain run's bits"] = all(
            torch.equal(x, y)
            for mine, theirs in zip(run["gradients"], plain["gradients"], strict=True)
            for x, y in zip(mine, theirs, strict=True)
        )
    say_prose(f"""\
        Per block, checkpointing keeps its input, e·sbh = {fmt_bytes(4 * s * b * h)}, and pays
        a whole forward again (24sbh² + 4bs²h FLOPs: about a third more compute for the step).
        Attention only keeps 13e·sbh + 4e·sb and drops every s² term; it pays 8sbh² + 4bs²h.
        (The backward times are one measurement on a shared CPU: an illustration, not a
        claim.) Under miniddp.fully_shard a unit's full parameters are back in the module for
        its backward, so a checkpointed region runs again there too, bitwise the same
        (tests/test_activation_memory.py).""")
    return trade


def section_whole_step(
    setup: Setup, runs: dict[str, dict], trade: dict[Checkpointing, dict], plot: Path | None
) -> None:
    section("4. The whole step")
    terms = {}
    for layout, run in runs.items():
        terms[NAMES[layout]] = {
            each.value: {
                **{k.replace("_", " "): getattr(run["memory"], k) for k in STATES},
                "activations": sum(trade[each]["activations"].values()),
            }
            for each in Checkpointing
        }
    for layout, variants in terms.items():
        cells = "  ".join(f"{v}: {fmt_bytes(sum(t.values())):>9}" for v, t in variants.items())
        say(f"  {layout:<8}{cells}")
    say_prose("""\
        The sum of what one rank holds at some point of the step, by checkpointing (none,
        block, attention): the activations are at their peak at the end of the forward, the
        gradients once backward has freed most of them, so the true peak lies between the
        largest term and the sum. At this size the activations outweigh the whole model: ZeRO
        shrinks the smaller part, checkpointing the larger.""")
    if plot is not None and dist.get_rank() == 0:
        plot.mkdir(parents=True, exist_ok=True)
        s, b, _, _ = setup.sizes
        title = (
            f"One step's memory on rank 0: a small GPT, fp32, AdamW, W = {setup.world}, "
            f"b = {b}, s = {s}\nbars: activation checkpointing none, per block, attention only"
        )
        say(f"wrote {step_memory(terms, plot / '11c_memory.png', title)}")


def section_mixed_precision(setup: Setup, runs: dict[str, dict], checks: dict[str, bool]) -> None:
    section("5. Mixed precision: bf16 compute, fp32 masters")
    say_prose(f"""\
        Each layout again, computing in bf16: MiniDDP(mixed_precision=MixedPrecision(bf16))
        keeps fp32 masters and a bf16 copy of each for forward and backward, its buckets in
        fp32; fully_shard(mp_policy=MixedPrecisionPolicy(bf16, fp32)) gathers bf16 parameters
        for each unit's forward and backward and keeps fp32 shards. bf16 matmuls run several
        times slower than fp32 on this CPU, so the batch is b = {MIXED_BATCH} windows a rank
        here. Rank 0, after the step:""")
    mixed_runs = {
        layout: train(setup.config, setup.windows, layout, mixed=BF16, batch=MIXED_BATCH)
        for layout in LAYOUTS
    }
    kinds = (*STATES, "compute_copies")
    say(f"  {'':<8}" + "".join(f"{k.replace('_', ' '):>16}" for k in kinds) + f"{'total':>10}")
    for layout, run in mixed_runs.items():
        cells = "".join(f"{fmt_bytes(getattr(run['memory'], k)):>16}" for k in kinds)
        say(f"  {NAMES[layout]:<8}{cells}{fmt_bytes(run['memory'].total):>10}")
        expected = formula(layout, run, setup.psi, setup.world, BF16)
        checks[f"bf16 {layout}: the model's states are the formula's"] = run["memory"] == expected
        checks[f"bf16 {layout}: activations are the bf16 formula's"] = run["activations"] == (
            activation_bytes(setup.config, MIXED_BATCH, torch.bfloat16)
        )
    bf16_block = mixed_runs["ddp"]["activations"]["blocks.0"]
    fp32_block = block_bytes(setup.config, MIXED_BATCH)  # section 2's formula, measured there
    say_prose(f"""\
        The model's states do not shrink: masters, gradients and Adam stay fp32, and the copies
        add 2Ψ (ZeRO-3's are transient). The activations do: {fmt_bytes(bf16_block)} a block at
        b = {MIXED_BATCH}, the bf16 formula of section 2 to the byte, against fp32's
        {fmt_bytes(fp32_block)} (not half: the CPU's attention with dropout computes in fp32
        even for bf16).

        The reduction may run in bf16 too: MixedPrecision(bf16, reduce_dtype=bf16) halves the
        buckets and the bytes on the wire. Its cost: the averaged gradients against the fp32
        reduction's, from the same bf16 copies and the same local gradients:""")
    low = train(setup.config, setup.windows, "ddp", mixed=BF16_REDUCE, batch=MIXED_BATCH)
    low_expected = formula("ddp", low, setup.psi, setup.world, BF16_REDUCE)
    checks["bf16 reduction: the model's states are the formula's"] = low["memory"] == low_expected

    pairs = zip(low["gradients"][0], mixed_runs["ddp"]["gradients"][0], strict=True)
    pairs = [(x.double(), y.double()) for x, y in pairs]
    error = sum((x - y).pow(2).sum() for x, y in pairs).sqrt()
    reduce_error = (error / sum(y.pow(2).sum() for _, y in pairs).sqrt()).item()
    say(
        f"  buckets {fmt_bytes(low['memory'].buckets)} instead of "
        f"{fmt_bytes(mixed_runs['ddp']['memory'].buckets)}; the gradients' error "
        f"{reduce_error:.1e} of their norm (bf16 keeps 8 bits: 2^-8 = {2**-8:.1e})"
    )
    checks["a bf16 reduction rounds, within bf16's 2^-8"] = 0 < reduce_error < 2**-8
    ddp_mixed = mixed_runs["ddp"]["memory"]
    per_element = {
        "fp32 (chapter 11)": runs["ddp"]["memory"].total / setup.psi,
        "bf16 with fp32 buckets": ddp_mixed.total / setup.psi,
        "bf16 with bf16 buckets": low["memory"].total / setup.psi,
    }
    say_prose(
        """\
        16Ψ or 20Ψ? Bytes per parameter under DDP, measured (a 4-byte step per tensor aside): """
        + "; ".join(f"{k} {v:.2f}Ψ" for k, v in per_element.items())
        + """.
        Chapter 11's 20Ψ is fp32 everything with DDP's bucket (4 + 4 + 4 + 8); without the
        bucket (gradient_as_bucket_view) it is 16Ψ. The ZeRO paper's 16Ψ is another sum: 2Ψ
        of 16-bit weights, 2Ψ of 16-bit gradients and 12Ψ of fp32 master, momentum and
        variance, no bucket. MiniDDP's mixed precision keeps its gradients in fp32 (the
        optimizer steps the fp32 master, and an fp32 average cast back to bf16 would lose its
        bits), so it holds 2 + 4 + 4 + 8 = 18Ψ and a bucket: 22Ψ with fp32 buckets, 20Ψ with
        bf16 ones. Mixed precision buys speed and smaller activations; sharding (ZeRO) is what
        shrinks the model's states."""
    )
    checks["fp32 DDP is 20Ψ and mixed DDP 22Ψ, plus the steps"] = (
        round(per_element["fp32 (chapter 11)"]) == 20
        and round(per_element["bf16 with fp32 buckets"]) == 22
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Chapter 11c: the memory of a real step.")
    add_plot_option(parser)
    args = parser.parse_args()
    world = init_distributed().world_size
    corpus = load_corpus()
    config = GPTConfig(len(corpus.vocabulary))
    windows = Windows(corpus.train, config.context)
    setup = Setup(config, windows, sum(p.numel() for p in GPT(config).parameters()), world)
    s, b, h, a = setup.sizes
    say_prose(f"""\
        Chapter 11c: a GPT on {world} ranks, Ψ = {setup.psi:,} fp32 elements (the
        tied embedding once), AdamW; per rank a batch of b = {b} windows of s = {s} characters,
        width h = {h}, a = {a} heads, {config.layers} blocks, dropout {config.dropout}.""")
    checks: dict[str, bool] = {}
    runs = section_states(setup, checks)
    section_activations(setup, runs, checks)
    trade = section_checkpointing(setup, runs, checks)
    section_whole_step(setup, runs, trade, args.plot)
    section_mixed_precision(setup, runs, checks)

    section("Checks")
    failed = [claim for claim, held in checks.items() if not held]
    say(f"  {len(checks) - len(failed)} of {len(checks)} claims hold")
    assert not failed, f"failed: {failed}"
    dist.barrier()  # every rank has passed its own checks
    say(
        f"Verified on {world} ranks: every byte of the step where its formula says, in fp32 and "
        "in bf16 with fp32 masters, the activations per block included; checkpointing trains "
        "bit for bit the same."
    )
    end_chapter()


if __name__ == "__main__":
    main()
