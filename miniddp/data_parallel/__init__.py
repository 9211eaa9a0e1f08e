"""Data parallelism, DDP's core: every rank a whole replica, gradients averaged during backward.

    ddp.py              MiniDDP, its whole life in one file: construct -> forward -> hooks ->
                        buckets -> wait -> no_sync, and Join's hook for uneven inputs
    bucket.py           a bucket's life: add, full, launch, wait, write back, reset
    layout.py           torch's bucket layout rules, and the layout's life (one rebuild)
    default_hooks.py    the Reducer each bucket holds (the group, a comm hook, the wait seam),
                        and register_comm_hook's built-ins: MiniDDP over its own all-reduces
    compute_copies.py   MixedPrecision: fp32 masters, bf16 copies for forward and backward
    static_graph.py     static_graph's helper: hooks counted once, then trusted
    autograd_graph.py   the hooks, the parameters a backward won't reach, usage on any rank
    sampler.py          DistributedSampler: each rank its share of the data

`from miniddp import MiniDDP` is the name to use; this package is where it lives.
"""

from miniddp.data_parallel.bucket import BucketInfo
from miniddp.data_parallel.compute_copies import MixedPrecision
from miniddp.data_parallel.ddp import MiniDDP
from miniddp.data_parallel.sampler import DistributedSampler

__all__ = ["BucketInfo", "DistributedSampler", "MiniDDP", "MixedPrecision"]
