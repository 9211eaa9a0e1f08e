"""What the GPT of miniddp/models/gpt.py keeps from its forward for its backward, op by op, and what
checkpointing trades it for.

Every number here was read off the saved tensors themselves (miniddp.instruments.activation_memory
counts them, by storage, parameters left out), for a model in train() mode on the CPU, torch
2.13. With s = context, b = batch, h = width, a = heads, e = the model's bytes per element (4
fp32, 2 bf16), one Block keeps, in the order its forward saves them:

    attention_norm   its input x (e·sbh) and the row's mean and 1/std (2e·sb)
    qkv              its input, the norm's output (e·sbh); its weight is a parameter
    attention        dropout > 0: torch's math path, in fp32 even for a bf16 model (f = 4):
                       q·√scale and k·√scale (2f·sbh, copies), softmax's output (f·as²b),
                       dropout's mask, already divided by 1 - p (f·as²b), the dropped
                       probabilities (f·as²b), v made contiguous (f·sbh)
                     dropout = 0: the flash kernel: q, k and v as three views of qkv's one
                       output (3e·sbh), its output (e·sbh) and the row's log-sum-exp (4·abs,
                       fp32), never the s x s scores
    proj             its input, the heads side by side: a copy after the math path (e·sbh),
                       a view of flash's output (laid out b, s, a, d), so nothing new
    residual drop    its mask, in the input's dtype (e·sbh); none at dropout = 0
    mlp_norm         as attention_norm: e·sbh + 2e·sb
    up, gelu, down   up's input (e·sbh), GELU's input (4e·sbh), down's input (4e·sbh)
    mlp dropout      its mask (e·sbh); none at dropout = 0

    dropout > 0:  15e·sbh + 12·sbh + 12·as²b + 4e·sb      fp32: 72sbh + 12as²b + 16sb
    dropout = 0:  16e·sbh + 4·abs + 4e·sb                  fp32: 64sbh + 16abs + 16sb

Korthikanti et al. (2022) count s·b·h·(34 + 5as/h) at 16 bits: sbh(16e + 2) + as²b(2e + 1) for
any e, their two dropout masks and the attention mask 1 byte each (CUDA's bool masks). Against
this block the differences are three, each visible above: the CPU's dropout keeps its mask in
the input's dtype (e bytes, not 1: +3(e-1) of it); the CPU's math attention computes in fp32
for a bf16 model (q, k, v and the three s x s tensors at 4 bytes, not 2); and LayerNorm's
statistics (4e·sb), which they leave out as 1/h of the rest. So fp32 keeps 72sbh + 12as²b where
"the terms doubled" would say 68 + 10 and their masks 66 + 9; bf16 keeps 42sbh + 12as²b against
their 34 + 5. Without dropout the flash kernel removes the s² term altogether: what their
selective recomputation buys, a fused kernel gives for free. Other devices run other kernels (a
fused dropout, fused attention with dropout): the formula is the CPU's, where it is checked.

Outside the blocks, for `next_character_loss(model, windows)` with windows (b, s + 1) of int64:
the token ids (a view of windows: 8b(s + 1)), the positions (8s), the embedding dropout's mask
(e·sbh, dropout > 0), the final norm (e·sbh + 2e·sb), the head's input (e·sbh), the loss's
log-softmax (e·sbV, saved by log_softmax and nll_loss alike: once), the targets copied flat
(8sb) and nll_loss's total weight (e).

Checkpointing (torch.utils.checkpoint, use_reentrant=False) keeps a region's inputs and runs it
again in backward. Per block:

    BLOCK      the block's input x: e·sbh. Recomputed: the whole forward, 24sbh² + 4bs²h FLOPs
    ATTENTION  attention's input (the norm output qkv kept anyway), its inside dropped: the
               block keeps (12 + [dropout > 0])e·sbh + 4e·sb, no s² term. Recomputed: the
               attention's forward, 8sbh² + 4bs²h FLOPs

Not counted: each checkpoint also stashes the CPU generator's state (5,056 bytes, a tensor the
region's closure holds, not one autograd saves) so that dropout draws the same masks again.
"""

from __future__ import annotations

from enum import Enum
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from miniddp.models.gpt import GPT, GPTConfig

ID_BYTES = 8  # int64 token ids, positions and targets
FP32 = 4  # the math attention's dtype on the CPU, and the log-sum-exp's


class Checkpointing(Enum):
    NONE = "none"
    BLOCK = "block"  # each block's whole forward, run again in backward
    ATTENTION = "attention"  # each block's attention only (selective)


def block_layers(model: GPT) -> dict[str, nn.Module]:
    """The layers to attribute saved tensors to: 'blocks.0', 'blocks.1', ..."""
    return {f"blocks.{i}": block for i, block in enumerate(model.blocks)}


def block_bytes(
    config: GPTConfig,
    batch: int,
    dtype: torch.dtype = torch.float32,
    checkpointing: Checkpointing = Checkpointing.NONE,
    tp: int = 1,
) -> int:
    """What one Block keeps for backward, in train() mode on the CPU (the module docstring
    derives each term). `tp` > 1: one rank of Megatron's tensor parallelism (chapter 16), which
    keeps what it computes on its a/t heads and 4H/t of the MLP, and the rest whole."""
    s, b, h, a, e = config.context, batch, config.width, config.heads, dtype.itemsize
    sbh, dropout = s * b * h, config.dropout > 0
    if tp > 1:
        return tensor_parallel_block_bytes(config, batch, dtype, checkpointing, tp)
    norms = 2 * (e * sbh + 2 * e * s * b)  # each norm's input and its mean and 1/std
    mlp = e * sbh + 4 * e * sbh + 4 * e * sbh + dropout * e * sbh  # up, GELU, down, mask
    if checkpointing is Checkpointing.BLOCK:
        return e * sbh
    if checkpointing is Checkpointing.ATTENTION:
        return norms + e * sbh + mlp  # + attention's input, kept by its checkpoint
    if dropout:  # math attention, fp32: q, k, v copies, three s x s tensors; proj's input, mask
        attention = 3 * FP32 * sbh + 3 * FP32 * a * s * s * b + e * sbh + e * sbh
    else:  # flash: q, k, v one storage, the output (= proj's input), the log-sum-exp
        attention = 3 * e * sbh + e * sbh + FP32 * a * b * s
    return norms + e * sbh + attention + mlp  # e·sbh: qkv's input


def tensor_parallel_block_bytes(
    config: GPTConfig, batch: int, dtype: torch.dtype, checkpointing: Checkpointing, tp: int
) -> int:
    """block_bytes on one of `tp` ranks, at dropout 0 without checkpointing (where it is
    checked). Whole on every rank: both norms' inputs and statistics (2(e·sbh + 2e·sb)), and
    the inputs of qkv and up, the norms' outputs (2e·sbh). Split over the t ranks: q, k, v
    (3e·sbh), flash's output (e·sbh) and log-sum-exp (4·abs), GELU's input and down's input
    (8e·sbh). In fp32: 4sb(4h + 4) + 4sb(12h + a)/t."""
    if config.dropout > 0 or checkpointing is not Checkpointing.NONE:
        raise ValueError(
            f"block_bytes under TP (tp={tp}) is derived for dropout 0 without checkpointing, "
            f"got dropout={config.dropout}, checkpointing={checkpointing.value}: use tp=1, or "
            "derive those terms and check them against SavedActivations first"
        )
    if config.heads % tp or (4 * config.width) % tp:
        raise ValueError(f"tp={tp} must divide the {config.heads} heads and the MLP's 4H")
    s, b, h, a, e = config.context, batch, config.width, config.heads, dtype.itemsize
    sbh = s * b * h
    whole = 2 * (e * sbh + 2 * e * s * b) + 2 * e * sbh
    split = 3 * e * sbh + e * sbh + FP32 * a * b * s + 8 * e * sbh
    return whole + split // tp


def other_bytes(config: GPTConfig, batch: int, dtype: torch.dtype = torch.float32) -> int:
    """What the embedding, the final norm, the head and the loss keep (module docstring)."""
    s, b, h, e = config.context, batch, config.width, dtype.itemsize
    embedding = ID_BYTES * b * (s + 1) + ID_BYTES * s + (config.dropout > 0) * e * s * b * h
    head = e * s * b * h + 2 * e * s * b + e * s * b * h  # final norm, the head's input
    loss = e * s * b * config.vocab_size + ID_BYTES * s * b + e
    return embedding + head + loss


def activation_bytes(
    config: GPTConfig,
    batch: int,
    dtype: torch.dtype = torch.float32,
    checkpointing: Checkpointing = Checkpointing.NONE,
) -> dict[str, int]:
    """Per layer, as SavedActivations(model, block_layers(model)).by_layer measures it."""
    block = block_bytes(config, batch, dtype, checkpointing)
    return {
        **{f"blocks.{i}": block for i in range(config.layers)},
        "other": other_bytes(config, batch, dtype),
    }


def korthikanti_bytes(config: GPTConfig, batch: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Korthikanti et al.'s per-layer count, sbh(16e + 2) + as²b(2e + 1): s·b·h·(34 + 5as/h)
    at e = 2, the masks 1 byte each."""
    s, b, h, a, e = config.context, batch, config.width, config.heads, dtype.itemsize
    return s * b * h * (16 * e + 2) + a * s * s * b * (2 * e + 1)


def megatron_layer_bytes(
    seq: int,
    batch: int,
    width: int,
    heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    kv_heads: int | None = None,
    ffn: int | None = None,
    gated: bool = False,
    dropout: bool = True,
    flash: bool = False,
    element_bytes: int = 2,
) -> float:
    """One transformer layer's saved activations on a GPU, Korthikanti et al. (2022) Table 2,
    term by term, so that a Llama-shaped layer (kv_heads < heads, a gated MLP of width ffn)
    is counted as theirs is. With e = element_bytes, g = kv_heads/heads, F = ffn (4h):

        replicated under plain TP     the two LayerNorms' inputs (2e·sbh), the inputs of qkv and
                                      of the MLP's first matmul (2e·sbh), the two dropout masks
                                      (2·sbh, 1 byte each)
        split by t                    Q (e·sbh), K and V (2eg·sbh), the projection's input
                                      (e·sbh); the MLP's e·sbF before and after its activation
                                      (a gated MLP keeps its two branches and their product:
                                      3e·sbF); the s² scores: softmax's output (e·as²b), its
                                      dropout mask (as²b) and output (e·as²b)

    At e = 2, g = 1, F = 4h: sbh(10 + 24/t + 5as/(ht)), their equation 2, and sbh(34 + 5as/h)
    at t = 1 (korthikanti_bytes). Sequence parallelism splits the replicated part along the
    sequence too: everything is divided by t (tests/test_sequence_parallel.py measures the
    LayerNorm's and dropout's 1/t). Selective recomputation, or a flash kernel, keeps no s²
    term; full recomputation keeps the layer's input only, e·sbh (split by t under sequence
    parallelism). Without dropout (Llama) its masks go; `flash`: the fused kernel keeps no s²
    term either (its log-sum-exp, 4·abs, is left out as Korthikanti leave out the norms'
    statistics)."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, not {recompute!r}")
    s, b, h, a, e = seq, batch, width, heads, element_bytes
    g = (heads if kv_heads is None else kv_heads) / heads
    f = 4 * h if ffn is None else ffn
    sbh = s * b * h
    if recompute == "full":
        return e * sbh / (tp if sequence_parallel else 1)
    masks = 2 * sbh if dropout else 0
    replicated = 2 * e * sbh + 2 * e * sbh + masks
    mlp = (3 if gated else 2) * e * s * b * f
    split = e * sbh + 2 * e * g * sbh + e * sbh + mlp
    if recompute == "none" and not flash:
        split += a * s * s * b * (2 * e + (1 if dropout else 0))
    return (replicated / (tp if sequence_parallel else 1)) + split / tp


def recompute_flops(config: GPTConfig, batch: int, checkpointing: Checkpointing) -> int:
    """The forward FLOPs checkpointing runs again in backward, all blocks: each matmul's 2·m·n·k
    (as torch.utils.flop_counter counts them; it has no formula for the CPU's flash kernel, so
    this is checked at dropout > 0, where attention is two batched matmuls of 2bs²h each)."""
    s, b, h = config.context, batch, config.width
    attention = 2 * s * b * h * 3 * h + 2 * s * b * h * h + 2 * 2 * b * s * s * h
    mlp = 2 * 2 * s * b * h * 4 * h
    per_block = {
        Checkpointing.NONE: 0,
        Checkpointing.BLOCK: attention + mlp,
        Checkpointing.ATTENTION: attention,
    }[checkpointing]
    return config.layers * per_block


def checkpoint_blocks(model: GPT, checkpointing: Checkpointing) -> GPT:
    """Run each block's forward (BLOCK) or its attention's (ATTENTION) under torch's
    non-reentrant checkpoint. The module's own forward is replaced, on the instance: parameter
    names, hooks and state_dict stay the model's, and a forward hook around it still runs."""
    if checkpointing is Checkpointing.NONE:
        return model
    for block in model.blocks:
        region = block if checkpointing is Checkpointing.BLOCK else block.attention
        if isinstance(region.__dict__.get("forward"), partial):
            raise ValueError(
                f"{type(region).__name__} is already checkpointed: call checkpoint_blocks once"
            )
        region.forward = partial(checkpoint, region.forward, use_reentrant=False)
    return model
