"""Bucket layout rules, checked against torch's own assignment function (no processes needed)."""

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from miniddp.data_parallel.bucket import Bucket, describe_layout
from miniddp.data_parallel.layout import assign_buckets, bucket_caps, initial_layout

DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def torch_assignment(tensors, limits, order=None):
    """torch's C++ reducer's bucket assignment, as exposed for testing."""
    if order is None:
        return dist._compute_bucket_assignment_by_size(tensors, limits)[0]
    ordered = [tensors[i] for i in order]
    return dist._compute_bucket_assignment_by_size(ordered, limits, [], list(order))[0]


tensor_lists = st.lists(
    st.tuples(st.integers(1, 300), st.sampled_from(DTYPES)), min_size=1, max_size=25
).map(lambda specs: [torch.zeros(n, dtype=d) for n, d in specs])
caps = st.tuples(st.integers(0, 3000), st.integers(0, 3000))  # the first bucket's, the rest's


@settings(max_examples=300, deadline=None)
@given(tensors=tensor_lists, limits=caps)
def test_registration_order_layout_equals_torch(tensors, limits):
    ours = assign_buckets(tensors, range(len(tensors)), *limits)
    ours.sort(key=min)  # torch sorts by smallest index when no order is given
    assert ours == torch_assignment(tensors, list(limits))


@settings(max_examples=300, deadline=None)
@given(tensors=tensor_lists, limits=caps, data=st.data())
def test_ready_order_layout_equals_torch(tensors, limits, data):
    order = data.draw(st.permutations(range(len(tensors))))
    ours = assign_buckets(tensors, order, *limits)
    theirs = torch_assignment(tensors, list(limits), order)
    # The buckets left partly filled at the end (one per dtype) come in hash-map order in torch:
    # compare membership and inner order always, the sequence when there is one dtype.
    assert sorted(ours) == sorted(theirs)
    if len({t.dtype for t in tensors}) == 1:
        assert ours == theirs


def test_a_bucket_closes_after_the_tensor_that_reaches_the_cap():
    tensors = [torch.zeros(100) for _ in range(3)]  # 400 bytes each
    assert assign_buckets(tensors, range(3), 500, 500) == [[0, 1], [2]]  # overshoots by one tensor
    assert assign_buckets(tensors, range(3), 400, 400) == [[0], [1], [2]]  # == cap closes too
    assert assign_buckets(tensors, range(3), 400, 10_000) == [[0], [1, 2]]  # small first cap


def test_dtypes_never_share_a_bucket():
    tensors = [torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(4)]
    assert assign_buckets(tensors, range(3), 10_000, 10_000) == [[0, 2], [1]]


def test_initial_layout_is_one_bucket_per_dtype_until_the_rebuild():
    params = [torch.zeros(300_000), torch.zeros(300_000), torch.zeros(10, dtype=torch.float64)]
    first, cap = bucket_caps(None)
    assert initial_layout(params, first, cap, find_unused_parameters=False) == [[2], [0, 1]]
    # With find_unused_parameters the capped layout is built at once, last parameters first.
    assert initial_layout(params, 1_000_000, 1_000_000, True) == [[2], [1], [0]]
    # The rebuild puts the earliest-ready gradients first, under the small first cap.
    assert assign_buckets(params, [1, 0, 2], 1_000_000, 25 * 2**20) == [[1], [0], [2]]


def test_bucket_caps_follow_torch():
    assert bucket_caps(None) == (2**20, 25 * 2**20)
    assert bucket_caps(25) == (25 * 2**20, 25 * 2**20)
    assert bucket_caps(0.0001) == (104, 104)  # int(0.0001 * 2**20): a teaching value


@pytest.mark.parametrize("bad", [0, -1, 0.0, math.nan, math.inf, "25", True])
def test_bad_bucket_caps_are_rejected_with_the_fix(bad):
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive"):
        bucket_caps(bad)


def test_bucket_views_share_the_flat_tensor():
    params = [torch.zeros(2, 3), torch.zeros(4)]
    bucket = Bucket(0, [1, 0], params)
    assert [tuple(v.shape) for v in bucket.views] == [(4,), (2, 3)]
    bucket.views[1].fill_(7.0)
    assert bucket.flat.tolist() == [0.0] * 4 + [7.0] * 6
    assert bucket.nbytes == 40
    table = describe_layout([bucket.describe(["a", "b"])])
    assert "b (4), a (6)" in table
