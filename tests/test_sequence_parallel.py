"""Sequence parallelism inside tensor parallelism (Megatron-SP, miniddp/tensor_parallel/) against
one process on the whole sequence, and against torch's SequenceParallel with
ColwiseParallel(input_layouts=Shard(1)) and RowwiseParallel(output_layouts=Shard(1)).

Within 1e-5 of each tensor's largest magnitude plus one (measured: under 1e-7), not bitwise, for
the reasons tests/test_tensor_parallel.py gives; LayerNorm's weight and bias gradients are the
sum of W ranks' partial sums here, one sum over all positions there.
"""

from __future__ import annotations

import pytest

from miniddp import tensor_parallel as tp
from tests import sequence_parallel_tasks as tasks
from tests.harness.measurements import record_max
from tests.sequence_parallel_tasks import SPSpec

TOLERANCE = 1e-5


@pytest.mark.parametrize(
    "spec",
    [
        SPSpec(model="norm_mlp"),
        SPSpec(model="norm_mlp", bias=False, seed=3),
        SPSpec(model="rms_norm_mlp", bias=False, seed=2),
        SPSpec(model="block"),
        SPSpec(model="block", fused_qkv=True, seed=1),
    ],
    ids=["norm_mlp", "norm_mlp-no-bias", "rms_norm_mlp", "block", "block-fused-qkv"],
)
def test_sequence_parallel_equals_one_process_and_torch(pool2, spec):
    """Output and input gradient (this rank's positions), every gradient (this rank's chunk, and
    LayerNorm's and the rowwise biases' whole): one process's, and torch's within rounding."""
    for rank, report in enumerate(pool2.run(tasks.differences, spec)):
        assert report["shapes"] == report["plain TP shapes"]  # names and shards unchanged
        for kind in ("ours", "torch"):
            for what, difference in report[kind].items():
                record_max(f"sequence parallel {kind} vs one process", difference)
                assert difference <= TOLERANCE, (rank, kind, what, difference)


@pytest.mark.parametrize("model", ["norm_mlp", "block"])
def test_a_length_w_does_not_divide_is_refused_on_every_rank_naming_it(pool2, model):
    """S = 7 over W = 2: rank 0 holds 4 positions, rank 1 holds 3, and the first all-gather
    (f-bar) would not match (gloo aborts, torch's SequenceParallel too). Named instead."""
    for rank, said in enumerate(pool2.run(tasks.uneven_sequence, SPSpec(model=model, length=7))):
        assert "rank 0 holds 4 positions and rank 1 holds 3" in said, (rank, said)
        assert "S = 7" in said and "multiple of 2" in said, (rank, said)


@pytest.mark.parametrize("model", ["norm_mlp", "rms_norm_mlp"])
def test_layer_norm_weight_gradient_is_summed_over_the_group(pool2, model):
    """The planted bug: without f on its weight, each rank's LayerNorm (or RMSNorm) gradient
    is the sum over its own positions only, and the check above catches it."""
    results = pool2.run(tasks.without_f_on_replicated_parameters, SPSpec(model=model))
    assert all(r["ours"]["0.weight"] > 1e-3 for r in results)


def test_layer_norm_and_dropout_keep_a_wth_of_the_activations(pool2):
    """What LayerNorm and Dropout save for backward, measured from autograd's saved tensors:
    W times less on a rank's positions (the same bytes on the wire: an all-gather and a
    reduce-scatter where plain TP all-reduces)."""
    for memory in pool2.run(tasks.norm_and_dropout_memory, 64, 256):
        ratio = memory["plain"] / memory["sequence parallel"]
        record_max("LayerNorm + Dropout activations, plain TP / sequence parallel (W=2)", ratio)
        assert ratio == pytest.approx(2, rel=0.01), memory


def test_plan_for_sequence_parallel_names_every_style():
    block = tp.TransformerBlock(8, 4)
    plan = tp.plan_for(block, sequence_parallel=True)
    assert {n: repr(s) for n, s in plan.items()} == {
        "attention_norm": "SequenceParallel()",
        "mlp_norm": "SequenceParallel()",
        **{f"attention.{p}": "ColwiseParallel(sequence_parallel=True)" for p in "qkv"},
        "attention.out": "RowwiseParallel(sequence_parallel=True)",
        "mlp.up": "ColwiseParallel(sequence_parallel=True)",
        "mlp.down": "RowwiseParallel(sequence_parallel=True)",
    }
    with pytest.raises(ValueError, match="position embedding"):
        tp.plan_for(tp.TinyGPT(8, 8, 4, 1, 4), sequence_parallel=True)
