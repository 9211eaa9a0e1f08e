"""Beyond DDP: shard what every rank would otherwise keep W copies of, on MiniDDP's collectives.

memory.py        where a rank's bytes go, counted from storages, and the formulas
zero.py          ZeRO-1: each rank keeps and steps only its partition's optimizer state
"""

from miniddp.sharding.fully_shard import full_state_dict, fully_shard
from miniddp.sharding.memory import Formula, MemoryPerRank, ddp_buckets, measure_memory
from miniddp.sharding.zero import ZeroRedundancyOptimizer, partition
from miniddp.sharding.zero2 import reduce_scatter_hook

__all__ = [
    "Formula",
    "MemoryPerRank",
    "ZeroRedundancyOptimizer",
    "ddp_buckets",
    "full_state_dict",
    "fully_shard",
    "measure_memory",
    "partition",
    "reduce_scatter_hook",
]
