"""What each rank of `parallelize(gpt, mesh)` holds and sends, as formulas: the maths that
chapter 15 checks against the storages and chapter 15c against the wire, for any (pp, dp, tp).

The GPT of chapter 12 (models/gpt.py): V vocabulary, T context, H width, L blocks of a heads.
A layout cuts it over pp stages x dp replicas x tp shards (parallelize.py's order: TP, then the
pipeline split, then MiniDDP); a replica's step runs m microbatches of N tokens each.

    held     stage_elements: a block is Ψ_b = 12H² + 13H; TP splits 12H² + 7H of it and keeps
             6H whole (rowwise biases, LayerNorms); stage s has L/p blocks, the first stage
             adds VH/t + TH (tokens, positions), the last 2H + VH/t (final norm, its own copy
             of the tied embedding). memory_formula: sharding/memory.py's Formula over them.
             activation_formula: gpt_activations' block, on one TP rank, times 1F1B's
             min(m, p - s) microbatches in flight
    sent     traffic_formula: TP's f and g, PP's activations, its check and the tie, DP's one
             bucket; each all-reduce on g ranks puts 2(g - 1)/g of its bytes on a ring's wire
    time     link_seconds: the alpha-beta model, alpha + wire bytes / bandwidth a message, one
             after another; what sits inside the F's and B's is stretched by the pipeline's
             fill and drain, (m + p - 1)/m

Plain functions of a GPTConfig and a MeshLayout, so that a planner can price a layout without
running it; tests/test_three_d_audit.py checks every term on every rank of several layouts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import torch

from miniddp.data_parallel.compute_copies import MixedPrecision
from miniddp.models.gpt import GPTConfig
from miniddp.models.gpt_activations import ID_BYTES, block_bytes
from miniddp.observe.link import Link, wire_bytes
from miniddp.pipeline.step_checks import CheckRow
from miniddp.sharding.memory import Formula, MemoryPerRank

FP32 = 4


@dataclass(frozen=True)
class MeshLayout:
    """How the ranks are cut, pp stages x dp replicas x tp shards, and a replica's step:
    `microbatches` (m) of `tokens` (N) each."""

    pp: int
    dp: int
    tp: int
    microbatches: int = 1
    tokens: int = 0

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.pp, self.dp, self.tp)

    @property
    def bubble(self) -> float:
        """1F1B's idle share of a step, (p - 1)/(m + p - 1) (chapter 14)."""
        return (self.pp - 1) / (self.microbatches + self.pp - 1)

    @classmethod
    def of(cls, pp: int, dp: int, tp: int, windows: int, context: int) -> MeshLayout:
        """`windows` of `context` tokens a step over all replicas; with a pipeline every window
        is a microbatch (the most microbatches, the smallest bubble), without one a replica
        runs its windows at once."""
        if windows % dp:
            raise ValueError(f"{windows} windows a step do not split over dp={dp} replicas")
        microbatches = windows // dp if pp > 1 else 1
        return cls(pp, dp, tp, microbatches, windows // dp // microbatches * context)


def every_layout(world: int, config: GPTConfig, windows: int) -> list[MeshLayout]:
    """Every (pp, dp, tp) of `world` ranks this GPT allows: tp divides the heads, pp the
    blocks, dp the windows; pp, then tp, ascending."""
    powers = [2**k for k in range(world.bit_length()) if world % 2**k == 0]
    return [
        MeshLayout.of(pp, world // (pp * tp), tp, windows, config.context)
        for pp in powers
        for tp in powers
        if config.layers % pp == 0
        and config.heads % tp == 0
        and world % (pp * tp) == 0
        and windows % (world // (pp * tp)) == 0
    ]


def stage_elements(config: GPTConfig, layout: MeshLayout, stage: int) -> int:
    """Parameter elements on a rank of `stage` (the module docstring's sums)."""
    h, t = config.width, layout.tp
    first, last = stage == 0, stage == layout.pp - 1
    elements = config.layers // layout.pp * ((12 * h * h + 7 * h) // t + 6 * h)
    if first:
        elements += config.vocab_size * h // t + config.context * h
    if last:
        elements += 2 * h + (0 if first else config.vocab_size * h // t)
    return elements


def stage_tensors(config: GPTConfig, layout: MeshLayout, stage: int) -> int:
    """Parameter tensors on the stage (Adam keeps a 4-byte step count for each): 12 a block,
    token and positions first, the final LayerNorm (and the tied copy) last."""
    first, last = stage == 0, stage == layout.pp - 1
    return 12 * config.layers // layout.pp + 2 * first + (2 + (not first)) * last


def memory_formula(
    config: GPTConfig,
    layout: MeshLayout,
    stage: int,
    mixed_precision: MixedPrecision | None = None,
) -> MemoryPerRank:
    """AdamW under MiniDDP on a rank of `stage`: 4 bytes of fp32 weight, 4 of gradient, the
    bucket (in reduce_dtype; none without DP, dp = 1) and 8 of moments an element, the step
    counts, and under mixed precision the param_dtype copy."""
    formula = Formula(
        "ddp",
        stage_elements(config, layout, stage),
        stage_tensors(config, layout, stage),
        layout.dp,
        param_dtype=None if mixed_precision is None else mixed_precision.param_dtype,
        reduce_dtype=torch.float32 if mixed_precision is None else mixed_precision.reduce_dtype,
    )
    expected = formula.expected()
    return expected if layout.dp > 1 else replace(expected, buckets=0)


def activation_formula(config: GPTConfig, layout: MeshLayout, stage: int) -> tuple[int, int]:
    """(bytes autograd saves for one microbatch's backward on a rank of `stage`, microbatches
    1F1B holds at its peak, min(m, p - s)), fp32 at dropout 0 under TP (t > 1). Its blocks keep
    gpt_activations' block_bytes on one TP rank; the first stage adds the token ids the lookup
    keeps (8N), the mask of ids other shards own (N) and the positions (8T); the last the final
    LayerNorm's 4N(2H + 2) and the vocabulary-parallel loss's softmax slice 4N·V/t with the
    target ids and their mask (9N)."""
    if layout.tp < 2:
        raise ValueError(
            f"activation_formula counts the vocabulary-parallel embedding and loss of tp > 1, "
            f"got tp={layout.tp}: for one whole model use gpt_activations.activation_bytes"
        )
    n, h, t = layout.tokens, config.width, layout.tp
    first, last = stage == 0, stage == layout.pp - 1
    windows = n // config.context
    per_microbatch = config.layers // layout.pp * block_bytes(config, windows, tp=t)
    if first:
        per_microbatch += ID_BYTES * n + n + ID_BYTES * config.context
    if last:
        per_microbatch += FP32 * n * (2 * h + 2) + FP32 * n * config.vocab_size // t
        per_microbatch += ID_BYTES * n + n
    return per_microbatch, min(layout.microbatches, layout.pp - stage)


@dataclass(frozen=True)
class Traffic:
    """`count` messages a step of `elements` numbers of `element_bytes` each: all-reduces over
    `ranks` ranks, or (ranks = 0) point-to-point sends to a neighbouring stage."""

    axis: str
    what: str
    count: int
    elements: int
    element_bytes: int = FP32
    ranks: int = 0

    @property
    def kind(self) -> str:
        return "send" if self.ranks == 0 else "all_reduce"

    @property
    def wire_bytes(self) -> float:
        """Bytes a rank puts on the wire for all `count` (a ring all-reduce: 2(g-1)/g n)."""
        nbytes = self.elements * self.element_bytes
        one = nbytes if self.ranks == 0 else wire_bytes("all_reduce", nbytes, self.ranks)
        return self.count * one


def traffic_formula(config: GPTConfig, layout: MeshLayout, stage: int) -> list[Traffic]:
    """What a rank of `stage` sends in one fp32 step (after the first, which also sends the
    shapes and the schedule's orders)."""
    m, n, h = layout.microbatches, layout.tokens, config.width
    pp, dp, tp = layout.shape
    first, last = stage == 0, stage == pp - 1
    sent = []
    if tp > 1:  # per microbatch: g twice forward and f twice backward a block (chapter 13),
        # the embedding's g forward (first stage) and the head's f backward (last stage)
        blocks = 4 * (config.layers // pp) + first + last
        sent.append(Traffic("tp", "f and g, activations of N·H", m * blocks, n * h, ranks=tp))
        if last:
            sent.append(Traffic("tp", "the loss's max, sum, target logit", 3 * m, n, ranks=tp))
    if pp > 1:
        if not last:
            sent.append(Traffic("pp", "activations to the next stage", m, n * h))
        if not first:
            sent.append(Traffic("pp", "gradients to the stage before", m, n * h))
        fields = len(CheckRow._fields)  # what each stage checks before a step (step_checks.py)
        sent.append(
            Traffic("pp", f"the schedule's check, {fields} int64 a stage", 1, fields * pp, 8, pp)
        )
        if first or last:
            tied = config.vocab_size * h // tp
            sent.append(Traffic("pp", "the tied embedding's gradient", 1, tied, ranks=2))
    if dp > 1:
        elements = stage_elements(config, layout, stage)
        sent.append(Traffic("dp", "the gradients, one bucket", 1, elements, ranks=dp))
    return sent


def messages(sent: list[Traffic]) -> Counter:
    """(axis, kind, elements, bytes an element) -> how many: `sent` in the form in which
    figures.three_d.messages_sent counts a recorded step, to compare the two."""
    counted: Counter = Counter()
    for traffic in sent:
        counted[traffic.axis, traffic.kind, traffic.elements, traffic.element_bytes] += (
            traffic.count
        )
    return counted


def link_seconds(sent: list[Traffic], layout: MeshLayout, link: Link, sends: bool = True) -> float:
    """The alpha-beta model of what `sent` adds to a step on `link`: each message costs
    alpha + wire bytes / bandwidth, one after another on the rank's link. TP's and PP's sit
    inside the F's and B's, so the pipeline's fill and drain stretch them by (m + p - 1)/m;
    DP's and the tie's come once, at the end. `sends=False`: the all-reduces only (the
    simulated link delays collectives; a pipeline's sends go around it)."""
    stretch = (layout.microbatches + layout.pp - 1) / layout.microbatches
    total = 0.0
    for traffic in sent:
        if traffic.kind == "send" and not sends:
            continue
        seconds = traffic.count * link.alpha + traffic.wire_bytes / link.bandwidth
        inside = traffic.axis == "tp" or traffic.kind == "send"
        total += seconds * (stretch if inside else 1.0)
    return total


def slowest_stage_seconds(
    config: GPTConfig, layout: MeshLayout, link: Link, sends: bool = True
) -> float:
    """link_seconds for the layout's slowest stage: what the step waits for."""
    return max(
        link_seconds(traffic_formula(config, layout, stage), layout, link, sends)
        for stage in range(layout.pp)
    )
