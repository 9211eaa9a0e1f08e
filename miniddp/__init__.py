"""MiniDDP: PyTorch's DistributedDataParallel, rebuilt from scratch to be read."""

from miniddp.buckets import BucketInfo
from miniddp.ddp import MiniDDP
from miniddp.env import DistEnv, cleanup, init_distributed
from miniddp.events import Event
from miniddp.sampler import DistributedSampler
from miniddp.sharding import ZeroRedundancyOptimizer, full_state_dict, fully_shard

__all__ = [
    "BucketInfo",
    "DistEnv",
    "DistributedSampler",
    "Event",
    "MiniDDP",
    "ZeroRedundancyOptimizer",
    "cleanup",
    "full_state_dict",
    "fully_shard",
    "init_distributed",
]
