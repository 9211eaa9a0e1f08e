"""DP x PP: dp copies of a p-stage pipeline, each stage data-parallel with its copies.

With W = dp * p ranks, rank r runs stage r % p of pipeline (replica) r // p:

    replica 0:  ranks 0 .. p-1          the pipeline group: stages talk to neighbours in it
    replica 1:  ranks p .. 2p-1
    stage s:    ranks s, s+p, s+2p ...  its data-parallel group: the same slice, other data

Each pipeline group carries activations and gradients; each data-parallel group averages one
slice's gradients (MiniDDP on that group). Neighbouring stages are neighbouring ranks, the
usual choice: on a real cluster the pipeline's many small messages stay within a node when p
divides the GPUs per node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Mesh:
    """This rank's place: its stage, its replica, and the two groups it belongs to."""

    stage_index: int
    replica: int
    num_stages: int
    replicas: int
    pipeline_group: dist.ProcessGroup
    data_parallel_group: dist.ProcessGroup


def build_mesh(num_stages: int, replicas: int) -> Mesh:
    """Create every pipeline and data-parallel group (every rank must call this, in the same
    order) and return this rank's."""
    world_size = dist.get_world_size()
    if num_stages * replicas != world_size:
        raise ValueError(
            f"{num_stages} stages x {replicas} replicas need {num_stages * replicas} ranks, "
            f"but the job has {world_size}: launch with --nproc_per_node={num_stages * replicas}"
            " or change the split"
        )
    rank = dist.get_rank()
    pipelines = [list(range(r * num_stages, (r + 1) * num_stages)) for r in range(replicas)]
    stages = [list(range(s, world_size, num_stages)) for s in range(num_stages)]
    # new_group is collective over the whole job: every rank creates every group.
    pipeline_groups = [dist.new_group(ranks) for ranks in pipelines]
    data_groups = [dist.new_group(ranks) for ranks in stages]
    stage_index, replica = rank % num_stages, rank // num_stages
    return Mesh(
        stage_index=stage_index,
        replica=replica,
        num_stages=num_stages,
        replicas=replicas,
        pipeline_group=pipeline_groups[replica],
        data_parallel_group=data_groups[stage_index],
    )
