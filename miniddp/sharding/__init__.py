"""Beyond DDP: shard what every rank would otherwise keep W copies of, on MiniDDP's collectives.

memory.py              where a rank's bytes go, counted from storages, and the formulas
zero.py                ZeRO-1: each rank keeps and steps only its partition's optimizer state
zero2.py               ZeRO-2: a comm hook that reduce-scatters each bucket onto the owners
fully_shard.py         ZeRO-3: each rank keeps 1/W of every parameter, gathered around its module;
                       over a 2-D mesh, HSDP: sharded inside a node, replicated across
sharded_parameters.py  one fully_shard unit: its shards, and the collectives that move them
prefetch.py            fully_shard's overlap: the next unit's gather, the last reduce-scatter
unit_lanes.py          a recorded fully_shard step as lanes: compute, all-gather, reduce-scatter
mixed_precision.py     fully_shard's MixedPrecisionPolicy: bf16 compute, fp32 masters
loss_scaling.py        ShardedGradScaler: float16's loss scaler, its overflow check the job's
units.py               fully_shard's units by number, and the mistakes it refuses at the call
full_state.py          a fully sharded model's and optimizer's full state, out and back in
clipping.py            clip_grad_norm_ over the ranks: the true norm under every stage
"""

from miniddp.sharding.clipping import clip_grad_norm_
from miniddp.sharding.full_state import (
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
)
from miniddp.sharding.fully_shard import fully_shard
from miniddp.sharding.loss_scaling import ShardedGradScaler
from miniddp.sharding.memory import (
    Formula,
    MemoryPerRank,
    ddp_buckets,
    ddp_compute_copies,
    measure_memory,
)
from miniddp.sharding.mixed_precision import MixedPrecisionPolicy
from miniddp.sharding.zero import ZeroRedundancyOptimizer, partition
from miniddp.sharding.zero2 import reduce_scatter_hook

__all__ = [
    "Formula",
    "MemoryPerRank",
    "MixedPrecisionPolicy",
    "ShardedGradScaler",
    "ZeroRedundancyOptimizer",
    "clip_grad_norm_",
    "ddp_buckets",
    "ddp_compute_copies",
    "full_optimizer_state_dict",
    "full_state_dict",
    "fully_shard",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "measure_memory",
    "partition",
    "reduce_scatter_hook",
]
