"""MiniDDP: PyTorch's DistributedDataParallel, rebuilt from scratch to be read, and from it the
rest of data and model parallelism. The tree says what each part is for:

    the DDP          ddp.py (MiniDDP, its whole life), buckets.py, layout.py, comm_hooks.py,
                     join.py (Join's hook), static_graph.py, same_model.py (every replica the
                     same model), autograd_graph.py (hooks, reachability), sampler.py
    the ladder       steps/: the DDP built up one idea a rung, ending with MiniDDP
    beyond DDP       sharding/ (ZeRO-1/2/3), tensor_parallel/, pipeline/; collectives/ (the
                     collectives themselves, from send/recv)
    composing them   mesh.py (init_device_mesh: one grid, a group per axis), placement.py (the
                     mark each parallelism leaves on its parameters), parallelize.py (the GPT
                     over a (pp, dp, tp) mesh)
    the job          job/: the environment, the wait seam and its faults, meeting points,
                     checkpoints
    watching         observe/: events, timelines, the simulated link, the overlap model,
                     the baselines
    measuring        bench/, figures/ (they import the library like a user; it never imports them)
    a real model     models/: the GPT chapter 12 trains

`miniddp.faults` and `miniddp.checkpoint`, the names users and the issues know, are
`miniddp.job.faults` and `miniddp.job.checkpoint` themselves (the same module objects).
"""

import sys

from miniddp.buckets import BucketInfo
from miniddp.ddp import MiniDDP
from miniddp.job import checkpoint, faults
from miniddp.job.env import DistEnv, cleanup, init_distributed
from miniddp.observe.events import Event
from miniddp.sampler import DistributedSampler
from miniddp.sharding import ZeroRedundancyOptimizer, full_state_dict, fully_shard

sys.modules[f"{__name__}.faults"] = faults
sys.modules[f"{__name__}.checkpoint"] = checkpoint

__all__ = [
    "BucketInfo",
    "DistEnv",
    "DistributedSampler",
    "Event",
    "MiniDDP",
    "ZeroRedundancyOptimizer",
    "checkpoint",
    "cleanup",
    "faults",
    "full_state_dict",
    "fully_shard",
    "init_distributed",
]
