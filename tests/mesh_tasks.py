"""Rank tasks for the mesh tests: one mesh per shape and names per worker (new_group is
collective over the whole job, and groups are never freed, so a worker builds each mesh once)."""

from __future__ import annotations

import torch.distributed as dist

from miniddp.mesh import DeviceMesh, init_device_mesh

_MESHES: dict[tuple, DeviceMesh] = {}


def mesh_once(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    key = (shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def axes_of(mesh, names: tuple[str, ...]) -> dict[str, tuple[list[int], int, int]]:
    """Per axis: the global ranks of this rank's group, its local rank, and the axis's size."""
    return {
        name: (
            dist.get_process_group_ranks(mesh[name].get_group()),
            mesh[name].get_local_rank(),
            mesh[name].size(),
        )
        for name in names
    }


def miniddp_and_torch_axes(shape: tuple[int, ...], names: tuple[str, ...]) -> tuple[dict, dict]:
    """This rank's groups along every axis, from MiniDDP's mesh and from torch's."""
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

    ours = mesh_once(shape, names)
    theirs = torch_init_device_mesh("cpu", shape, mesh_dim_names=names)
    return axes_of(ours, names), axes_of(theirs, names)


def sub_mesh_view(shape: tuple[int, ...], names: tuple[str, ...]) -> tuple[list, list[int]]:
    mesh = mesh_once(shape, names)
    sub = mesh[names[-1], names[0]]  # two axes, in an order of the caller's choosing
    return sub.mesh.tolist(), mesh.get_coordinate()


def refused(shape: tuple[int, ...], names: tuple[str, ...] | None) -> str:
    """What init_device_mesh says to a shape or names it cannot build."""
    try:
        init_device_mesh("cpu", shape, mesh_dim_names=names)
    except ValueError as error:
        return str(error)
    return "no error"


def get_group_of_a_3d_mesh() -> str:
    try:
        mesh_once((2, 2, 2), ("pp", "dp", "tp")).get_group()
    except ValueError as error:
        return str(error)
    return "no error"


def flattened_axes(shape: tuple[int, ...], names: tuple[str, ...]) -> tuple[tuple, tuple, bool]:
    """The group of the last two axes as one (`_flatten`), from MiniDDP's mesh and from torch's:
    its global ranks, this rank's place in it, its size; and whether mesh["a_b"] finds it after."""
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

    pair, name = names[-2:], "_".join(names[-2:])
    ours = mesh_once(shape, names)
    theirs = torch_init_device_mesh("cpu", shape, mesh_dim_names=names)
    described = []
    for mesh in (ours, theirs):
        flat = mesh[pair]._flatten(name)
        group = flat.get_group()
        described.append((dist.get_process_group_ranks(group), flat.get_local_rank(), flat.size()))
    return described[0], described[1], ours[name] is ours[pair]._flatten(name)
