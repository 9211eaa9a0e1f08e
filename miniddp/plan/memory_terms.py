"""Memory per GPU, term by term, from the formulas the chapters verify.

A rank of pipeline stage s holds:

    parameters, gradients,        miniddp.sharding.memory.Formula (chapters 11, 11c, 13, 16):
    optimizer state, copies       fp32 masters, bf16 compute copies, fp32 gradients as bucket
                                  views, Adam's 8 bytes an element sharded over the dp·cp ranks
                                  by ZeRO-1/2 (ZeRO-3: everything, 16Ψ/W); the masters too
                                  where the software shards them (clusters.py)
    activations                   Korthikanti's per-layer bytes (gpt_activations.
                                  megatron_layer_bytes) times the microbatch-stages the
                                  schedule holds at its peak (pipeline.bubble.held_formula,
                                  checked against peak_held of chapter 14's orders)
    buffers                       what travels: the pipeline's send and receive buffers, the
                                  sequence-parallel all-gather of a layer's input, ZeRO-3's
                                  two gathered layers

The elements of a rank: its stage's layers split by TP, and the embedding (first stage) or
the output layer (last stage; a tied GPT keeps a copy there) split by TP's vocabulary split.
The plan takes the larger of the first and the last stage.

Megatron-LM's distributed optimizer also shards the fp32 masters (6 + 12/d bytes an element,
not MiniDDP's ZeRO-1's 10 + 8/d): the plan counts that only for a cluster whose software does
(`sharded_masters`), and says that no chapter measures it.
"""

from __future__ import annotations

import torch

from miniddp.models.gpt_activations import megatron_layer_bytes
from miniddp.pipeline.bubble import held_formula
from miniddp.plan.clusters import Cluster
from miniddp.plan.layout import Layout, layers_per_stage
from miniddp.plan.shapes import Transformer
from miniddp.plan.terms import UNVERIFIED, Term
from miniddp.sharding.memory import Formula

ZERO_STAGES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
TENSORS_PER_LAYER = 12  # a GPT block's (chapter 16); only Adam's 4-byte step counts use it
ELEMENT = 2  # bf16 activations and compute copies


def end_stage_layers(model: Transformer, layout: Layout) -> float:
    """Layers on a rank of the first (or last) stage: Llama 3's split gives it one fewer."""
    layers = layers_per_stage(model, layout.pp, layout.v)
    return layers - 1 if model.layers % (layout.pp * layout.v) else layers


def stage_elements(model: Transformer, layout: Layout) -> float:
    """Parameter elements on a rank of the first stage (the last holds as many: the output
    layer is the embedding's size); without a pipeline, both, unless tied (GPT)."""
    layers = end_stage_layers(model, layout)
    ends = 2 if layout.pp == 1 and not model.biases else 1
    return (layers * model.layer_parameters + ends * model.embedding_parameters) / layout.tp


def layer_activations(model: Transformer, cluster: Cluster, layout: Layout, seq: int, recompute):
    """One layer, one microbatch, on one rank: TP with sequence parallelism, CP's s/cp."""
    return megatron_layer_bytes(
        seq // layout.cp,
        layout.microbatch,
        model.hidden,
        model.heads,
        tp=layout.tp,
        sequence_parallel=layout.tp > 1 and cluster.sequence_parallel,
        recompute=recompute,
        kv_heads=model.key_value_heads,
        ffn=model.mlp_width,
        gated=model.gated,
        dropout=model.dropout,
        flash=cluster.causal_half,
    )


def memory_terms(
    model: Transformer, cluster: Cluster, layout: Layout, seq: int, microbatches: int
) -> list[Term]:
    """The terms of the stage that holds the most (first or last)."""
    return max(
        (_stage_terms(model, cluster, layout, seq, microbatches, first) for first in (True, False)),
        key=lambda terms: sum(term.value for term in terms),
    )


def _stage_terms(model, cluster, layout, seq, microbatches, first: bool) -> list[Term]:
    elements = stage_elements(model, layout)
    replicas = layout.dp * layout.cp  # CP's ranks hold the same weights: they average too
    stage = ZERO_STAGES[layout.zero]
    layers = end_stage_layers(model, layout)
    tensors = int(TENSORS_PER_LAYER * layers) + 2
    if stage == "zero3":  # fp32 fully_shard (chapter 11); the bf16 copies are the gathered ones
        formula = Formula(stage, int(elements), tensors, replicas).expected()
        copies_why = "two gathered layers in bf16 (the one computing, the one prefetched)"
        copies = 2 * ELEMENT * model.layer_parameters / layout.tp
        copies_source = f"{UNVERIFIED}: fully_shard's mixed precision is not in Formula yet"
    else:
        views = stage in ("ddp", "zero1")  # ZeRO-2 keeps MiniDDP's buckets (sharding/zero2.py)
        formula = Formula(stage, int(elements), tensors, replicas, views, torch.bfloat16).expected()
        copies, copies_why = formula.compute_copies, "bf16 copies of the fp32 masters"
        copies_source = "sharding.memory.Formula (chapter 11c, side_by_side)"
    source = "sharding.memory.Formula (chapters 11, 11c, 13, 16)"
    masters, masters_why, masters_source = formula.parameters, "fp32 masters", source
    if cluster.sharded_masters and stage in ("zero1", "zero2"):
        masters = formula.parameters / replicas
        masters_why = f"fp32 masters sharded over dp·cp = {replicas} with the states"
        masters_source = (
            f"{UNVERIFIED}: Formula's masters divided by dp·cp, as ZeRO's paper and Megatron's "
            "distributed optimizer shard them (MiniDDP's ZeRO-1 keeps them whole)"
        )
    elif stage == "zero3":
        masters_why = f"fp32 masters, sharded over dp·cp = {replicas} (zero3)"
    shard = "" if stage == "ddp" else f", sharded over dp·cp = {replicas} ({stage})"
    held = held_formula(layout.pp, microbatches, layout.v, 0 if first else layout.pp - 1)
    per_stage = layers / layout.v  # a microbatch-stage's layers
    kept = layer_activations(model, cluster, layout, seq, layout.recompute)
    activations = held * per_stage * kept
    why = (
        f"{held} microbatch-stages of {per_stage:g} layers held at the schedule's peak, "
        f"{kept / 2**20:.0f} MiB a layer (recompute={layout.recompute})"
    )
    if layout.recompute == "full":  # backward rebuilds one layer's whole activations at a time
        activations += layer_activations(model, cluster, layout, seq, "none")
        why += ", plus one layer rebuilt in backward"
    if not first:  # the loss's fp32 logits, s·b·V/t, and their gradient
        activations += 2 * 4 * seq // layout.cp * layout.microbatch * model.vocab / layout.tp
        why += ", plus the fp32 logits and their gradient"
    activation_source = (
        "models.gpt_activations.megatron_layer_bytes (= korthikanti_bytes at t = 1, chapter "
        "11c; SP's 1/t: tests/test_sequence_parallel.py) x pipeline.bubble.held_formula "
        "(= peak_held of chapter 14's and 14b's orders)"
    )
    token_bytes = cluster.element_bytes * seq // layout.cp * layout.microbatch * model.hidden
    buffers = 2 * token_bytes / layout.tp if layout.pp > 1 else 0.0  # send and receive
    buffers += token_bytes if layout.tp > 1 and cluster.sequence_parallel else 0.0  # SP's
    return [
        Term("parameters", masters, masters_why, masters_source),
        Term(
            "gradients",
            formula.gradients + formula.buckets,
            "fp32, as bucket views" if not formula.buckets else "fp32 shards and fp32 buckets",
            source,
        ),
        Term("optimizer_state", formula.optimizer_state, f"Adam's two moments{shard}", source),
        Term("compute_copies", copies, copies_why, copies_source),
        Term("activations", activations, why, activation_source),
        Term(
            "buffers",
            buffers,
            "pipeline send/receive, SP's all-gathered input",
            f"{UNVERIFIED}: sizes from the code's shapes, no chapter measures them",
        ),
    ]
