"""MiniDDP's behaviour beyond the numbers: errors on bad input, construction-time broadcast,
overlap during backward, no_sync's savings and gradient_as_bucket_view."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from miniddp import MiniDDP
from tests import ddp_tasks
from tests.harness.pool import RankFailure


def every_rank_raised(outcomes: list, error: str, *phrases: str) -> None:
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, RankFailure), f"rank {rank} did not raise"
        assert outcome.type_name == error, f"rank {rank}: {outcome.type_name}: {outcome.message}"
        for phrase in phrases:
            assert phrase in outcome.message, f"rank {rank}: {phrase!r} not in {outcome.message!r}"


@pytest.mark.skipif(dist.is_initialized(), reason="needs a process without a process group")
def test_without_a_process_group_says_how_to_launch():
    with pytest.raises(RuntimeError, match="no(ne)?.*torchrun"):
        MiniDDP(nn.Linear(2, 2))


BAD_CONSTRUCTION = {
    "cap_zero": ("ValueError", "bucket_cap_mb must be a positive", "got 0"),
    "cap_nan": ("ValueError", "bucket_cap_mb must be a positive", "got nan"),
    "no_trainable": ("ValueError", "no parameter that requires grad"),
    "sparse": ("ValueError", "sparse gradients", "sparse=False"),
    "shape_mismatch": ("ValueError", "same model and settings", "'0.weight'", "rank 1"),
    "count_mismatch": ("ValueError", "same model and settings", "6 parameters", "rank 1 has 8"),
    "settings_mismatch": ("ValueError", "bucket_cap_mb", "(1048576, 1048576) on rank 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONSTRUCTION))
def test_bad_construction_raises_on_every_rank(pool2, case):
    error, *phrases = BAD_CONSTRUCTION[case]
    outcomes = pool2.run_expecting_errors(ddp_tasks.construct, case, timeout=60)
    every_rank_raised(outcomes, error, *phrases)


def test_backward_twice_on_one_synced_forward_raises(pool2):
    outcomes = pool2.run_expecting_errors(ddp_tasks.backward_twice, timeout=60)
    every_rank_raised(outcomes, "RuntimeError", "backward ran twice", "no_sync")


def test_unused_parameter_is_named_at_the_end_of_that_backward(pool2):
    outcomes = pool2.run_expecting_errors(ddp_tasks.unused_parameter_without_find_unused)
    every_rank_raised(
        outcomes, "RuntimeError", "extra.weight", "extra.bias", "find_unused_parameters=True"
    )


def test_training_continues_after_the_unused_parameter_error(pool2):
    # rank r feeds x = r + 1 to a sum over 3 samples: the averaged gradient is 3 * mean(1, 2).
    assert pool2.run(ddp_tasks.recovers_after_unused_parameter_error) == [4.5, 4.5]


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_construction_copies_rank_0s_parameters_and_buffers(pool2, broadcast_buffers):
    (rank0_before, rank0_after), (rank1_before, rank1_after) = pool2.run(
        ddp_tasks.weights_after_construction, broadcast_buffers
    )
    assert any(not torch.equal(a, b) for a, b in zip(rank0_before, rank1_before))
    for original, on_rank0, on_rank1 in zip(rank0_before, rank0_after, rank1_after):
        assert torch.equal(original, on_rank0)
        assert torch.equal(original, on_rank1)


def test_buckets_launch_while_backward_is_still_running(rank_pools):
    for events in rank_pools(2).run(ddp_tasks.events_of_second_iteration):
        kinds = [kind for kind, _ in events]
        first_launch = kinds.index("launch")
        last_hook = len(kinds) - 1 - kinds[::-1].index("hook")
        assert first_launch < last_hook, "no bucket was launched before backward finished"
        launches = [name for kind, name in events if kind == "launch"]
        assert launches == sorted(launches, key=lambda n: int(n.split()[1])), "out of order"
        assert len(launches) >= 3


@pytest.mark.parametrize("steps", [1, 3])
def test_no_sync_communicates_once_per_accumulation(pool2, steps):
    (with_no_sync, buckets), _ = pool2.run(ddp_tasks.all_reduces_for_accumulation, steps, True)
    (without, _), _ = pool2.run(ddp_tasks.all_reduces_for_accumulation, steps, False)
    assert buckets > 1
    assert with_no_sync == buckets
    assert without == steps * buckets


def test_gradient_as_bucket_view_makes_grad_the_bucket(pool2):
    assert pool2.run(ddp_tasks.grad_is_bucket_view) == [True, True]


def same_gradients(ours: list, theirs: list) -> bool:
    return all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(ours, theirs, strict=True)
    )


def test_reentrant_checkpointing_of_the_block_whose_gradients_come_first(pool2):
    """The end-of-backward wait belongs to the outer backward, not to the checkpoint's inner
    one, so the earlier layers' gradients are still reduced: bitwise what torch's DDP gives."""
    ours = pool2.run(ddp_tasks.reentrant_checkpoint_of_the_last_block, False)
    theirs = pool2.run(ddp_tasks.reentrant_checkpoint_of_the_last_block, True)
    for rank in range(2):
        for step, (a, b) in enumerate(zip(ours[rank], theirs[rank])):
            assert same_gradients(a, b), f"rank {rank} step {step} differs from torch's DDP"


def test_a_module_wrapped_again_trains_like_torch(pool2):
    """The newer wrapper takes the module's hooks over: its backward averages as usual."""
    ours = pool2.run(ddp_tasks.gradients_after_wrapping, 2, False)
    theirs = pool2.run(ddp_tasks.gradients_after_wrapping, 2, True)
    assert all(same_gradients(a, b) for a, b in zip(ours, theirs))


def test_the_older_wrapper_refuses_once_a_newer_one_owns_the_hooks(pool2):
    outcomes = pool2.run_expecting_errors(ddp_tasks.old_wrapper_after_a_new_one, timeout=60)
    every_rank_raised(outcomes, "RuntimeError", "newer MiniDDP")


@pytest.mark.parametrize("kind", ["dict", "tuple", "namedtuple", "dataclass"])
def test_structured_outputs_with_an_ignored_head_train_like_torch(pool2, kind):
    """find_unused_parameters finds tensors in dicts, tuples, namedtuples and dataclasses; a head
    reachable from the output but left out of the loss is unused: its .grad stays None. (With a
    dataclass both heads are used: torch's DDP itself refuses an ignored one there.)"""
    ours = pool2.run(ddp_tasks.structured_output_with_an_ignored_head, kind, False)
    theirs = pool2.run(ddp_tasks.structured_output_with_an_ignored_head, kind, True)
    for rank in range(2):
        for step, (a, b) in enumerate(zip(ours[rank], theirs[rank])):
            assert same_gradients(a, b), f"rank {rank} step {step} differs from torch's DDP"
        if kind != "dataclass":
            assert ours[rank][-1][-1] is None, "the ignored head should keep .grad None"


def test_a_model_on_meta_is_refused_at_construction_with_the_fix(pool2):
    outcomes = pool2.run_expecting_errors(ddp_tasks.model_on_meta, timeout=60)
    every_rank_raised(outcomes, "ValueError", "meta device", "to_empty")


def test_a_fresh_forward_works_after_an_error_inside_backward(pool2):
    assert pool2.run(ddp_tasks.fresh_forward_after_an_error_in_backward) == [3.0, 3.0]
