"""miniddp.mesh.init_device_mesh against torch's own: the same grid, the same group along every
axis on every rank, and the mistakes refused before any group is built."""

from __future__ import annotations

import pytest

from tests import mesh_tasks


@pytest.mark.parametrize(
    "shape, names",
    [((2, 2, 2), ("pp", "dp", "tp")), ((4, 2), ("dp", "tp")), ((8,), ("dp",))],
)
def test_every_axis_groups_the_ranks_as_torchs_device_mesh_does(rank_pools, shape, names):
    results = rank_pools(8).run(mesh_tasks.miniddp_and_torch_axes, shape, names)
    for rank, (ours, theirs) in enumerate(results):
        assert ours == theirs, f"rank {rank}"
    if names == ("pp", "dp", "tp"):  # the grid the module's docstring draws
        ours = results[3][0]
        assert ours == {"pp": ([3, 7], 0, 2), "dp": ([1, 3], 1, 2), "tp": ([2, 3], 1, 2)}


def test_a_sub_mesh_of_two_axes_is_the_slice_through_this_rank(rank_pools):
    results = rank_pools(8).run(mesh_tasks.sub_mesh_view, (2, 2, 2), ("pp", "dp", "tp"))
    grid, coordinate = results[5]  # rank 5: pp 1, dp 0, tp 1
    assert coordinate == [1, 0, 1]
    # At dp = 0 the (pp, tp) slice is [[0, 1], [4, 5]]; asked for as ("tp", "pp"), transposed.
    assert grid == [[0, 4], [1, 5]]


def test_two_axes_flattened_are_one_group_as_torchs_flatten_makes(rank_pools):
    """mesh["dp", "cp"]._flatten("dp_cp"): the ranks of this rank's (dp, cp) plane, dp-major,
    as torch's DeviceMesh._flatten; built once, then found by name."""
    results = rank_pools(4).run(mesh_tasks.flattened_axes, (2, 1, 2), ("pp", "dp", "cp"))
    for rank, (ours, theirs, found) in enumerate(results):
        assert ours == theirs and found, f"rank {rank}: {ours} against torch's {theirs}"
    assert results[3][0] == ([2, 3], 1, 2)


@pytest.mark.parametrize(
    "shape, names, expected",
    [
        ((2, 2), ("dp", "tp"), "--nproc_per_node=4"),
        ((2, 1), ("dp", "dp"), "must name each of the 2 axes"),
        ((2,), ("dp", "tp"), "must name each of the 1 axes"),
    ],
)
def test_a_mesh_the_job_cannot_hold_is_refused_on_every_rank(pool2, shape, names, expected):
    for message in pool2.run(mesh_tasks.refused, shape, names):
        assert expected in message


def test_a_group_of_a_many_axis_mesh_must_name_its_axis(rank_pools):
    for message in rank_pools(8).run(mesh_tasks.get_group_of_a_3d_mesh):
        assert "get_group('dp')" in message
