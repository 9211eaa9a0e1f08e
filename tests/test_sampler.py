"""MiniDDP's DistributedSampler must hand out exactly the indices torch's does."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

from miniddp.data_parallel.sampler import DistributedSampler

# Padding and dropping are most intricate when the dataset is no bigger than the world
# (N = 0, or N < R so padding wraps around), so small sizes get drawn as often as large ones.
DATASET_SIZES = st.integers(0, 16) | st.integers(0, 300)


@settings(max_examples=300, deadline=None)
@given(
    dataset_size=DATASET_SIZES,
    world_size=st.integers(1, 8),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**32),
    epoch=st.none() | st.integers(0, 1000),
    drop_last=st.booleans(),
)
@example(dataset_size=0, world_size=3, shuffle=True, seed=0, epoch=None, drop_last=False)
@example(dataset_size=2, world_size=8, shuffle=True, seed=1, epoch=5, drop_last=False)
@example(dataset_size=5, world_size=8, shuffle=False, seed=0, epoch=None, drop_last=True)
def test_matches_torch_on_every_rank(dataset_size, world_size, shuffle, seed, epoch, drop_last):
    dataset = range(dataset_size)
    for rank in range(world_size):
        options = dict(
            num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        ours = DistributedSampler(dataset, **options)
        theirs = TorchDistributedSampler(dataset, **options)
        if epoch is not None:
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
        assert list(ours) == list(theirs)
        assert len(ours) == len(theirs) == len(list(ours))


@settings(max_examples=100, deadline=None)
@given(
    dataset_size=DATASET_SIZES,
    world_size=st.integers(1, 8),
    shuffle=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_ranks_together_cover_the_dataset_in_equal_shares(dataset_size, world_size, shuffle, seed):
    shares = [
        list(DistributedSampler(range(dataset_size), world_size, rank, shuffle=shuffle, seed=seed))
        for rank in range(world_size)
    ]
    assert {index for share in shares for index in share} == set(range(dataset_size))
    assert len({len(share) for share in shares}) == 1


def test_padding_repeats_indices_from_the_start():
    shares = [list(DistributedSampler(range(10), 3, rank, shuffle=False)) for rank in range(3)]
    assert shares == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]


def test_padding_wraps_around_when_ranks_outnumber_samples():
    shares = [list(DistributedSampler(range(2), 5, rank, shuffle=False)) for rank in range(5)]
    assert shares == [[0], [1], [0], [1], [0]]


def test_drop_last_cuts_the_tail():
    shares = [
        list(DistributedSampler(range(10), 3, rank, shuffle=False, drop_last=True))
        for rank in range(3)
    ]
    assert shares == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]


def test_same_order_every_epoch_unless_set_epoch_is_called():
    sampler = DistributedSampler(range(50), 2, 0, seed=7)
    first_epoch = list(sampler)
    assert list(sampler) == first_epoch
    sampler.set_epoch(1)
    assert list(sampler) != first_epoch


@pytest.mark.parametrize("rank", [-1, 3, 4])
def test_rank_outside_the_world_is_rejected(rank):
    with pytest.raises(ValueError, match=rf"Invalid rank {rank}.*\[0, 2\]"):
        DistributedSampler(range(10), num_replicas=3, rank=rank)


def test_without_a_process_group_num_replicas_and_rank_are_required():
    if dist.is_initialized():
        pytest.skip("a process group is already running in this test process")
    with pytest.raises(RuntimeError, match="num_replicas and rank.*torchrun"):
        DistributedSampler(range(10))
    with pytest.raises(RuntimeError, match="num_replicas and rank"):
        DistributedSampler(range(10), num_replicas=2)


def test_defaults_come_from_the_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already running in this test process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sampler = DistributedSampler(range(10), shuffle=False)
        assert (sampler.num_replicas, sampler.rank) == (1, 0)
        assert list(sampler) == list(range(10))
    finally:
        dist.destroy_process_group()
