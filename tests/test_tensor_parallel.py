"""Tensor parallelism (miniddp/tensor_parallel/) against one process and against torch's own
`torch.distributed.tensor.parallel`, on the same models, plans and batches.

What equality to expect, and why:

- against torch's tensor parallelism: **bitwise** (outputs, every gradient shard, parameters after
  every step) when the layers have no bias, because every rank then runs the same local
  operations in the same order as torch's DTensor does. With a bias, not bitwise: torch adds b/W
  on every rank before a rowwise all-reduce (its Replicate -> Partial), ours adds b once after
  it, as Megatron does: the same sum in another order. Both stay within rounding of one process.
- against one process: within 1e-5 of each tensor's largest magnitude plus one (measured: under
  1e-6). A shard's matmul has another shape than the whole one, so BLAS blocks its dot products
  differently (a (4, 8) x (8, 8) product is not bitwise the left half of the (4, 8) x (8, 16)
  one here), and a rowwise output is the sum of W partial products, not one long dot product.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miniddp.tensor_parallel import parallelize_module
from tests import tensor_parallel_tasks as tasks
from tests.harness.measurements import record_max
from tests.harness.properties import property_settings
from tests.tensor_parallel_tasks import TPSpec

ONE_PROCESS_TOLERANCE = 1e-5  # shard-shaped matmuls and a W-term sum: rounding, see above


@st.composite
def specs(draw, world_size: int) -> TPSpec:
    """A random model whose split sizes W divides: heads a multiple of W, vocabulary too. Widths
    from 4: a LayerNorm over 2 features is ill-conditioned (its output is always +-1, and its
    backward divides by |x1 - x2| / 2), so any rounding grows without bound there."""
    heads = world_size * draw(st.integers(1, 2))
    return TPSpec(
        model=draw(st.sampled_from(tasks.MODELS)),
        seed=draw(st.integers(0, 1000)),
        width=heads * draw(st.integers(-(-4 // heads), 3)),
        heads=heads,
        vocab=world_size * draw(st.integers(2, 5)),
        batch=draw(st.integers(1, 3)),
        length=draw(st.integers(1, 4)),
        steps=2,
        bias=draw(st.booleans()),
        fused_qkv=draw(st.booleans()),
    )


def check_against_one_process_and_torch(results: list[dict], spec: TPSpec) -> None:
    for rank, report in enumerate(results):
        for kind in ("ours", "torch"):
            for what, difference in report[kind].items():
                record_max(f"tensor parallel {kind} vs one process ({what})", difference)
                assert difference <= ONE_PROCESS_TOLERANCE, (rank, kind, what, difference)
        bitwise = report["bitwise"]
        if not spec.bias:
            assert bitwise["outputs"], f"rank {rank}: outputs differ from torch's TP"
            assert bitwise["grads"] == [], f"rank {rank}: gradients differ from torch's TP"
            assert bitwise["params"] == [], f"rank {rank}: parameters differ from torch's TP"


def test_one_block_equals_one_process_and_torch_bitwise(pool2):
    spec = TPSpec(model="block", bias=False)
    results = pool2.run(tasks.largest_differences, spec)
    check_against_one_process_and_torch(results, spec)
    # each rank kept torch.chunk's slice: q's rows, out's columns, LayerNorms whole
    shapes = results[0]["shapes"]
    assert shapes["attention.q.weight"] == (4, 8) and shapes["attention.out.weight"] == (8, 4)
    assert shapes["mlp.up.weight"] == (16, 8) and shapes["mlp.down.weight"] == (8, 16)
    assert shapes["attention_norm.weight"] == (8,) and shapes["mlp_norm.bias"] == (8,)
    # plain tensors throughout: a shard is an nn.Parameter, an output a torch.Tensor (no DTensor)
    assert results[0]["types"] == {"parameters": ["Parameter"], "output": "Tensor"}


@property_settings(max_examples=6)
@given(spec=specs(world_size=2))
def test_random_models_at_w2(rank_pools, spec):
    check_against_one_process_and_torch(rank_pools(2).run(tasks.largest_differences, spec), spec)


@property_settings(max_examples=2)
@given(spec=specs(world_size=4))
def test_random_models_at_w4(rank_pools, spec):
    check_against_one_process_and_torch(rank_pools(4).run(tasks.largest_differences, spec), spec)


def test_a_rowwise_bias_is_added_once_within_rounding_of_torchs(pool2):
    for report in pool2.run(tasks.largest_differences, TPSpec(model="mlp", bias=True)):
        for what, difference in report["ours"].items():
            assert difference <= ONE_PROCESS_TOLERANCE, what
        # not bitwise torch's: its b/W per rank is another order of the same sum
        assert not report["bitwise"]["outputs"]


@pytest.mark.parametrize("fused_qkv", [True, False])
def test_a_block_talks_twice_forward_and_twice_backward(pool2, fused_qkv):
    """Megatron's count: g after the attention and after the MLP forward, f before each in
    backward, every one of a (B, T, H) activation; the LayerNorms and residuals never talk.
    With q, k and v apart, x enters three times: 3 + 1 all-reduces backward."""
    spec = TPSpec(model="block", batch=2, length=3, width=8, fused_qkv=fused_qkv)
    activation = spec.batch * spec.length * spec.width
    for sizes in pool2.run(tasks.all_reduces_of_one_step, spec):
        assert sizes["forward"] == [activation] * 2
        assert sizes["backward"] == [activation] * (2 if fused_qkv else 4)


@pytest.mark.parametrize("tokens, vocab", [(6, 10), (1, 2), (13, 64)])
def test_vocab_parallel_cross_entropy_never_gathers_the_logits(pool2, tokens, vocab):
    """Three all-reduces of one number a token (max, sum of exp, target logit) instead of the
    tokens x vocabulary logits. Loss and gradient bitwise torch's `loss_parallel` on the same
    slices (softmax taken as exp(log_softmax), as torch's is), and within 1e-6 of one process's
    F.cross_entropy, scaled by their size (the sum of exp is added in W pieces)."""
    for result in pool2.run(tasks.cross_entropy_against_one_process, 3, tokens, vocab):
        assert result["sent"] == [tokens] * 3
        assert result["torch loss bitwise"] and result["torch grad bitwise"], result
        assert result["loss"] <= 1e-6 and result["grad"] <= 1e-6, result


def test_misuse_is_refused_with_the_problem_and_the_fix(pool2):
    for messages in pool2.run(tasks.refusals):
        odd = messages["odd size"]
        assert odd.startswith("ValueError") and "1.weight of shape (5, 4)" in odd
        assert "5 is not divisible by 2" in odd and "multiple of 2" in odd
        # refused before anything was swapped: the entry that would split stays whole
        unchanged = messages["unchanged after"]
        assert unchanged.startswith("ValueError") and unchanged.endswith("/ Linear")
        assert (
            messages["unknown name"].startswith("ValueError") and "'2'" in messages["unknown name"]
        )
        assert "is a ReLU" in messages["not a linear"]
        assert "divides its heads" in messages["heads"]
        # an id no rank owns would silently read zeros: refused, as one process refuses it
        assert messages["token id"].startswith("IndexError") and "[0, 8)" in messages["token id"]
        assert messages["target"].startswith("IndexError") and "ignore_index" in messages["target"]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ignored_targets_are_left_out_of_the_loss_as_one_process_leaves_them(pool2, reduction):
    """ignore_index (-100, F.cross_entropy's default: a padded batch) gives its token no loss and
    no gradient, and "mean" averages over the tokens kept, as one process does."""
    for result in pool2.run(tasks.cross_entropy_with_ignored_targets, reduction):
        assert result["loss"] < 1e-12 and result["grad"] < 1e-12, result
        assert result["ignored rows"] == 0.0


def test_a_group_without_this_rank_is_named(pool2):
    message = pool2.run(tasks.split_over_a_group_without_this_rank)[1]
    assert message.startswith("rank 1 is not in this tensor-parallel group (ranks 0)"), message


def test_without_a_process_group_it_says_how_to_launch():
    import torch

    with pytest.raises(RuntimeError, match="torchrun"):
        parallelize_module(torch.nn.Linear(2, 2), None, {})


def test_dp_by_tp_equals_one_process_on_the_global_batch(rank_pools):
    """A 2 x 2 mesh: ranks {0, 1} and {2, 3} each hold one copy of the model, split in two; MiniDDP
    averages each shard's gradient with its twin across the copies. Gradients and parameters
    after 3 steps within 1e-5 of one process on the whole batch (half of it per copy)."""
    spec = TPSpec(model="gpt", batch=4, steps=3)
    results = rank_pools(4).run(tasks.dp_tp_against_one_process, spec, 2, 2)
    assert [(r["dp_rank"], r["tp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank, result in enumerate(results):
        record_max("DP x TP vs one process (params)", result["params"])
        assert result["grads"] <= ONE_PROCESS_TOLERANCE, (rank, result)
        assert result["params"] <= ONE_PROCESS_TOLERANCE, (rank, result)
