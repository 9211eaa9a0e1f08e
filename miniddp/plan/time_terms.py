"""Step time per GPU, term by term: compute, the bubble, and each axis's communication with what
compute hides of it and why.

With m microbatches a pipeline, a rank of L_r layers, P = peak FLOP/s, eta = matmul_efficiency,
kappa = memory_passes (clusters.py):

    compute    m·(FLOPs of L_r layers, forward, backward, recomputed) / (eta·P)
               + m·kappa·(L_r layers' activations) / HBM bandwidth        memory-bound kernels
    bubble     compute · f/(1 - f),  f = (p-1)/(vm + p-1)        pipeline.bubble.bubble_formula
    tp         4 collectives a layer and microbatch (6 with full recomputation) of b·s·h bf16
               over tp ranks, each alpha·2(t-1) + 2(t-1)/t·n·beta       collectives.cost_model;
               and at the ends, a microbatch on the last stage: the vocabulary-parallel
               loss's 3 all-reduces of b·s fp32 numbers (tensor_parallel/cross_entropy.py),
               the output layer's input gradient, and without a pipeline the embedding's
               all-reduce too, each b·s·h (Megatron's VocabParallelEmbedding and head alike)
    cp         K/V round the ring, (W-1)·max(t, m) + t forward and twice backward: hidden
               while a hop's transfer m is shorter than a block's compute t   context_parallel
    pp         each microbatch's activation forward and gradient back, v times across a rank;
               a step's check of its inputs, one tiny all-reduce over the stages
               (pipeline/step_checks.py); and a tied embedding's gradient (GPT's) all-reduced
               between the first and last stage after backward
    dp         the stage's gradients reduced over dp·cp ranks (all-reduce; ZeRO: reduce-scatter
               and the parameters' all-gather), hidden under the last microbatch's backward by
               observe.overlap_model.predict_step when the software overlaps (chapter 04's model)
    optimizer  Adam over the elements a rank owns, at HBM bandwidth

Without overlap (Megatron-LM 2021) every communication term is exposed; with it (Megatron-Core
2024) TP's is hidden behind its GEMMs but for one chunk in tp (tp_overlap), PP's but for the
fill and drain.
"""

from __future__ import annotations

from miniddp.collectives.cost_model import schedule
from miniddp.context_parallel.attention import ring_bytes, ring_seconds
from miniddp.observe.overlap_model import predict_step, predict_zero3_step, uniform_buckets
from miniddp.pipeline.bubble import bubble_formula
from miniddp.pipeline.step_checks import CheckRow
from miniddp.plan.clusters import Cluster
from miniddp.plan.layout import Layout, layers_per_stage
from miniddp.plan.memory_terms import layer_activations, stage_elements
from miniddp.plan.shapes import Transformer
from miniddp.plan.terms import UNVERIFIED, Term

BUCKET_ELEMENTS = 40_000_000  # Megatron-Core's gradient buckets
# The overlap model walks bucket by bucket; past 32 buckets its exposed time changes by less
# than 1/32 of the reduction, so larger stages are cut into 32 (and the search stays quick).
MAX_BUCKETS = 32
ADAM_BYTES = 36  # read gradient and master, read and write both moments and the master, write bf16


def time_terms(
    model: Transformer, cluster: Cluster, layout: Layout, seq: int, microbatches: int
) -> list[Term]:
    m, b, tp, cp, pp, v = microbatches, layout.microbatch, layout.tp, layout.cp, layout.pp, layout.v
    rate = cluster.matmul_efficiency * cluster.peak_flops
    layers = layers_per_stage(model, pp, v)
    even = model.layers % (pp * v) == 0

    # Compute: one microbatch on this rank.
    half = cluster.causal_half
    layer_forward = model.layer_forward_flops(seq, half) * b / (tp * cp)
    recomputed = model.recompute_flops(b, seq, layout.recompute, half) / model.layers / (tp * cp)
    logits = 6 * b * seq * model.hidden * model.vocab / (tp * cp) if even else 0.0
    flops = layers * (3 * layer_forward + recomputed) + logits
    passes = cluster.memory_passes * (4 / 3 if layout.recompute == "full" else 1)
    kept = layer_activations(model, cluster, layout, seq, "none")
    memory_bound = passes * layers * kept / cluster.hbm_bandwidth
    host = layers * cluster.layer_overhead + cluster.ends_overhead
    per_microbatch = flops / rate + memory_bound + host
    compute = m * per_microbatch
    terms = [
        Term(
            "compute",
            compute,
            f"{m} microbatches x {layers:g} layers: {flops / 1e12:.3g} TFLOP at "
            f"{cluster.matmul_efficiency:.0%} of peak + {memory_bound * 1e3:.3g} ms memory-bound"
            + (f" + {host * 1e3:.3g} ms the host's" if host else ""),
            f"{UNVERIFIED} on a GPU: FLOPs by Megatron's count (shapes.py), the two constants "
            "fitted in calibrate.py",
            compute,
        )
    ]

    f = bubble_formula(pp, m, v)
    bubble = compute * f / (1 - f)
    terms.append(
        Term(
            "bubble",
            bubble,
            f"(p-1)/(vm+p-1) = {f:.3f} of the step idle (p={pp}, v={v}, m={m})",
            "pipeline.bubble.bubble_formula (chapters 14, 14b: replayed orders)",
            bubble,
        )
    )

    token_bytes = cluster.element_bytes * b * seq // cp * model.hidden
    per_layer = 6 if layout.recompute == "full" else 4
    one = collective_seconds(cluster, "all_reduce", token_bytes, tp, 1)
    at_the_ends = (2 if pp == 1 else 1) * one  # the embedding's (first stage), the head's
    at_the_ends += 3 * collective_seconds(cluster, "all_reduce", 4 * b * seq // cp, tp, 1)
    tp_time = m * (layers * per_layer * one + at_the_ends)
    tp_time = tp_time if tp > 1 else 0.0
    tp_exposed = tp_time / tp + max(0.0, tp_time - compute) if cluster.tp_overlap else tp_time
    terms.append(
        Term(
            "tp",
            tp_time,
            f"{per_layer} all-reduces a layer"
            + (" (SP: all-gather + reduce-scatter, the same bytes)" * cluster.sequence_parallel)
            + f" of {token_bytes / 2**20:.3g} MiB each over {tp} GPUs, the vocabulary's "
            + f"{5 if pp == 1 else 4} at the ends, "
            + ("hidden behind the GEMMs but a chunk" if cluster.tp_overlap else "not overlapped"),
            "collectives.cost_model.CostModel, its ring 2(t-1)/t n (chapters 01, 13, 16); "
            + (f"{UNVERIFIED}: the GEMM overlap" if cluster.tp_overlap else "exposed"),
            tp_exposed,
        )
    )

    cp_time = cp_exposed = 0.0
    if cp > 1:
        forward_bytes, _ = ring_bytes(
            seq, model.key_value_heads // tp, model.head_dim, cp, cluster.element_bytes, b
        )
        cp_alpha, cp_bandwidth = cluster.link(cp, tp)
        hop = cp_alpha + forward_bytes / (cp - 1) / cp_bandwidth
        scores = 4 * b * seq * seq * model.hidden / (2 if half else 1) / tp
        block = scores / cp / cp / rate  # one hop's share of this rank's attention scores
        forward = ring_seconds(cp, block, hop)[cluster.cp_all_gather]  # (ring, all-gather)
        backward = ring_seconds(cp, 2 * block, 2 * hop)[cluster.cp_all_gather]
        cp_time = m * layers * 3 * (cp - 1) * hop
        cp_exposed = m * layers * (forward - cp * block + backward - 2 * cp * block)
    terms.append(
        Term(
            "cp",
            cp_time,
            f"K/V all-gathered over {cp} GPUs before the scores, not hidden"
            if cluster.cp_all_gather
            else f"K/V round a ring of {cp}, each hop hidden while shorter than a block's scores",
            "context_parallel.ring_bytes (test_context_parallel counts them) and ring_seconds "
            f"(chapter 15's model; {UNVERIFIED} on a GPU)",
            cp_exposed,
        )
    )

    pp_time = pp_exposed = 0.0
    if pp > 1:
        stride = tp * cp * layout.dp  # ranks between neighbouring stages
        pp_alpha, pp_bandwidth = cluster.link(2, stride)
        send = pp_alpha + token_bytes / tp / pp_bandwidth + cluster.collective_overhead
        pp_time = 2 * v * m * send
        pp_exposed = 2 * (pp - 1) * send if cluster.overlap else pp_time
        check = 8 * len(CheckRow._fields) * pp  # each stage's row of int64s, one table
        once = collective_seconds(cluster, "all_reduce", check, pp, stride)
        if model.biases:  # tied: the first and last stage each hold the embedding
            tied = cluster.grad_bytes * model.embedding_parameters / tp
            once += collective_seconds(cluster, "all_reduce", tied, 2, (pp - 1) * stride)
        pp_time, pp_exposed = pp_time + once, pp_exposed + once
    terms.append(
        Term(
            "pp",
            pp_time,
            f"2·v·m sends of {token_bytes / tp / 2**20:.3g} MiB (sequence-parallel shards), "
            + ("hidden but for the fill and drain" if cluster.overlap else "not overlapped")
            + ", the step's check"
            + (" and the tied embedding's all-reduce" if model.biases else ""),
            "the sends chapter 16's traffic_formula counts, at alpha-beta; the overlap "
            f"{UNVERIFIED}",
            pp_exposed,
        )
    )

    terms.append(_data_parallel(model, cluster, layout, m, per_microbatch, layers))
    owned = stage_elements(model, layout) / (1 if layout.zero == 0 else layout.dp * cp)
    optimizer = ADAM_BYTES * owned / cluster.hbm_bandwidth
    terms.append(
        Term(
            "optimizer",
            optimizer,
            f"Adam over {owned / 1e6:.4g} M owned elements, {ADAM_BYTES} bytes each at HBM speed",
            f"{UNVERIFIED}: a memory-bound estimate",
            optimizer,
        )
    )
    return terms


def _data_parallel(model, cluster, layout, m, per_microbatch, layers) -> Term:
    """DP's gradients over the dp·cp ranks that hold the same weights, `tp` ranks apart."""
    replicas = layout.dp * layout.cp
    if replicas == 1:
        return Term("dp", 0.0, "one replica: nothing to reduce", "-", 0.0)
    alpha, bandwidth = cluster.link(replicas, layout.tp)
    elements = stage_elements(model, layout)
    grads = cluster.grad_bytes * elements
    backward = 2 / 3 * per_microbatch  # the last microbatch's backward hides the reduction
    source = "collectives.cost_model.CostModel; the overlap observe.overlap_model (chapter 04)"
    if layout.zero == 3:
        unit = model.layer_parameters / layout.tp
        gathered = cluster.element_bytes * unit
        gather = collective_seconds(cluster, "all_gather", gathered, replicas, layout.tp)
        reduce = collective_seconds(
            cluster, "reduce_scatter", cluster.grad_bytes * unit, replicas, layout.tp
        )
        forward_unit, backward_unit = per_microbatch / 3 / layers, backward / layers
        one = predict_zero3_step(
            round(layers), forward_unit, backward_unit, gather, reduce, prefetch=cluster.overlap
        )
        return Term(
            "dp",
            m * one.comm_s,
            f"ZeRO-3: each layer gathered twice and reduce-scattered, every microbatch "
            f"({'prefetched' if cluster.overlap else 'no prefetch'})",
            "observe.overlap_model.predict_zero3_step (chapter 11)",
            m * one.exposed_s,
        )
    collective = "all_reduce" if layout.zero == 0 else "reduce_scatter"
    reduce_time = collective_seconds(cluster, collective, grads, replicas, layout.tp)
    params = cluster.element_bytes * elements  # ZeRO-1/2: the updated parameters, gathered
    gather_time = (
        collective_seconds(cluster, "all_gather", params, replicas, layout.tp)
        if layout.zero
        else 0.0
    )
    if not cluster.overlap:
        return Term(
            "dp",
            reduce_time + gather_time,
            f"{collective} of {grads / 2**30:.3g} GiB of gradients over {replicas} GPUs"
            + (" and the bf16 parameters' all-gather" if gather_time else "")
            + ", after backward, not overlapped",
            source,
            reduce_time + gather_time,
        )

    def overlapped(kind: str, nbytes: float, bucket: float, compute_s: float):
        """`kind` in buckets while `compute_s` of compute runs (ring: its steps' alphas and
        wire bytes per bucket, as chapter 04's model takes them)."""
        steps, wire = schedule(kind, "ring", int(nbytes), replicas)
        buckets = uniform_buckets(int(nbytes), max(bucket, nbytes / MAX_BUCKETS))
        latency = (1 if cluster.alpha_once else steps) * alpha
        return predict_step(buckets, compute_s, latency, wire / nbytes / bandwidth)

    buckets = min(MAX_BUCKETS, max(1, round(grads / (BUCKET_ELEMENTS * cluster.grad_bytes))))
    reduced = overlapped(collective, grads, BUCKET_ELEMENTS * cluster.grad_bytes, backward)
    comm, exposed = reduced.comm_s, reduced.exposed_s
    if gather_time:
        gathered = overlapped(
            "all_gather", params, BUCKET_ELEMENTS * cluster.element_bytes, backward / 2
        )
        comm, exposed = comm + gathered.comm_s, exposed + gathered.exposed_s
    return Term(
        "dp",
        comm,
        f"{collective} of {grads / 2**30:.3g} GiB in {buckets} buckets over {replicas} GPUs "
        "during the last microbatch's backward"
        + (", the parameters' all-gather during the first one's forward" if gather_time else ""),
        source,
        exposed,
    )


def collective_seconds(
    cluster: Cluster, kind: str, nbytes: float, group: int, stride: int
) -> float:
    """One ring collective of `nbytes` over `group` GPUs `stride` ranks apart: its steps'
    alphas (one alpha with `alpha_once`), its wire bytes, 2(W-1)/W n for an all-reduce, over the
    link's bandwidth (collectives.cost_model.schedule, chapter 01's ring), and the host's o."""
    alpha, bandwidth = cluster.link(group, stride)
    steps, wire = schedule(kind, "ring", int(nbytes), group)
    latency = (1 if cluster.alpha_once else steps) * alpha
    return latency + wire / bandwidth + cluster.collective_overhead
