"""Tensor parallelism from scratch, on torch.distributed, mirroring torch's own API.

The vocabulary (Megatron-LM, Shoeybi et al. 2019):
    tensor-parallel group   the W ranks that share one copy of the model, each holding a slice
                            of every split weight (W = the group's size)
    colwise / rowwise       a weight split along its output / input dimension (plan.py)
    f, g                    the two autograd functions where the group talks (layers.py)
    mesh                    TP groups inside DP groups: a grid of ranks (miniddp/mesh.py)

    layers.py           torch's chunk rule; f and g; ColwiseLinear, RowwiseLinear;
                        VocabParallelEmbedding (rowwise), ColwiseEmbedding; sequence
                        parallelism's f-bar and g-bar, SequenceParallelLayerNorm and
                        SequenceParallelRMSNorm
    plan.py             ColwiseParallel(), RowwiseParallel(), SequenceParallel(): which module
                        splits how, and parallelize_module(module, mesh or group, plan)
    cross_entropy.py    the loss from vocabulary-sharded logits, never gathered
    blocks.py           MLP, CausalSelfAttention, TransformerBlock, TinyGPT, and plan_for

    block = TransformerBlock(256, 8)
    parallelize_module(block, mesh["tp"], plan_for(block))  # {"attention.q": ColwiseParallel()..}
    # torch's: torch.distributed.tensor.parallel.parallelize_module(block, mesh, the same plan)
"""

from miniddp.tensor_parallel.blocks import (
    MLP,
    CausalSelfAttention,
    TinyGPT,
    TransformerBlock,
    plan_for,
)
from miniddp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from miniddp.tensor_parallel.layers import (
    ColwiseEmbedding,
    ColwiseLinear,
    RowwiseLinear,
    SequenceParallelLayerNorm,
    SequenceParallelRMSNorm,
    VocabParallelEmbedding,
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
)
from miniddp.tensor_parallel.plan import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    Style,
    parallelize_module,
)

__all__ = [
    "MLP",
    "CausalSelfAttention",
    "ColwiseEmbedding",
    "ColwiseLinear",
    "ColwiseParallel",
    "ParallelStyle",
    "RowwiseLinear",
    "RowwiseParallel",
    "SequenceParallel",
    "SequenceParallelLayerNorm",
    "SequenceParallelRMSNorm",
    "Style",
    "TinyGPT",
    "TransformerBlock",
    "VocabParallelEmbedding",
    "copy_to_tensor_parallel",
    "gather_from_sequence_parallel",
    "parallelize_module",
    "plan_for",
    "reduce_from_tensor_parallel",
    "reduce_scatter_to_sequence_parallel",
    "vocab_parallel_cross_entropy",
]
