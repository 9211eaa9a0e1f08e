"""The ladder: DDP built up one idea at a time, each rung a complete DDP in one file.

    1  naive_ddp.py     after backward, one blocking all-reduce per gradient
    2  overlap.py       each gradient's all-reduce launched from its hook, during backward
    3  buckets.py       gradients packed into a few flat buckets, launched in a fixed order
    4  torch_layout.py  torch's bucket layout: from here on, bitwise torch's DDP at any W
    5  no_sync.py       no_sync(): the forward decides whether its backward synchronizes
    6  unused.py        find_unused_parameters: a parameter without a gradient still lets its
                        bucket travel
    7  comm_hooks.py    register_comm_hook (torch's protocol) and gradient_as_bucket_view
    8  ../data_parallel/ddp.py
                        MiniDDP: the same algorithm, plus what production needs: same-model
                        checks, named faults, Join, static_graph, a process group

A rung never imports another rung: read any one file alone, and `python -m miniddp.steps diff 2 3`
shows exactly what one idea adds. MiniDDP lives in several files, so `diff 7 8` compares definition
by definition (rung 7's `Bucket` with miniddp/data_parallel/bucket.py's, its wrapper with
`MiniDDP`, ...): what production adds. `LADDER` lists the rung classes in order; each says in
`claims` which of `CLAIMS` it supports, so that the same property tests can run over every rung (and
over a learner's own class).
"""

from miniddp.data_parallel.ddp import MiniDDP
from miniddp.steps.buckets import BucketedDDP
from miniddp.steps.comm_hooks import CommHookDDP
from miniddp.steps.naive_ddp import NaiveDDP
from miniddp.steps.no_sync import NoSyncDDP
from miniddp.steps.overlap import OverlapDDP
from miniddp.steps.torch_layout import TorchLayoutDDP
from miniddp.steps.unused import UnusedParametersDDP

CLAIMS = frozenset(
    {
        "batchnorm",  # buffers (BatchNorm's statistics) broadcast from rank 0 at each forward
        "mixed-dtypes",  # parameters of several dtypes in one model
        "torch-layout",  # torch's bucket layout: bitwise torch's DDP at any world size
        "no-sync",  # no_sync() decided at forward; buffers refreshed as torch's (and the
        # broadcast_buffers keyword)
        "find-unused-parameters",  # the find_unused_parameters keyword
        "comm-hook",  # register_comm_hook, torch's hook protocol
        "gradient-as-bucket-view",  # the gradient_as_bucket_view keyword
    }
)

LADDER = [
    NaiveDDP,
    OverlapDDP,
    BucketedDDP,
    TorchLayoutDDP,
    NoSyncDDP,
    UnusedParametersDDP,
    CommHookDDP,
    MiniDDP,
]

__all__ = [
    "CLAIMS",
    "LADDER",
    "BucketedDDP",
    "CommHookDDP",
    "MiniDDP",
    "NaiveDDP",
    "NoSyncDDP",
    "OverlapDDP",
    "TorchLayoutDDP",
    "UnusedParametersDDP",
]
