"""One mesh for every parallelism: the job's ranks as an n-dimensional grid, a group per axis.

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    parallelize_module(block, mesh["tp"], plan)            # TP inside each row
    stage = PipelineStage(part, mesh["pp"].get_local_rank(), 2, device, mesh["pp"].get_group())
    model = MiniDDP(stage_module, process_group=mesh["dp"].get_group())

The same call, names and layout as torch's `torch.distributed.device_mesh.init_device_mesh`, so
code moves between the two: the ranks are `torch.arange(W).view(mesh_shape)`, the last axis
fastest. For (pp, dp, tp) = (2, 2, 2), rank = 4·pp + 2·dp + tp:

                     tp=0 tp=1
        pp=0  dp=0  [  0    1  ]      a TP group is a row:        {0,1} {2,3} {4,5} {6,7}
              dp=1  [  2    3  ]      a DP group is a column:     {0,2} {1,3} {4,6} {5,7}
        pp=1  dp=0  [  4    5  ]      a PP group goes through the pages:
              dp=1  [  6    7  ]                                  {0,4} {1,5} {2,6} {3,7}

Along an axis, a rank's group is the ranks that differ from it in that coordinate only: rank 3
(pp 0, dp 1, tp 1) has TP group {2,3}, DP group {1,3} and PP group {3,7}.

Why TP goes last, on the fastest-moving axis: torchrun numbers a machine's GPUs consecutively,
so consecutive ranks share a node and its fast link (NVLink). TP talks inside every layer,
forward and backward, on the critical path: it needs that link. DP talks once a step, hidden
behind backward; PP sends one activation per microbatch to a neighbour. So the slow link
between machines carries PP's and DP's traffic, and TP's never leaves a node.

Each axis is built from `dist.new_group` (every rank creates every group, in the same order:
new_group is collective over the whole job). An axis whose group is the whole job reuses the
default group. `mesh["tp"]` is a 1-D mesh over this rank's TP group; its `get_group()` is what
MiniDDP, fully_shard and PipelineStage take as their group, and `parallelize_module` takes it
whole.

Two axes as one, `mesh["dp", "cp"]._flatten("dp_cp")`, as torch's DeviceMesh._flatten: a 1-D
mesh whose group is every rank of this rank's (dp, cp) plane, numbered dp-major (rank
dp · cp_size + cp), for what spans both, such as averaging gradients over dp x cp (torchtitan's
"dp_shard_cp"). Its groups are made once, on every rank (collective), and kept by the whole mesh:
afterwards `mesh["dp_cp"]` is the same 1-D mesh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from miniddp.job.env import HOW_TO_LAUNCH


class DeviceMesh:
    """This rank's view of a grid of ranks: the grid, the axes' names, and its group on each."""

    def __init__(
        self,
        device_type: str,
        mesh: torch.Tensor,
        mesh_dim_names: tuple[str, ...],
        groups: Sequence[dist.ProcessGroup],
    ) -> None:
        self.device_type = device_type
        self.mesh = mesh  # the global ranks, shaped as the grid
        self.mesh_dim_names = mesh_dim_names
        self._groups = list(groups)  # this rank's group along each axis
        # The whole job's mesh this one was cut from, and which of its axes this one's are:
        # what _flatten needs to build every plane's group, not only this rank's.
        self._root, self._root_axes = self, tuple(range(mesh.dim()))
        self._flattened: dict[str, DeviceMesh] = {}  # the root's: name -> its 1-D mesh

    @property
    def ndim(self) -> int:
        return self.mesh.dim()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    def size(self, mesh_dim: int | str | None = None) -> int:
        """The number of ranks in the mesh, or along one axis."""
        return self.mesh.numel() if mesh_dim is None else self.shape[self._axis(mesh_dim)]

    def get_group(self, mesh_dim: int | str | None = None) -> dist.ProcessGroup:
        """This rank's process group along `mesh_dim` (a 1-D mesh: its only axis)."""
        if mesh_dim is None and self.ndim != 1:
            raise ValueError(
                f"this mesh has {self.ndim} axes {self.mesh_dim_names}: say which group, "
                "get_group('dp'), or take a 1-D mesh first, mesh['dp'].get_group()"
            )
        return self._groups[self._axis(mesh_dim or 0)]

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's coordinate along `mesh_dim`: its rank inside that axis's group."""
        return dist.get_rank(self.get_group(mesh_dim))

    def get_rank(self) -> int:
        return dist.get_rank()

    def get_coordinate(self) -> list[int]:
        """Where this rank sits in the grid, one coordinate per axis."""
        return [int(c) for c in (self.mesh == dist.get_rank()).nonzero()[0]]

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh through this rank along the named axes: `mesh["tp"]` is its TP row."""
        names = (names,) if isinstance(names, str) else tuple(names)
        if len(names) == 1 and names[0] in self._root._flattened:
            return self._root._flattened[names[0]]
        axes = [self._axis(name) for name in names]
        here = self.get_coordinate()
        index = tuple(slice(None) if a in axes else here[a] for a in range(self.ndim))
        sub = self.mesh[index].permute(*[sorted(axes).index(a) for a in axes])
        part = DeviceMesh(self.device_type, sub, names, [self._groups[a] for a in axes])
        part._root, part._root_axes = self._root, tuple(self._root_axes[a] for a in axes)
        return part

    def _flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """This mesh's axes as one (torch's name and meaning): a 1-D mesh over all its ranks,
        named `mesh_dim_name` ("dp_cp" for ("dp", "cp") unless given). Collective the first
        time: every rank must call it, in the same order."""
        name = mesh_dim_name or "_".join(self.mesh_dim_names)
        known = self._root._flattened.get(name)
        if known is not None and known._root_axes == self._root_axes:
            return known
        if known is not None or name in self._root.mesh_dim_names:
            raise ValueError(
                f"the mesh already has an axis named {name!r}: flatten {self.mesh_dim_names} "
                "under another name"
            )
        grid, axes = self._root.mesh, self._root_axes
        others = [a for a in range(grid.dim()) if a not in axes]
        # Every plane of these axes is one group, ranks in this mesh's axis order (new_group
        # numbers them in increasing order: the same when the axes keep the root's order).
        planes = grid.permute(*others, *axes).reshape(-1, self.size()).tolist()
        mine = None
        for ranks in planes:
            group = dist.group.WORLD if len(ranks) == grid.numel() else dist.new_group(ranks)
            mine = group if dist.get_rank() in ranks else mine
        flat = DeviceMesh(self.device_type, self.mesh.flatten(), (name,), [mine])
        flat._root, flat._root_axes = self._root, axes
        self._root._flattened[name] = flat
        return flat

    def _axis(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, int) and 0 <= mesh_dim < self.ndim:
            return mesh_dim
        if mesh_dim in self.mesh_dim_names:
            return self.mesh_dim_names.index(mesh_dim)
        raise KeyError(f"no axis {mesh_dim!r} in this mesh; its axes are {self.mesh_dim_names}")

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.shape))
        return f"DeviceMesh({self.device_type!r}, {axes}, mesh={self.mesh.tolist()})"


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
) -> DeviceMesh:
    """Lay the job's W ranks out as `torch.arange(W).view(mesh_shape)` and build every axis's
    groups. Every rank must call it, with the same arguments."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"init_device_mesh needs a process group, and none exists. {HOW_TO_LAUNCH}"
        )
    mesh_shape = tuple(int(s) for s in mesh_shape)
    world_size = dist.get_world_size()
    names = tuple(mesh_dim_names or (f"dim_{i}" for i in range(len(mesh_shape))))
    if len(names) != len(mesh_shape) or len(set(names)) != len(names):
        raise ValueError(
            f"mesh_dim_names {names} must name each of the {len(mesh_shape)} axes of "
            f"{mesh_shape} once"
        )
    if math.prod(mesh_shape) != world_size or min(mesh_shape, default=0) < 1:
        raise ValueError(
            f"a mesh of shape {mesh_shape} holds {math.prod(mesh_shape)} ranks, but the job has "
            f"{world_size}: launch with --nproc_per_node={math.prod(mesh_shape)}, or choose "
            f"axes whose product is {world_size}"
        )
    mesh = torch.arange(world_size).view(mesh_shape)
    rank = dist.get_rank()
    groups = []
    for axis, size in enumerate(mesh_shape):
        # Every line of the grid along this axis is one group; new_group is called for all of
        # them on every rank, in the same order, and this rank keeps the one it is in.
        lines = mesh.movedim(axis, -1).reshape(-1, size).tolist()
        mine = None
        for ranks in lines:
            group = dist.group.WORLD if size == world_size else dist.new_group(ranks)
            if rank in ranks:
                mine = group
        groups.append(mine)
    return DeviceMesh(device_type, mesh, names, groups)
